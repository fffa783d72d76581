"""Block-sparse prefill: exact attention restricted to the selected key blocks (gather-then-SDPA).

The (KV head, query block) pairs are sorted by their number of kept key blocks and cut into chunks
of ``R`` pairs; for each chunk the selected key/value blocks are gathered into a padded
``[R, 1, K_max * block_size, D]`` tensor (``K_max`` the largest count in the chunk, so sorting keeps the
padding small) and one batched PyTorch SDPA call computes exact softmax attention
over them; the boolean mask of the gathered blocks (causal inside the diagonal block, sliding windows,
KV holes, padding) is gathered from the engine's ``[T, S]`` mask. Unselected blocks are never read.
Chosen over FlexAttention + BlockMask, which was slower on CPU.

Source: seed 004 (progressive block attention); gather-based block-sparse attention as in MoBA /
MInference's block-sparse kernels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .selection import SparseConfig, block_counts, forced_blocks, pool_blocks, select_blocks


@dataclass
class BlockPlan:
    """Block layout of one prefill (shared by every layer with the same mask).

    Attributes:
        mask_blocks: ``[nQ, nK, bs, bs]`` bool, the padded mask cut into (query block, key block) tiles.
        visible: ``[nQ, nK]`` bool, tiles with at least one visible (query, key) pair.
        forced: ``[nQ, nK]`` bool, sink + local tiles (always kept), within ``visible``.
        n_keys: ``[nQ]`` visible keys of each query block's last real query.
        key_counts: ``[nK]`` real keys per key block.
        causal: the mask is exactly causal and the queries start on a block boundary (fast path: only
            the diagonal tiles need masking).
    """

    mask_blocks: torch.Tensor
    visible: torch.Tensor
    forced: torch.Tensor
    n_keys: torch.Tensor
    key_counts: torch.Tensor
    causal: bool = False


def make_plan(mask: torch.Tensor | None, t: int, s: int, q_start: int, cfg: SparseConfig) -> BlockPlan:
    """Tile the ``[T, S]`` mask (``None`` = all visible) for queries at key indices ``q_start ..``."""
    bs = cfg.block_size
    nq, nk = -(-t // bs), -(-s // bs)
    tp, sp = nq * bs, nk * bs
    mp = torch.zeros(tp, sp, dtype=torch.bool)
    if mask is None:
        mp[:t, :s] = True
    else:
        mp[:t, :s] = mask
    if tp > t:
        mp[t:] = mp[t - 1]  # padded queries copy the last real one (their outputs are dropped)
    tiles = mp.view(nq, bs, nk, bs).permute(0, 2, 1, 3)
    visible = tiles.any(-1).any(-1)
    starts = q_start + torch.arange(nq) * bs
    ends = torch.clamp(starts + bs, max=q_start + t)
    forced = forced_blocks(starts, ends, nk, cfg) & visible
    last_rows = torch.clamp(torch.arange(1, nq + 1) * bs, max=t) - 1
    n_keys = mp[last_rows].sum(-1)
    causal = False
    if mask is not None and q_start % bs == 0:
        ref = torch.arange(s)[None, :] <= (q_start + torch.arange(t))[:, None]
        causal = torch.equal(mask, ref)
    return BlockPlan(tiles.contiguous(), visible, forced, n_keys, block_counts(s, bs), causal)


def coarse_scores(query: torch.Tensor, key: torch.Tensor, scaling: float, bs: int) -> torch.Tensor:
    """Coarse logits ``[N, G, nQ, nK]`` from ``query [N, G, T, D]`` and ``key [N, S, D]`` (mean pooling)."""
    t, s = query.shape[-2], key.shape[-2]
    qp = F.pad(query, (0, 0, 0, (-t) % bs))
    kp = F.pad(key, (0, 0, 0, (-s) % bs))
    qm = pool_blocks(qp, bs, t)
    km = pool_blocks(kp, bs, s)
    return torch.matmul(qm, km.unsqueeze(1).transpose(-1, -2)) * scaling


def block_sparse_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                         scaling: float, q_start: int, cfg: SparseConfig, plan: BlockPlan | None = None,
                         rows_per_call: int = 32, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Block-sparse attention of many queries.

    Args:
        query: ``[B, H, T, D]``; key, value: ``[B, Hkv, S, D]`` (``H`` a multiple of ``Hkv``).
        mask: ``[T, S]`` bool (True = attend) or ``None``; every real query must see at least one key.
        scaling: softmax scale (usually ``1/sqrt(D)``).
        q_start: key index of the first query (``S - T`` with a KV cache, 0 without).
        cfg: selection settings.
        plan: a :func:`make_plan` result to reuse across layers (built when ``None``).
        rows_per_call: (KV head, query block) pairs per batched SDPA call; pairs are sorted by their number
            of kept blocks so each call pads little (bounds the gathered K/V memory).
        keep: optional precomputed ``[B * Hkv, nQ, nK]`` selection (tests; skips the scoring).

    Returns:
        ``(output [B, H, T, D], info)`` with ``info = {"density", "select_s", "attn_s", "keep"}``; density is
        the fraction of visible (query block, key block) tiles computed, averaged over KV heads.
    """
    t0 = time.perf_counter()
    b, h, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    g, n, bs = h // hkv, b * hkv, cfg.block_size
    nq, nk = -(-t // bs), -(-s // bs)
    if plan is None:
        plan = make_plan(mask, t, s, q_start, cfg)
    q = query.reshape(n, g, t, d)
    k = key.reshape(n, s, d)
    v = value.reshape(n, s, d)
    if keep is None:
        scores = coarse_scores(q, k, scaling, bs)
        keep = select_blocks(scores, plan.visible, plan.forced, plan.n_keys, plan.key_counts, cfg)
    t1 = time.perf_counter()

    if plan.causal:
        out = _causal_fast_path(q, k, v, keep, scaling, q_start, cfg, rows_per_call)
        result = out[:, :, :t].reshape(b, h, t, d)
        t2 = time.perf_counter()
        density = keep.sum().item() / max(1, n * plan.visible.sum().item())
        return result, {"density": density, "select_s": t1 - t0, "attn_s": t2 - t1, "keep": keep}
    qp = F.pad(q, (0, 0, 0, nq * bs - t)).view(n, g, nq, bs, d).permute(0, 2, 1, 3, 4).reshape(n * nq, g, bs, d)
    kb = F.pad(k, (0, 0, 0, nk * bs - s)).view(n, nk, bs, d)
    vb = F.pad(v, (0, 0, 0, nk * bs - s)).view(n, nk, bs, d)
    out = torch.empty(n * nq, g, bs, d, dtype=query.dtype)
    # (KV head, query block) pairs sorted by kept-block count, so each batched call pads little
    flat = keep.reshape(n * nq, nk)
    counts = flat.sum(-1)
    order = torch.argsort(counts, stable=True)
    idx_all = torch.argsort((~flat).to(torch.uint8), dim=-1, stable=True)  # kept blocks first, ascending
    pair_n = torch.div(torch.arange(n * nq), nq, rounding_mode="floor")
    pair_i = torch.arange(n * nq) % nq
    for c0 in range(0, n * nq, rows_per_call):
        pairs = order[c0:c0 + rows_per_call]
        cnt = counts[pairs]
        kmax = int(cnt.max())
        idx = idx_all[pairs, :kmax]  # [R, kmax]
        valid = torch.arange(kmax) < cnt[:, None]
        pn = pair_n[pairs][:, None]
        rr = pairs.shape[0]
        kg = kb[pn, idx].reshape(rr, 1, kmax * bs, d)
        vg = vb[pn, idx].reshape(rr, 1, kmax * bs, d)
        mg = plan.mask_blocks[pair_i[pairs][:, None], idx] & valid[..., None, None]  # [R, kmax, bs_q, bs_k]
        mg = mg.permute(0, 2, 1, 3).reshape(rr, 1, bs, kmax * bs)
        o = F.scaled_dot_product_attention(qp[pairs], kg.expand(-1, g, -1, -1), vg.expand(-1, g, -1, -1),
                                           attn_mask=mg, scale=scaling)
        out[pairs] = o
    out = out.view(n, nq, g, bs, d)
    result = out.permute(0, 2, 1, 3, 4).reshape(n, g, nq * bs, d)[:, :, :t].reshape(b, h, t, d)
    t2 = time.perf_counter()
    vis = plan.visible.sum().item()
    density = keep.sum().item() / max(1, n * vis)
    return result, {"density": density, "select_s": t1 - t0, "attn_s": t2 - t1, "keep": keep}


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _causal_fast_path(q, k, v, keep, scaling, q_start, cfg, rows_per_call):
    """Causal, block-aligned case: the diagonal tiles by one causal SDPA call over all query blocks,
    the other kept (fully visible) tiles by batched unmasked SDPA calls over gathered blocks (only a
    broadcast padding mask), the two parts merged with their log-sum-exp (flash-attention style).

    ``q [N, G, T, D]``, ``k/v [N, S, D]``, ``keep [N, nQ, nK]``. Returns ``[N, G, nQ * bs, D]``.
    """
    n, g, t, d = q.shape
    s, bs = k.shape[1], cfg.block_size
    nq, nk = keep.shape[1], keep.shape[2]
    j0 = q_start // bs
    qp = F.pad(q, (0, 0, 0, nq * bs - t)).view(n, g, nq, bs, d).permute(0, 2, 1, 3, 4).reshape(n * nq, g, bs, d)
    kb = F.pad(k, (0, 0, 0, nk * bs - s)).view(n, nk, bs, d)
    vb = F.pad(v, (0, 0, 0, nk * bs - s)).view(n, nk, bs, d)
    # diagonal tiles: key block j0 + i for query block i (causal inside)
    kd = kb[:, j0:j0 + nq].reshape(n * nq, 1, bs, d).expand(-1, g, -1, -1)
    vd = vb[:, j0:j0 + nq].reshape(n * nq, 1, bs, d).expand(-1, g, -1, -1)
    out, lse = _flash(qp, kd, vd, 0.0, True, scale=scaling)  # [P, G, bs, D], [P, G, bs]
    off = keep.clone()
    diag = torch.arange(nq) + j0
    off[:, torch.arange(nq), diag.clamp(max=nk - 1)] = False
    flat = off.reshape(n * nq, nk)
    counts = flat.sum(-1)
    order = torch.argsort(counts, stable=True)
    order = order[counts[order] > 0]
    if order.numel():
        idx_all = torch.argsort((~flat).to(torch.uint8), dim=-1, stable=True)
        kflat, vflat = kb.reshape(n * nk, bs, d), vb.reshape(n * nk, bs, d)
        pair_n = torch.div(torch.arange(n * nq), nq, rounding_mode="floor")
        for c0 in range(0, order.numel(), rows_per_call):
            pairs = order[c0:c0 + rows_per_call]
            cnt = counts[pairs]
            kmax = int(cnt.max())
            rr = pairs.shape[0]
            ids = (pair_n[pairs][:, None] * nk + idx_all[pairs, :kmax]).reshape(-1)
            kg = kflat.index_select(0, ids).view(rr, 1, kmax * bs, d)
            vg = vflat.index_select(0, ids).view(rr, 1, kmax * bs, d)
            qg = qp[pairs].reshape(rr, 1, g * bs, d)  # the G heads share the keys: fold them into rows
            attn_mask = None
            if int(cnt.min()) < kmax:
                pad = (torch.arange(kmax) >= cnt[:, None]).repeat_interleave(bs, -1)
                attn_mask = torch.zeros(rr, 1, 1, kmax * bs, dtype=q.dtype).masked_fill(
                    pad[:, None, None, :], float("-inf")).expand(rr, 1, g * bs, kmax * bs)
            o2, l2 = _flash(qg, kg, vg, 0.0, False, attn_mask=attn_mask, scale=scaling)
            o2, l2 = o2.view(rr, g, bs, d), l2.view(rr, g, bs)
            w = torch.sigmoid(lse[pairs] - l2).unsqueeze(-1)  # share of the diagonal part
            out[pairs] = torch.lerp(o2, out[pairs], w)
    return out.view(n, nq, g, bs, d).permute(0, 2, 1, 3, 4).reshape(n, g, nq * bs, d)
