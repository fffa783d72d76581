"""laserlm's attention function, called by the unmodified transformers attention modules.

The engine registers :func:`laser_attention_forward` with transformers' ``AttentionInterface`` under
the name ``"laserlm"`` and sets it as the model's attention implementation. Inside an engine step an
:class:`AttentionContext` is active: it knows the absolute positions of the queries, so the function
builds causal / sliding-window masks itself (no per-step mask objects from transformers), and it is the
single place where attention is computed, which is where later techniques hook in:

- ``want_probs``: layers whose attention distribution is kept (``probs[layer]``, ``[B, H, T, S]``),
  computed in the same pass (used by the attention transition score);
- ``key_valid``: per-layer boolean ``[S]`` of positions holding real K/V (the ``none`` bridge);
- ``kernel``: a replacement attention kernel (block-sparse attention);
- ``key_positions``: per-layer absolute positions of the keys a paged cache gathered (``[B, S]``, ``-1`` =
  padding), and ``q_positions`` of shape ``[B, T]``: rows at different positions (continuous batching,
  :mod:`laserlm.runtime.kv_pool`); masks are then ``[B, 1, T, S]``.

Outside an engine step (the model called the ordinary transformers way) it delegates to transformers'
SDPA implementation, so the loaded model still behaves as a normal transformers model.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "laserlm"

_local = threading.local()


@dataclass
class AttentionContext:
    """Per-forward attention state.

    Attributes:
        q_positions: absolute positions of the queries, ``[T]`` int64 (``[B, T]``: one row per request).
        kv_offset: absolute position of key index 0 (0 with a cache; the first query position without).
        want_probs: layer indices whose attention probabilities to keep.
        probs: ``layer -> [B, H, T, S]`` float32 attention probabilities (filled for ``want_probs``).
        key_valid: ``layer -> [S_max]`` bool, False where a position has no K/V at that layer.
        kernel: optional ``fn(query, key, value, mask, scaling, layer_idx, ctx) -> [B, H, T, D]``.
        layer_stats: free-form per-layer statistics written by kernels (e.g. density).
        key_positions: ``layer -> [B, S]`` int64 absolute position of each key (``-1``: padding), set by a paged
            cache's window when keys are not simply positions ``0 .. S-1`` of one row.
    """

    q_positions: torch.Tensor
    kv_offset: int = 0
    want_probs: frozenset = frozenset()
    probs: dict = field(default_factory=dict)
    key_valid: dict = field(default_factory=dict)
    kernel: Callable | None = None
    layer_stats: dict = field(default_factory=dict)
    key_positions: dict = field(default_factory=dict)
    _masks: dict = field(default_factory=dict)

    def _positional_mask(self, kv_len: int, sliding_window: int | None, kpos: torch.Tensor | None,
                         valid: torch.Tensor | None) -> torch.Tensor:
        """``[B, 1, T, S]`` mask from query and key positions (rows of a batch, gathered pages)."""
        q = self.q_positions if self.q_positions.dim() == 2 else self.q_positions.unsqueeze(0)  # [B, T]
        k = kpos if kpos is not None else (torch.arange(kv_len) + self.kv_offset).unsqueeze(0)  # [B, S]
        q, k = q[:, :, None], k[:, None, :]
        m = (k <= q) & (k >= 0)
        if sliding_window is not None:
            m = m & ((q - k) < sliding_window)
        if valid is not None:
            m = m & valid[k.clamp(min=0)]
        return m.unsqueeze(1)

    def mask(self, kv_len: int, sliding_window: int | None, layer_idx: int | None = None) -> torch.Tensor | None:
        """Boolean mask ``[T, S]`` (True = attend) or ``None`` when every key is visible; ``[B, 1, T, S]``
        when the queries are rows at their own positions or the keys carry positions (``key_positions``).

        Key ``s`` is visible to query ``t`` iff ``s + kv_offset <= pos[t]``, ``pos[t] - (s + kv_offset) <
        sliding_window`` (when set) and ``key_valid[layer][s]`` (when set).
        """
        valid = self.key_valid.get(layer_idx) if layer_idx is not None else None
        kpos = self.key_positions.get(layer_idx) if self.key_positions else None
        key = (kv_len, sliding_window, id(valid) if valid is not None else None, id(kpos) if kpos is not None else None)
        if key in self._masks:
            return self._masks[key][0]
        if kpos is not None or self.q_positions.dim() == 2:
            m = self._positional_mask(kv_len, sliding_window, kpos, valid)
            self._masks[key] = (m, kpos)  # kpos kept alive so its id stays unique
            return m
        pos = self.q_positions
        t = pos.shape[0]
        last = int(pos[-1]) if t else 0
        needs_causal = not (t == 1 and last == self.kv_offset + kv_len - 1)
        needs_window = sliding_window is not None and (last - self.kv_offset) >= sliding_window
        if not needs_causal and not needs_window and valid is None:
            m = None
        else:
            kpos = torch.arange(kv_len) + self.kv_offset
            m = kpos[None, :] <= pos[:, None]
            if sliding_window is not None:
                m = m & ((pos[:, None] - kpos[None, :]) < sliding_window)
            if valid is not None:
                m = m & valid[:kv_len][None, :]
        self._masks[key] = (m, None)
        return m

    def plain_causal(self, kv_len: int, sliding_window: int | None, layer_idx: int | None = None) -> bool:
        """True when :meth:`mask` would be exactly the square causal mask: ``T = kv_len > 1`` queries at
        positions ``kv_offset .. kv_offset + T - 1`` (a prefill from the first key), no sliding-window cut
        and no holes. SDPA's ``is_causal=True`` then gives the same attention without building the mask."""
        if self.q_positions.dim() == 2 or (self.key_positions and layer_idx in self.key_positions):
            return False
        t = self.q_positions.shape[0]
        if t != kv_len or t == 1 or (sliding_window is not None and t > sliding_window):
            return False
        if layer_idx is not None and self.key_valid.get(layer_idx) is not None:
            return False
        return int(self.q_positions[0]) == self.kv_offset

    def is_plain_causal_mask(self, mask: torch.Tensor | None, kv_len: int, layer_idx: int | None = None) -> bool:
        """True when ``mask`` (as returned by :meth:`mask`) is exactly the square causal mask, so a kernel
        handed it may use SDPA's ``is_causal=True`` instead (see :meth:`plain_causal`)."""
        entry = self._masks.get((kv_len, None, None, None))
        return (mask is not None and entry is not None and entry[0] is mask
                and self.plain_causal(kv_len, None, layer_idx))


def current_context() -> AttentionContext | None:
    return getattr(_local, "ctx", None)


class attention_context:  # noqa: N801  (used as a context manager)
    """``with attention_context(ctx):`` makes ``ctx`` active for the current thread."""

    def __init__(self, ctx: AttentionContext):
        self.ctx = ctx

    def __enter__(self):
        self.prev = current_context()
        _local.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc):
        _local.ctx = self.prev
        return False


def dense_attention(query, key, value, mask, scaling, enable_gqa=True, is_causal=False):
    """Exact attention. ``query [B, H, T, D]``, ``key/value [B, Hkv, S, D]``, ``mask [T, S]`` bool or None.

    ``is_causal=True`` (with ``mask=None``) applies SDPA's own square causal mask instead of a boolean one.
    Returns ``[B, H, T, D]``. Uses PyTorch SDPA (grouped-query attention without repeating K/V).
    """
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=enable_gqa,
                                          is_causal=is_causal)


def attention_with_probs(query, key, value, mask, scaling):
    """Exact attention that also returns the probabilities ``[B, H, T, S]`` (float32). Math path."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scores = torch.matmul(query, k.transpose(-1, -2)).float() * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v), probs


def laser_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, **kwargs):
    """transformers ``AttentionInterface`` entry point.

    ``query [B, H, T, D]``, ``key/value [B, Hkv, S, D]`` (after the cache update). Returns
    ``(output [B, T, H, D], None)`` as transformers expects.
    """
    ctx = current_context()
    if ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, sliding_window=sliding_window, **kwargs)
    layer_idx = module.layer_idx
    if ctx.kernel is None and layer_idx not in ctx.want_probs and ctx.plain_causal(key.shape[2], sliding_window,
                                                                                   layer_idx):
        # prefill from the first cached position: SDPA's is_causal, no [T, S] boolean mask
        return dense_attention(query, key, value, None, scaling, is_causal=True).transpose(1, 2), None
    mask = ctx.mask(key.shape[2], sliding_window, layer_idx)
    if layer_idx in ctx.want_probs:
        out, probs = attention_with_probs(query, key, value, mask, scaling)
        ctx.probs[layer_idx] = probs
    elif ctx.kernel is not None:
        out = ctx.kernel(query, key, value, mask, scaling, layer_idx, ctx)
    else:
        out = dense_attention(query, key, value, mask, scaling)
    return out.transpose(1, 2), None


def register() -> str:
    """Register :func:`laser_attention_forward` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface  # noqa: PLC0415

    AttentionInterface.register(ATTN_IMPLEMENTATION, laser_attention_forward)
    return ATTN_IMPLEMENTATION
