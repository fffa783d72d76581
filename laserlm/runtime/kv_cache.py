"""laserlm's preallocated KV cache and the write windows that forwards open on it.

One key and one value tensor per decoder layer, each ``[B, n_kv_heads, max_len, head_dim]``,
allocated once (gpt-fast's static cache). Every request owns one :class:`KVCache`
(:meth:`laserlm.runtime.engine.Engine.new_cache`); the engine's own cache serves its simple
``prefill`` / ``decode_step`` API.

A forward writes the positions ``[start, end)`` through a :class:`CacheWindow` (the object the
transformers attention modules receive as ``cache=``; it implements ``Cache.update``). The window belongs
to the forward, not to the cache, so several forwards on one cache (the deferred bridge's 2-token
forward, a speculative verify) never share hidden cursor state. ``length`` counts the committed
positions; rolling back (speculative decoding) only moves it.
"""

from __future__ import annotations

import torch

from ..errors import ContextLengthError, InvalidArgumentError


class CachePositions:
    """What every KV cache shares: ``length`` committed positions out of ``max_len``, the write check, and rolling
    back (:class:`KVCache`; :class:`~laserlm.runtime.kv_pool.PagedCache`)."""

    length: int
    max_len: int

    def check_write(self, start: int | None, num_tokens: int) -> int:
        """``start`` (None: ``length``) after checking that ``[start, start + num_tokens)`` may be written.

        Raises:
            ContextLengthError: the tokens do not fit in ``max_len``.
            InvalidArgumentError: ``start`` is negative or after the committed length.
        """
        start = self.length if start is None else start
        if not 0 <= start <= self.length:
            raise InvalidArgumentError(f"cannot write at position {start}: the cache holds {self.length} positions "
                                       "(a forward starts at or before the end of the cache)")
        if start + num_tokens > self.max_len:
            raise ContextLengthError(
                f"context full: {start} cached + {num_tokens} new tokens > context size {self.max_len}")
        return start

    def crop(self, length: int) -> None:
        """Forget every position at or after ``length`` (roll back rejected tokens)."""
        if not 0 <= length <= self.length:
            raise InvalidArgumentError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length

    def reset(self) -> None:
        self.crop(0)


class KVCache(CachePositions):
    """Static KV cache for ``num_layers`` layers.

    Args:
        num_layers: decoder layers.
        batch_size: sequences decoded together (positions are shared; no padding).
        num_kv_heads, head_dim: attention layout of the model.
        max_len: context limit in tokens.
        dtype: storage dtype (the model's).

    Attributes:
        k, v: lists of ``[B, n_kv_heads, max_len, head_dim]`` tensors.
        length: number of committed positions (the next appended token is written at ``length``).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32):
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.max_len = max_len
        self.batch_size = batch_size
        self.length = 0

    def window(self, start: int | None, num_tokens: int) -> CacheWindow:
        """A write window for positions ``[start, start + num_tokens)`` (``start`` None: at ``length``).

        ``start`` may lie before ``length`` (rewriting positions: a deferred token's remaining layers, a
        speculative verify) but not after it (no holes).

        Raises:
            ContextLengthError: the tokens do not fit in ``max_len``.
            InvalidArgumentError: ``start`` is negative or after the committed length.
        """
        start = self.check_write(start, num_tokens)
        return CacheWindow(self, start, start + num_tokens)

    def commit(self, window: CacheWindow) -> None:
        """Make the window's positions part of the cache (``length`` never moves back here)."""
        self.length = max(self.length, window.end)

    def write(self, layer_idx: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write K/V ``[B, n_kv, T, hd]`` of layer ``layer_idx`` at ``[start, start+T)`` (bridges use this)."""
        t = key_states.shape[2]
        self.k[layer_idx][:, :, start:start + t].copy_(key_states)
        self.v[layer_idx][:, :, start:start + t].copy_(value_states)

    @property
    def nbytes(self) -> int:
        """Bytes held by the preallocated K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class CacheWindow:
    """The positions ``[start, end)`` of one forward on a :class:`KVCache` (transformers' ``Cache`` protocol).

    Attributes:
        cache: the cache written to; ``k``, ``v``: its per-layer tensors; ``start``, ``end``: the window.
    """

    def __init__(self, cache: KVCache, start: int, end: int):
        self.cache, self.start, self.end = cache, start, end
        self.k, self.v = cache.k, cache.v
        self.positions = torch.arange(start, end)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``key_states``/``value_states`` ``[B, n_kv, T, hd]`` at ``[start, end)`` of layer
        ``layer_idx``; return the layer's K and V for positions ``[0, end)``."""
        s, e = self.start, self.end
        k, v = self.k[layer_idx], self.v[layer_idx]
        k[:, :, s:e].copy_(key_states)
        v[:, :, s:e].copy_(value_states)
        return k[:, :, :e], v[:, :, :e]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start
