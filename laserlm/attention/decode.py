"""Block-sparse decode with Quest's per-block key bounds.

Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024)
keeps, per KV block, the element-wise minimum ``m`` and maximum ``M`` of its keys. For any key ``k`` in
the block and any query ``q``::

    q . k = sum_d q_d k_d <= sum_d max(q_d m_d, q_d M_d) = relu(q) . M + min(q, 0) . m  =: U(q, block)

so a decode query scores all blocks from ``2 * S / block_size`` summary rows instead of ``S`` keys, and
only the selected blocks' keys and values are read.

Selection (per query head, union over the GQA group and over the step's queries):

- ``threshold`` rule: keep block ``j`` iff ``scaling * U_j >= L - c * log(S)``, where ``L`` is the query's
  true logit on its own key (a lower bound of its largest logit). Guarantee: every key whose logit is
  within ``c * log(S)`` of ``L`` lies in a kept block, in particular the true top-scoring key; each dropped
  key has probability ``< S**-c``.
- ``mass`` rule: the fewest blocks whose softmax mass of the *bounds* (``scaling * U_j + log(keys)``)
  reaches ``tau`` (a heuristic: bounds overestimate the logits).
- ``token_budget`` (optional, Quest's budget): at most ``token_budget // block_size`` blocks besides the
  sink and local ones, highest bounds first.

The sink block and the local block(s) are always kept.

The summaries are kept per layer in :class:`BlockSummaries` and refreshed lazily: only blocks that hold
positions written by the current step are recomputed when the layer's cache tensor was written exactly
once since the last call (PyTorch's in-place version counter tells); any other write (bridges writing
K/V of skipped layers, a different tensor) triggers a full recompute, so the bounds are always exact.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from .selection import SparseConfig


def block_minmax(key: torch.Tensor, block_size: int, start_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max of keys per block.

    ``key [N, S, D]`` -> ``(kmin, kmax)`` each ``[N, nK - start_block, D]`` for blocks ``start_block ..``
    (the last block may be partial; padding never enters the bounds).
    """
    s = key.shape[1]
    part = key[:, start_block * block_size:]
    pad = (-part.shape[1]) % block_size
    nb = (part.shape[1] + pad) // block_size
    lo = F.pad(part, (0, 0, 0, pad), value=float("inf")).view(key.shape[0], nb, block_size, -1).amin(2)
    hi = F.pad(part, (0, 0, 0, pad), value=float("-inf")).view(key.shape[0], nb, block_size, -1).amax(2)
    del s
    return lo, hi


def quest_upper_bound(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's bound ``U [N, G, T, nK]`` >= ``q . k`` for every key of each block (unscaled).

    ``query [N, G, T, D]``, ``kmin/kmax [N, nK, D]``.
    """
    n, g, t, d = query.shape
    q2 = torch.cat([query.clamp(min=0), query.clamp(max=0)], -1).reshape(n, g * t, 2 * d)
    bounds = torch.cat([kmax, kmin], -1)  # [N, nK, 2D]
    return torch.bmm(q2, bounds.transpose(1, 2)).view(n, g, t, -1)


class BlockSummaries:
    """Per-layer Quest summaries ``kmin/kmax [N, nK, D]``, kept in step with the KV cache lazily."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._layers: dict[int, dict] = {}

    def get(self, layer_idx: int, key: torch.Tensor, q_start: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Bounds for ``key [B, Hkv, S, D]`` whose positions ``q_start ..`` were just written.

        Returns ``(kmin, kmax, full)`` (``[N, nK, D]`` each; ``full`` tells a full recompute happened).
        """
        bs = self.block_size
        b, hkv, s, d = key.shape
        k = key.reshape(b * hkv, s, d)
        nk = -(-s // bs)
        ver, ptr = key._version, key.data_ptr()
        e = self._layers.get(layer_idx)
        incremental = (e is not None and e["ptr"] == ptr and e["version"] + 1 == ver and e["n"] == b * hkv
                       and q_start <= e["len"] and e["lo"].dtype == key.dtype)
        if incremental:
            j0 = min(q_start // bs, e["nk"])
            cap = e["lo"].shape[1]
            if nk > cap:
                grow = max(nk, 2 * cap)
                for name in ("lo", "hi"):
                    t = e[name].new_empty(b * hkv, grow, d)
                    t[:, :cap] = e[name]
                    e[name] = t
            lo, hi = block_minmax(k, bs, j0)
            e["lo"][:, j0:nk] = lo
            e["hi"][:, j0:nk] = hi
        else:
            lo, hi = block_minmax(k, bs, 0)
            e = {"lo": lo, "hi": hi}
            self._layers[layer_idx] = e
        e.update(ptr=ptr, version=ver, n=b * hkv, len=s, nk=nk)
        return e["lo"][:, :nk], e["hi"][:, :nk], not incremental

    def clear(self) -> None:
        self._layers.clear()


def select_decode_blocks(query: torch.Tensor, key: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                         visible: torch.Tensor, forced: torch.Tensor, q_idx: torch.Tensor, scaling: float,
                         cfg: SparseConfig) -> torch.Tensor:
    """Blocks kept for a few queries: ``[N, nK]`` bool (union over the ``G`` heads and ``T`` queries).

    ``query [N, G, T, D]``, ``key [N, S, D]``, ``visible/forced [T, nK]`` bool, ``q_idx [T]`` key index of
    each query's own key (its true logit there is the lower bound ``L``).
    """
    s = key.shape[1]
    ub = quest_upper_bound(query, kmin, kmax).float() * scaling  # [N, G, T, nK]
    ub = ub.masked_fill(~visible, float("-inf"))
    if cfg.rule == "threshold":
        if math.isinf(cfg.threshold):
            keep = visible.expand_as(ub)
        else:
            own = key[:, q_idx]  # [N, T, D]
            low = (query * own.unsqueeze(1)).sum(-1, keepdim=True).float() * scaling  # [N, G, T, 1]
            keep = ub >= low - cfg.gap(float(s))
    else:
        counts = torch.full((kmin.shape[1],), float(cfg.block_size))
        counts[-1] = s - (kmin.shape[1] - 1) * cfg.block_size
        p = torch.softmax(ub + torch.log(counts), -1)
        ps, order = torch.sort(p, dim=-1, descending=True)
        before = torch.cumsum(ps, -1) - ps
        keep_sorted = before < cfg.tau * (1 - 1e-6) if cfg.tau < 1 else torch.ones_like(ps, dtype=torch.bool)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    keep = keep & ~forced
    if cfg.token_budget:
        nb = max(0, cfg.token_budget // cfg.block_size)
        best = ub.masked_fill(forced, float("-inf")).masked_fill(~keep, float("-inf")).amax(dim=(1, 2))  # [N, nK]
        if nb < best.shape[-1]:
            top = torch.topk(best, nb, dim=-1).indices if nb else best.new_zeros(best.shape[0], 0, dtype=torch.long)
            capped = torch.zeros_like(best, dtype=torch.bool).scatter(-1, top, True) & torch.isfinite(best)
            return capped | (forced & visible).any(0)
        return torch.isfinite(best) | (forced & visible).any(0)
    return keep.any(1).any(1) | (forced & visible).any(0)


def sparse_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  scaling: float, q_start: int, cfg: SparseConfig, kmin: torch.Tensor, kmax: torch.Tensor,
                  keep: torch.Tensor | None = None, dense_above: float = 0.5) -> tuple[torch.Tensor, dict]:
    """Attention of a few new queries over a long KV cache, reading only the selected blocks.

    Args:
        query: ``[B, H, T, D]`` (T small); key, value: ``[B, Hkv, S, D]``; mask: ``[T, S]`` bool or None.
        q_start: key index of the first query (``S - T``).
        kmin, kmax: ``[B * Hkv, nK, D]`` block bounds (:class:`BlockSummaries`).
        keep: optional precomputed ``[B * Hkv, nK]`` selection (tests).
        dense_above: when some KV head keeps more than this fraction of the blocks, the kept blocks are
            not gathered: plain SDPA over all keys is computed (cheaper than a gather of most of the cache;
            then the output is exactly dense attention and ``density`` still reports the selection).

    Returns:
        ``(output [B, H, T, D], info)``; ``info`` holds ``density`` (kept / visible key blocks),
        ``select_s``, ``attn_s`` and ``keep``.
    """
    t0 = time.perf_counter()
    b, h, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    g, n, bs = h // hkv, b * hkv, cfg.block_size
    nk = -(-s // bs)
    q = query.reshape(n, g, t, d)
    k = key.reshape(n, s, d)
    v = value.reshape(n, s, d)
    if mask is None:
        mp = None
        visible = torch.ones(t, nk, dtype=torch.bool)
    else:
        mp = F.pad(mask, (0, nk * bs - s))
        visible = mp.view(t, nk, bs).any(-1)
    q_idx = torch.arange(q_start, q_start + t)
    j = torch.arange(nk)
    first = torch.div(q_idx, bs, rounding_mode="floor") - (cfg.local_blocks - 1)
    forced = ((j[None] >= first[:, None]) & (j[None] <= torch.div(q_idx, bs, rounding_mode="floor")[:, None])) | (j[None] == 0)
    forced &= visible
    if keep is None:
        keep = select_decode_blocks(q, k, kmin, kmax, visible, forced, q_idx, scaling, cfg)
    t1 = time.perf_counter()
    cnt = keep.sum(-1)
    kmax_n = int(cnt.max())
    if kmax_n > dense_above * nk:  # reading most blocks anyway: plain SDPA is cheaper than gathering
        o = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
        density = keep.sum().item() / max(1, n * visible.any(0).sum().item())
        return o, {"density": density, "select_s": t1 - t0, "attn_s": time.perf_counter() - t1, "keep": keep}
    idx = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)[:, :kmax_n]  # [N, kmax]
    valid = torch.arange(kmax_n) < cnt[:, None]
    kb = F.pad(k, (0, 0, 0, nk * bs - s)).view(n, nk, bs, d) if s % bs else k.view(n, nk, bs, d)
    vb = F.pad(v, (0, 0, 0, nk * bs - s)).view(n, nk, bs, d) if s % bs else v.view(n, nk, bs, d)
    n_ix = torch.arange(n)[:, None]
    kg = kb[n_ix, idx].reshape(n, 1, kmax_n * bs, d)
    vg = vb[n_ix, idx].reshape(n, 1, kmax_n * bs, d)
    if mp is None:
        cols = (idx[..., None] * bs + torch.arange(bs)).reshape(n, 1, kmax_n * bs)
        mg = (cols < s) & valid.repeat_interleave(bs, -1).unsqueeze(1)  # [n, 1, K]
        mg = mg.unsqueeze(1).expand(n, 1, t, kmax_n * bs)
    else:
        tiles = mp.view(t, nk, bs)
        mg = tiles[:, idx]  # [t, n, kmax, bs]
        mg = (mg & valid[None, :, :, None]).permute(1, 0, 2, 3).reshape(n, 1, t, kmax_n * bs)
    o = F.scaled_dot_product_attention(q, kg.expand(-1, g, -1, -1), vg.expand(-1, g, -1, -1),
                                       attn_mask=mg, scale=scaling)
    t2 = time.perf_counter()
    density = keep.sum().item() / max(1, n * visible.any(0).sum().item())
    return o.reshape(b, h, t, d), {"density": density, "select_s": t1 - t0, "attn_s": t2 - t1, "keep": keep}
