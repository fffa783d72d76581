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
        self.freed = False

    def window(self, start: int | None, num_tokens: int) -> CacheWindow:
        """A write window for positions ``[start, start + num_tokens)`` (``start`` None: at ``length``).

        ``start`` may lie before ``length`` (rewriting positions: a deferred token's remaining layers, a
        speculative verify) but not after it (no holes).

        Raises:
            ContextLengthError: the tokens do not fit in ``max_len``.
            InvalidArgumentError: ``start`` is negative or after the committed length.
        """
        if self.freed:
            raise InvalidArgumentError("this request's KV cache was freed (finished or cancelled)")
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
        """Bytes held by the preallocated K and V tensors (0 once freed)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def free(self) -> None:
        """Drop the K and V tensors, so their memory goes back to the allocator (a request's own cache when it
        finishes under the scheduler's per-request allocation); idempotent. Writing afterwards is an error."""
        self.k, self.v = [], []
        self.length = 0
        self.freed = True


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


class RequestBatch:
    """Several requests' own contiguous caches (one :class:`KVCache` of batch size 1 each) stepped together in one
    batched forward: ``window(None, T)`` appends ``T`` positions to every row at its own length.

    This is plain per-request allocation, the baseline that seed 004 §3.2 measures its memory pool against (and
    what transformers' generate does): each request's cache is allocated when it is admitted and freed when it
    finishes, so nothing is shared and nothing is paged. The scheduler uses it with ``kv_prealloc="request"``
    (:class:`~laserlm.runtime.scheduler.BatchConfig`); :class:`~laserlm.runtime.kv_pool.PagedBatch` is the pool's
    counterpart.

    Raises:
        InvalidArgumentError: no cache, or a cache of more than one row.
    """

    def __init__(self, caches: list[KVCache]):
        if not caches or any(not isinstance(c, KVCache) or c.batch_size != 1 for c in caches):
            raise InvalidArgumentError("a request batch needs at least one cache, each of one request (batch size 1)")
        self.caches = caches
        self.batch_size = len(caches)

    def window(self, start, num_tokens: int) -> RequestBatchWindow:
        if start is not None:
            raise InvalidArgumentError("a batched forward appends to every row (start must be None)")
        for c in self.caches:
            if c.freed:
                raise InvalidArgumentError("a request's KV cache was freed (finished or cancelled)")
            c.check_write(None, num_tokens)
        pos = torch.stack([torch.arange(c.length, c.length + num_tokens) for c in self.caches])
        return RequestBatchWindow(self, pos)

    def commit(self, window: RequestBatchWindow) -> None:
        for c, end in zip(self.caches, window.ends.tolist()):
            c.length = max(c.length, end)


class RequestBatchWindow:
    """The positions one batched forward writes in the rows of a :class:`RequestBatch` (transformers' ``Cache``
    protocol).

    ``update`` writes each row's new K/V into the row's own cache and returns every row's keys and values copied
    into one zero-padded ``[B, n_kv, S, hd]`` tensor (``S``: the longest row's end). Key ``s`` of every row is at
    absolute position ``s``, so the rows' query positions (``[B, T]``) mask what lies past a row's end.
    The copy is the price of batching caches that are not paged (the pool's PyTorch path pays the same gather).

    Attributes:
        cache: the :class:`RequestBatch`.
        positions: ``[B, T]`` absolute positions of the new tokens.
        ends: ``[B]`` end of each row's window; ``end``: the largest.
    """

    def __init__(self, cache: RequestBatch, positions: torch.Tensor):
        self.cache, self.positions = cache, positions
        self.ends = positions[:, -1] + 1
        self.start = None
        self.end = int(self.ends.max())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``key_states``/``value_states`` ``[B, n_kv, T, hd]`` of layer ``layer_idx`` into each row's cache;
        return the rows' K and V ``[B, n_kv, S, hd]`` (zero past a row's end, which the positions mask)."""
        b, n_kv, _, hd = key_states.shape
        k = key_states.new_zeros(b, n_kv, self.end, hd)
        v = value_states.new_zeros(b, n_kv, self.end, hd)
        for r, c in enumerate(self.cache.caches):
            s, e = int(self.positions[r, 0]), int(self.ends[r])
            ck, cv = c.k[layer_idx], c.v[layer_idx]
            ck[0, :, s:e] = key_states[r]
            cv[0, :, s:e] = value_states[r]
            k[r, :, :e] = ck[0, :, :e]
            v[r, :, :e] = cv[0, :, :e]
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.positions[0, 0])
