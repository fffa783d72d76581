"""KV eviction policies for a request whose context outgrows its share of the pool.

A policy is a small frozen config with ``apply(cache)`` (called after every commit of a
:class:`~laserlm.runtime.kv_pool.PagedCache`; it drops pages with ``cache.drop_page(layer, logical)``) and
``max_pages_per_request(num_layers, page_size)`` (the most pages a request can hold under it, used by the
scheduler's admission control). Evicted positions are no longer attended at that layer; the positions (and the
rotary phases) of the kept keys do not change. Eviction works at page granularity: a page is kept or dropped
whole.

- :class:`StreamingEviction` — StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention
  Sinks", ICLR 2024): keep the first ``sinks`` positions (rounded up to whole pages) and the pages that hold
  the last ``window`` positions, in every layer.
- :class:`DepthLRUEviction` — the seed's policy (seed 000 §3.2: LRU over two dimensions, token position and
  layer depth): each request keeps at most ``budget`` positions per layer on average (``budget * L`` page
  slots); past that, pages are dropped in order of the score ``age + depth`` where
  ``age = (newest - i) / newest`` (0 for the newest logical page ``i``, 1 for the oldest) and
  ``depth = layer / (L - 1)``: older pages of deeper layers go first. Ties go to the deeper layer, then the
  older page. The sink pages and the pages of the last ``recent`` positions are never dropped.

Not built: a score-based policy (H2O, Zhang et al. 2023; SnapKV, Li et al. 2024), which keeps the keys with the
most accumulated attention. It needs every layer's attention probabilities at every decode step; on the paged pool
the compiled layer kernel (``LayerStack.run_paged``) runs a whole stack of layers in one call and does not return
them, so a layer whose probabilities are wanted leaves that call for the per-layer PyTorch path, the path several
times slower per row than the kernel. With every layer wanted, the policy would cost more decode time than the eviction saves here; it is
cheap only once the kernel accumulates the per-page attention mass itself.

Spec strings (``--eviction``): ``none``, ``streaming[:sinks=4,window=256]``,
``depth_lru[:budget=512,sinks=4,recent=64]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidArgumentError
from .options import from_spec


def _positive(name, value):
    if value <= 0:
        raise InvalidArgumentError(f"eviction option {name} must be positive, got {value}")


@dataclass(frozen=True)
class StreamingEviction:
    """Attention sinks plus a recent window (StreamingLLM). ``sinks``, ``window`` in positions."""

    sinks: int = 4
    window: int = 256
    name = "streaming"

    def __post_init__(self):
        _positive("window", self.window)
        if self.sinks < 0:
            raise InvalidArgumentError(f"eviction option sinks must be >= 0, got {self.sinks}")

    def kept_logical(self, length: int, page_size: int) -> set[int]:
        """Logical pages kept for a cache of ``length`` positions."""
        n = math.ceil(length / page_size)
        sink = min(math.ceil(self.sinks / page_size), n)
        first_recent = max(0, (length - self.window) // page_size)
        return set(range(sink)) | set(range(first_recent, n))

    def apply(self, cache) -> None:
        keep = self.kept_logical(cache.length, cache.pool.page_size)
        for i in range(cache.num_logical):
            if i in keep:
                continue
            for layer in range(cache.pool.num_layers):
                if int(cache.table[layer, i]):
                    cache.drop_page(layer, i)

    def max_pages_per_request(self, num_layers: int, page_size: int) -> int:
        # sinks + the window's pages (+1: the window need not start on a page boundary) + the page being written
        return num_layers * (math.ceil(self.sinks / page_size) + math.ceil(self.window / page_size) + 2)


@dataclass(frozen=True)
class DepthLRUEviction:
    """The seed's depth-aware LRU (see the module docstring). ``budget``, ``sinks``, ``recent`` in positions."""

    budget: int = 512
    sinks: int = 4
    recent: int = 64
    name = "depth_lru"

    def __post_init__(self):
        _positive("budget", self.budget)
        _positive("recent", self.recent)
        if self.sinks < 0:
            raise InvalidArgumentError(f"eviction option sinks must be >= 0, got {self.sinks}")
        if self.budget < self.sinks + self.recent:
            raise InvalidArgumentError(f"depth_lru budget {self.budget} must cover sinks + recent "
                                       f"({self.sinks} + {self.recent})")

    def order(self, cache) -> list[tuple[int, int]]:
        """Evictable ``(layer, logical page)`` pairs of ``cache``, first to go first."""
        ps, L = cache.pool.page_size, cache.pool.num_layers
        n = math.ceil(cache.length / ps)
        protected = set(range(min(math.ceil(self.sinks / ps), n))) | set(
            range(max(0, (cache.length - self.recent) // ps), n))
        newest = max(n - 1, 1)
        cands = [(layer, i) for layer in range(L) for i in range(cache.num_logical)
                 if i not in protected and int(cache.table[layer, i])]
        return sorted(cands, key=lambda c: (-((newest - c[1]) / newest + c[0] / max(L - 1, 1)), -c[0], c[1]))

    def apply(self, cache) -> None:
        ps, L = cache.pool.page_size, cache.pool.num_layers
        limit = math.ceil(self.budget / ps) * L
        over = cache.owned_pages() - limit
        if over <= 0:
            return
        for layer, i in self.order(cache)[:over]:
            cache.drop_page(layer, i)

    def max_pages_per_request(self, num_layers: int, page_size: int) -> int:
        # the budget, plus the protected pages when they exceed it, plus the page being written
        protected = math.ceil(self.sinks / page_size) + math.ceil(self.recent / page_size) + 1
        return num_layers * (max(math.ceil(self.budget / page_size), protected) + 1)


POLICIES = {"streaming": StreamingEviction, "depth_lru": DepthLRUEviction}


def parse_eviction(spec):
    """``None`` / ``"none"`` -> ``None``; ``"streaming:sinks=4,window=256"`` / ``"depth_lru:budget=512"`` -> a
    policy; a policy object passes unchanged.

    Raises:
        InvalidArgumentError: unknown policy or bad options.
    """
    if spec is None or not isinstance(spec, str):
        return spec
    from .modes import parse_spec  # noqa: PLC0415

    name, opts = parse_spec(spec)
    if name in ("", "none"):
        if opts:
            raise InvalidArgumentError("eviction 'none' takes no options")
        return None
    if name not in POLICIES:
        raise InvalidArgumentError(f"unknown eviction policy {name!r}; known: none, {', '.join(POLICIES)}")
    return from_spec(POLICIES[name], opts, f"eviction {name}")
