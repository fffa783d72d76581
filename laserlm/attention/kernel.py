"""The block-sparse attention kernel plugged into the engine (``Engine.kernel``).

``SparseAttention`` is called by :func:`laserlm.runtime.attention.laser_attention_forward` as
``kernel(query, key, value, mask, scaling, layer_idx, ctx)`` and dispatches:

- dense SDPA for the first ``dense_layers`` layers, sliding-window layers (their window already bounds
  the work), sequences with fewer than ``min_blocks`` key blocks (nothing worth skipping) and
  ``threshold = inf``;
- :func:`~laserlm.attention.decode.sparse_decode` (Quest bounds) for forwards of at most
  ``decode_max_tokens`` new tokens;
- :func:`~laserlm.attention.prefill.block_sparse_prefill` otherwise.

Per-layer statistics go to ``ctx.layer_stats[layer] = {"density", "select_s", "attn_s", "path"}`` and are
accumulated in :attr:`SparseAttention.totals`. Use :func:`configure` to attach it to an engine; it is
independent of the decoding mode (adaptive depth, speculative decoding) since it only replaces the
attention computation of whichever layers run.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import fields

from ..errors import InvalidArgumentError
from ..runtime.attention import dense_attention
from ..runtime.options import from_spec
from .decode import BlockSummaries, sparse_decode
from .prefill import block_sparse_prefill, make_plan
from .selection import SparseConfig


class SparseAttention:
    """Block-sparse attention kernel with its settings and running statistics.

    Args:
        config: :class:`~laserlm.attention.selection.SparseConfig` (validated here).
        layer_types: optional per-layer ``"full_attention"`` / ``"sliding_attention"``; sliding layers
            stay dense.

    Attributes:
        totals: ``layer -> {"calls", "density_sum", "select_s", "attn_s", "dense_s"}`` accumulated stats.
    """

    def __init__(self, config: SparseConfig | None = None, layer_types: list[str] | None = None):
        self.config = (config or SparseConfig()).validate()
        self.layer_types = layer_types
        self.summaries = BlockSummaries(self.config.block_size)
        self.totals: dict = defaultdict(lambda: defaultdict(float))

    def _dense_layer(self, layer_idx: int) -> bool:
        if layer_idx is None or layer_idx < self.config.dense_layers:
            return True
        if self.layer_types is not None and layer_idx < len(self.layer_types):
            return self.layer_types[layer_idx] != "full_attention"
        return False

    def __call__(self, query, key, value, mask, scaling, layer_idx, ctx):
        cfg = self.config
        t, s = query.shape[2], key.shape[2]
        nk = -(-s // cfg.block_size)
        if self._dense_layer(layer_idx) or nk < max(cfg.min_blocks, 2) or (
                cfg.rule == "threshold" and math.isinf(cfg.threshold)) or (cfg.rule == "mass" and cfg.tau >= 1):
            return self._dense(query, key, value, mask, scaling, layer_idx, ctx)
        q_start = s - t
        if t <= cfg.decode_max_tokens:
            kmin, kmax, _ = self.summaries.get(layer_idx, key, q_start)
            out, info = sparse_decode(query, key, value, mask, scaling, q_start, cfg, kmin, kmax)
            info["path"] = "decode"
        else:
            plans = ctx.__dict__.setdefault("_sparse_plans", {}) if ctx is not None else {}
            pkey = (id(mask), t, s, cfg.block_size)
            if pkey not in plans:
                plans[pkey] = (make_plan(mask, t, s, q_start, cfg), mask)  # keep mask alive: stable id
            out, info = block_sparse_prefill(query, key, value, mask, scaling, q_start, cfg, plan=plans[pkey][0])
            info["path"] = "prefill"
        info.pop("keep", None)
        self._record(layer_idx, ctx, info)
        return out

    def _dense(self, query, key, value, mask, scaling, layer_idx, ctx):
        import time  # noqa: PLC0415

        t0 = time.perf_counter()
        # same fast path as the engine's dense attention: a prefill from key 0 whose mask is the plain
        # causal one (the context's cached no-window, no-hole mask) uses SDPA's is_causal
        plain = ctx is not None and ctx.is_plain_causal_mask(mask, key.shape[2], layer_idx)
        out = dense_attention(query, key, value, None if plain else mask, scaling, is_causal=plain)
        self._record(layer_idx, ctx, {"density": 1.0, "select_s": 0.0, "attn_s": time.perf_counter() - t0,
                                      "path": "dense"})
        return out

    def _record(self, layer_idx, ctx, info) -> None:
        if ctx is not None:
            ctx.layer_stats[layer_idx] = info
        tot = self.totals[layer_idx]
        tot["calls"] += 1
        tot[f"{info.get('path', 'sparse')}_calls"] += 1
        tot["density_sum"] += info["density"]
        tot["select_s"] += info["select_s"]
        tot["attn_s"] += info["attn_s"]

    def reset_stats(self) -> None:
        self.totals.clear()

    def summary(self) -> dict:
        """Mean density over sparse layers, and total selection / attention seconds."""
        sparse = [v for k, v in self.totals.items() if not self._dense_layer(k)]
        calls = sum(v["calls"] for v in sparse)
        return {
            "density": sum(v["density_sum"] for v in sparse) / calls if calls else 1.0,
            "select_s": sum(v["select_s"] for v in self.totals.values()),
            "attn_s": sum(v["attn_s"] for v in self.totals.values()),
        }


ATTENTION_KEYS = tuple(f.name for f in fields(SparseConfig))  # the options of 'sparse:...'


def parse_attention(spec, **options) -> SparseConfig | None:
    """Turn an attention setting into a config (``None`` = dense).

    ``spec``: ``None`` / ``"dense"``, ``"sparse"``, ``"sparse:threshold=0.5,block_size=64"``, a
    :class:`SparseConfig` or a dict of its fields; ``options`` override fields (``None`` values ignored).

    Raises:
        InvalidArgumentError: unknown attention name or option, or a value of the wrong type / range.
    """
    options = {k: v for k, v in options.items() if v is not None}
    if spec is None or spec == "dense":
        if options:
            raise InvalidArgumentError(f"sparse attention options {sorted(options)} need attention='sparse' (--attention sparse)")
        return None
    if isinstance(spec, SparseConfig):
        given = dict(spec.__dict__)
    elif isinstance(spec, dict):
        given = dict(spec)
    elif isinstance(spec, str):
        name, _, rest = spec.partition(":")
        if name != "sparse":
            raise InvalidArgumentError(f"unknown attention {name!r}; expected 'dense' or 'sparse'")
        given = {}
        for part in filter(None, rest.split(",")):
            k, eq, v = part.partition("=")
            if not eq:
                raise InvalidArgumentError(f"bad attention option {part!r}; expected key=value")
            given[k.strip()] = v.strip()
    else:
        raise InvalidArgumentError(f"attention must be 'dense', 'sparse[:k=v,...]' or a SparseConfig, got {spec!r}")
    given.update(options)
    return from_spec(SparseConfig, given, "sparse attention").validate()


def configure(engine, attention="dense", **options) -> SparseAttention | None:
    """Set ``engine.kernel`` for ``attention`` (see :func:`parse_attention`); returns the kernel or ``None``.

    Raises:
        InvalidArgumentError: bad settings (see :class:`SparseConfig`), or ``dense_layers`` above the
            model's layer count.
    """
    cfg = parse_attention(attention, **options)
    if cfg is None:
        engine.kernel = None
        return None
    if cfg.dense_layers > engine.num_layers:
        raise InvalidArgumentError(f"dense_layers={cfg.dense_layers} exceeds the model's {engine.num_layers} layers")
    kernel = SparseAttention(cfg, layer_types=list(engine.adapter.layer_types))
    engine.kernel = kernel
    return kernel
