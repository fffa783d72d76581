"""Layer groups: a partition of the decoder layers into consecutive groups with exit points between them.

A token may stop only at a group boundary (an *exit point*). The seed (Laser) calls them micro-layer
groups: 40 layers -> 8 groups of 5. The earliest allowed exit is the *min depth*, by default a quarter of
the layers (the seed's recommendation).

Spec strings (usable inside a mode spec, hence no commas):

- ``"5"``: groups of 5 layers (the last group takes the remainder);
- ``"8/16/24/30"``: group end boundaries (exit points after 8, 16 and 24 layers; the last must be L);
- ``"0-7/8-15/16-29"``: explicit inclusive layer ranges, which must tile ``0 .. L-1`` without gaps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..runtime.options import is_int

DEFAULT_GROUP_SIZE = 5


@dataclass(frozen=True)
class LayerGroups:
    """Consecutive groups ``[(start, stop), ...]`` (``stop`` exclusive) covering ``0 .. num_layers``.

    Attributes:
        bounds: the groups as half-open ``(start, stop)`` layer ranges.
        num_layers: L, the decoder layers of the model.
        min_depth: the earliest exit, in layers; exit points ``stop < min_depth`` are never checked.
    """

    bounds: tuple[tuple[int, int], ...]
    num_layers: int
    min_depth: int

    def __len__(self) -> int:
        return len(self.bounds)

    @property
    def exit_points(self) -> list[int]:
        """Layer counts after which a token may exit (group ends below L and at or above min depth)."""
        return [b for _, b in self.bounds if self.min_depth <= b < self.num_layers]

    def can_exit(self, group: int) -> bool:
        """Whether a token may stop after group ``group``."""
        stop = self.bounds[group][1]
        return self.min_depth <= stop < self.num_layers

    def group_ending_at(self, layer: int) -> int:
        """Index of the group whose end boundary is ``layer`` (raises InvalidArgumentError if none)."""
        for g, (_, b) in enumerate(self.bounds):
            if b == layer:
                return g
        raise InvalidArgumentError(f"no layer group ends at layer {layer}; group ends: {[b for _, b in self.bounds]}")

    def describe(self) -> str:
        return "/".join(f"{a}-{b - 1}" for a, b in self.bounds)


def default_min_depth(num_layers: int) -> int:
    """A quarter of the layers, rounded up (the seed's default min depth)."""
    return max(1, -(-num_layers // 4))


def _check_bounds(bounds: list[tuple[int, int]], num_layers: int) -> None:
    if not bounds:
        raise InvalidArgumentError("layer groups are empty: give at least one group")
    for a, b in bounds:
        if b <= a:
            raise InvalidArgumentError(f"empty layer group {a}-{b - 1}: a group needs at least one layer")
        if a < 0 or b > num_layers:
            raise InvalidArgumentError(
                f"layer group {a}-{b - 1} is out of range: the model has layers 0-{num_layers - 1}")
    srt = sorted(bounds)
    for (a0, b0), (a1, b1) in zip(srt, srt[1:]):
        if a1 < b0:
            raise InvalidArgumentError(f"layer groups {a0}-{b0 - 1} and {a1}-{b1 - 1} overlap")
        if a1 > b0:
            raise InvalidArgumentError(f"layers {b0}-{a1 - 1} belong to no layer group (groups must tile all layers)")
    if srt != list(bounds):
        raise InvalidArgumentError("layer groups must be listed in layer order")
    if srt[0][0] != 0:
        raise InvalidArgumentError(f"layers 0-{srt[0][0] - 1} belong to no layer group (groups must start at layer 0)")
    if srt[-1][1] != num_layers:
        raise InvalidArgumentError(
            f"layers {srt[-1][1]}-{num_layers - 1} belong to no layer group (the last group must end at layer "
            f"{num_layers - 1})")


def make_groups(spec=None, num_layers: int = 0, min_depth: int | None = None) -> LayerGroups:
    """Build :class:`LayerGroups` for a model with ``num_layers`` decoder layers.

    Args:
        spec: ``None`` (groups of 5), an int group size, a spec string (module docstring), a list of end
            boundaries ``[8, 16, 30]`` or a list of ``(start, stop)`` half-open ranges.
        min_depth: earliest exit in layers (default: a quarter of the layers); ``0 <= min_depth <= L``.

    Raises:
        InvalidArgumentError: empty, overlapping, out-of-range or gapped groups, a bad size, a bad min depth.
    """
    if num_layers <= 0:
        raise InvalidArgumentError(f"the model has no decoder layers ({num_layers})")
    if spec is None or spec == "":
        spec = DEFAULT_GROUP_SIZE
    bounds: list[tuple[int, int]]
    if isinstance(spec, str):
        s = spec.strip()
        try:
            if "-" in s:
                bounds = []
                for part in s.split("/"):
                    a, _, b = part.partition("-")
                    bounds.append((int(a), int(b) + 1))
            elif "/" in s:
                spec = [int(x) for x in s.split("/") if x.strip()]
            else:
                spec = int(s)
        except ValueError:
            raise InvalidArgumentError(
                f"bad layer groups '{spec}': use a group size ('5'), end boundaries ('8/16/30') or layer ranges "
                "('0-7/8-15/16-29')") from None
        else:
            if "-" in s:
                spec = bounds
    if isinstance(spec, bool):
        raise InvalidArgumentError(f"bad layer groups {spec!r}")
    if isinstance(spec, int):
        if spec <= 0:
            raise InvalidArgumentError(f"layer group size must be a positive integer, got {spec}")
        if spec > num_layers:
            raise InvalidArgumentError(f"layer group size {spec} exceeds the model's {num_layers} layers")
        bounds = [(a, min(a + spec, num_layers)) for a in range(0, num_layers, spec)]
    else:
        spec = list(spec)
        if spec and all(isinstance(x, int) for x in spec):
            ends = list(spec)
            if any(b > num_layers or b <= 0 for b in ends):
                bad = next(b for b in ends if b > num_layers or b <= 0)
                raise InvalidArgumentError(
                    f"group boundary {bad} is out of range: boundaries are layer counts in 1-{num_layers}")
            if any(b1 <= b0 for b0, b1 in zip(ends, ends[1:])):
                raise InvalidArgumentError(f"group boundaries must be strictly increasing (empty group), got {ends}")
            if ends[-1] != num_layers:
                ends.append(num_layers)
            starts = [0] + ends[:-1]
            bounds = list(zip(starts, ends))
        else:
            try:
                bounds = [(int(a), int(b)) for a, b in spec]
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"bad layer groups {spec!r}: expected (start, stop) pairs") from None
    _check_bounds(bounds, num_layers)
    if min_depth is None:
        min_depth = default_min_depth(num_layers)
    if not is_int(min_depth) or not 0 <= min_depth <= num_layers:
        raise InvalidArgumentError(f"min depth must be an integer in 0-{num_layers} layers, got {min_depth!r}")
    return LayerGroups(tuple(bounds), num_layers, min_depth)
