"""laserlm's preallocated KV cache.

One key and one value tensor per decoder layer, each ``[B, n_kv_heads, max_len, head_dim]``,
allocated once (gpt-fast's static cache). The engine sets the write window ``[start, end)`` before
running layers; transformers attention modules call :meth:`KVCache.update` (the ``Cache.update``
signature), which writes the new K/V in place and returns views of the first ``end`` positions.
Nothing is reallocated per token; rolling back (speculative decoding) only moves ``length``.
"""

from __future__ import annotations

import torch

from ..errors import ContextLengthError


class KVCache:
    """Static KV cache for ``num_layers`` layers.

    Args:
        num_layers: decoder layers.
        batch_size: sequences decoded together (positions are shared; no padding).
        num_kv_heads, head_dim: attention layout of the model.
        max_len: context limit in tokens.
        dtype: storage dtype (the model's).

    Attributes:
        k, v: lists of ``[B, n_kv_heads, max_len, head_dim]`` tensors.
        length: number of committed positions (the next token is written at ``length``).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32):
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.max_len = max_len
        self.batch_size = batch_size
        self.length = 0
        self._start = 0
        self._end = 0

    # -- write window ------------------------------------------------------------------------
    def begin(self, num_tokens: int) -> tuple[int, int]:
        """Open the write window for ``num_tokens`` new positions; returns ``(start, end)``.

        Raises:
            ContextLengthError: when the tokens do not fit in ``max_len``.
        """
        start, end = self.length, self.length + num_tokens
        if end > self.max_len:
            raise ContextLengthError(
                f"context full: {self.length} cached + {num_tokens} new tokens > context size {self.max_len}"
            )
        self._start, self._end = start, end
        return start, end

    def commit(self) -> None:
        self.length = self._end

    def crop(self, length: int) -> None:
        """Forget every position at or after ``length`` (roll back rejected tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length
        self._start = self._end = length

    def reset(self) -> None:
        self.crop(0)

    # -- transformers Cache protocol (what attention modules call) --------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``key_states``/``value_states`` ``[B, n_kv, T, hd]`` at ``[start, end)`` of layer
        ``layer_idx``; return the layer's K and V for positions ``[0, end)``."""
        s, e = self._start, self._end
        k, v = self.k[layer_idx], self.v[layer_idx]
        k[:, :, s:e].copy_(key_states)
        v[:, :, s:e].copy_(value_states)
        return k[:, :, :e], v[:, :, :e]

    def write(self, layer_idx: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write K/V ``[B, n_kv, T, hd]`` of layer ``layer_idx`` at ``[start, start+T)`` (bridges use this)."""
        t = key_states.shape[2]
        self.k[layer_idx][:, :, start:start + t].copy_(key_states)
        self.v[layer_idx][:, :, start:start + t].copy_(value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        """Bytes held by the preallocated K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
