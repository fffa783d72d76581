"""Reduced-precision safety (seed 004 §5.3): norms in float32, a range monitor on every decoder layer's output,
and a float16 guard that falls back to float32 for a layer that would overflow, so float16 never produces silent
garbage.

- :class:`RangeMonitor`: forward hooks on the decoder layers recording, per layer, the largest ``|x|`` of its output,
  the count of NaN and of ±inf values, and the calls seen (``laserlm generate --monitor-ranges``).
- :func:`fp32_norms`: every Llama-family RMSNorm multiplies its weight in float32 (transformers normalises in
  float32 but multiplies the weight after casting back to the activation dtype); the result is cast to the
  activation dtype only at the end, as the next matmul's input. Gemma3's RMSNorm already does all of it in float32.
- :class:`Float16Guard` (installed by :class:`~laserlm.runtime.engine.Engine` for a float16 model): each decoder
  layer runs in float16; when its output is not finite or exceeds ``limit`` (default ``65504 / 2``, headroom for
  the next layer's residual additions), the layer is re-run in float32 (a float32 copy of that layer, made once,
  reading and writing the float16 KV cache), and from then on that layer always runs in float32 (``fallback``).
  A float32 layer's output stays float32 until it fits float16 again. A layer that is not finite even in float32
  raises :class:`~laserlm.errors.PrecisionError` naming it; ``mode="refuse"`` raises instead of falling back.
"""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass, field

import torch

from ..errors import PrecisionError

FP16_MAX = float(torch.finfo(torch.float16).max)


@dataclass
class LayerRange:
    """What one decoder layer's outputs looked like: ``max_abs`` (largest finite ``|x|``), ``nan``, ``inf`` counts,
    ``calls``, ``fp32_calls`` (calls run in float32 by the guard)."""

    max_abs: float = 0.0
    nan: int = 0
    inf: int = 0
    calls: int = 0
    fp32_calls: int = 0

    def add(self, x: torch.Tensor) -> None:
        nan = torch.isnan(x)
        inf = torch.isinf(x)
        self.nan += int(nan.sum())
        self.inf += int(inf.sum())
        finite = x[~(nan | inf)]
        if finite.numel():
            self.max_abs = max(self.max_abs, float(finite.abs().max()))
        self.calls += 1


class RangeMonitor:
    """Per-layer output ranges of ``engine``'s decoder layers (forward hooks; remove with :meth:`close`).

    ``ranges``: ``layer -> LayerRange``. Hooks make the engine call the transformers layers instead of its fast
    path (same operations, a little slower).
    """

    def __init__(self, engine):
        self.engine = engine
        self.ranges = {i: LayerRange() for i in range(engine.num_layers)}
        self._handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(engine.adapter.layers)]

    def _hook(self, i):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            self.ranges[i].add(out.detach())
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def report(self) -> list[dict]:
        """One row per layer: ``layer``, ``max_abs``, ``nan``, ``inf``, ``calls``, ``fp16_headroom`` (65504 / max)."""
        guard = getattr(self.engine, "precision_guard", None)
        rows = []
        for i, r in self.ranges.items():
            rows.append({"layer": i, "max_abs": r.max_abs, "nan": r.nan, "inf": r.inf, "calls": r.calls,
                         "fp16_headroom": FP16_MAX / r.max_abs if r.max_abs else None,
                         "fp32_fallback": bool(guard and i in guard.fallback)})
        return rows

    def print_table(self, file=sys.stderr) -> None:
        rows = self.report()
        print("layer  max|x|      NaN    inf  fp16 headroom  fp32", file=file)
        for r in rows:
            room = f"{r['fp16_headroom']:13.4g}" if r["fp16_headroom"] is not None else f"{'-':>13}"
            print(f"{r['layer']:5d}  {r['max_abs']:10.4g} {r['nan']:5d} {r['inf']:6d}  {room}  "
                  f"{'yes' if r['fp32_fallback'] else ''}", file=file)


def _fp32_weight_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Llama-family RMSNorm with the weight multiplied in float32 (see the module docstring)."""
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight.float() * h).to(input_dtype)


def fp32_norms(model) -> int:
    """Make every Llama-family RMSNorm of ``model`` compute in float32 up to its output cast; returns how many."""
    n = 0
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RMSNorm") and not name.startswith("Gemma") and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_fp32_weight_norm, m)
            n += 1
    return n


class _Fp32Window:
    """A cache window seen by a float32 layer: writes K/V into the (float16) cache, returns them as float32."""

    def __init__(self, window):
        self.window = window

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.window.update(key_states.to(self.window.k[layer_idx].dtype),
                                  value_states.to(self.window.v[layer_idx].dtype), layer_idx, *args, **kwargs)
        return k.float(), v.float()

    def __getattr__(self, name):
        return getattr(self.window, name)


@dataclass
class Float16Guard:
    """See the module docstring. Attributes: ``limit``, ``mode`` (``fallback`` | ``refuse`` | ``off``: raw float16,
    for the precision profile only), ``fallback`` (layers that overflowed and now run in float32), ``events``
    (``(layer, max_abs)`` of each overflow seen), ``fp32_calls`` (layer -> calls run in float32, including those
    whose input did not fit float16)."""

    engine: object
    limit: float = FP16_MAX / 2
    mode: str = "fallback"
    fallback: set = field(default_factory=set)
    events: list = field(default_factory=list)
    fp32_calls: dict = field(default_factory=dict)
    _fp32: dict = field(default_factory=dict)

    def install(self) -> Float16Guard:
        e = self.engine
        if e._packed:
            from ..errors import InvalidArgumentError  # noqa: PLC0415

            raise InvalidArgumentError("float16 runs on dense weights only; use --weights fp32 with --dtype float16, "
                                       "or bfloat16 / float32 activations for packed weights")
        fp32_norms(e.model)
        for i, layer in enumerate(e.adapter.layers):
            orig = type(layer).forward.__get__(layer)
            layer.forward = self._wrap(i, layer, orig)
            e._fast_ok.discard(id(layer))  # the fast path would bypass the guard
        norm = e.adapter.norm
        norm_fwd = norm.forward
        norm.forward = lambda x: norm_fwd(x).to(torch.float16)  # a float32 stream leaves the final norm as float16
        return self

    def _layer32(self, i: int, layer):
        if i not in self._fp32:
            patched = layer.__dict__.pop("forward")
            try:
                self._fp32[i] = copy.deepcopy(layer).float()
            finally:
                layer.forward = patched
        return self._fp32[i]

    def _wrap(self, i, layer, orig):
        def forward(hidden, *args, **kwargs):
            if self.mode == "off":  # monitoring only: the raw float16 layer (precision profile)
                return orig(hidden, *args, **kwargs)
            if i not in self.fallback:
                x = hidden
                fits = x.dtype == torch.float16 or bool(x.abs().max() <= self.limit)
                if fits:
                    out = orig(x.to(torch.float16), *args, **kwargs)
                    o = out[0] if isinstance(out, tuple) else out
                    mx = o.abs().max()
                    if bool(torch.isfinite(mx)) and float(mx) <= self.limit:
                        return out
                    self.events.append((i, float(mx)))
                    if self.mode == "refuse":
                        raise PrecisionError(f"decoder layer {i} overflows float16 (max |x| {float(mx):.4g} > limit "
                                             f"{self.limit:.4g}); run with --dtype float32 or bfloat16")
                    self.fallback.add(i)
            self.fp32_calls[i] = self.fp32_calls.get(i, 0) + 1
            kw = dict(kwargs)
            if kw.get("cache") is not None:
                kw["cache"] = _Fp32Window(kw["cache"])
            if kw.get("position_embeddings") is not None:
                kw["position_embeddings"] = tuple(t.float() for t in kw["position_embeddings"])
            out = self._layer32(i, layer)(hidden.float(), *args, **kw)
            o = out[0] if isinstance(out, tuple) else out
            if not bool(torch.isfinite(o).all()):
                raise PrecisionError(f"decoder layer {i} produces NaN/inf even in float32: the model or its input is "
                                     "broken")
            return out

        return forward
