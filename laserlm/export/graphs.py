"""The torch modules that are exported to ONNX, one job each (seed 004 §3.1: adaptive depth cannot be one static
graph, so there is one graph per layer group and the runtime chooses the exits).

- :class:`EmbedGraph`: ``input_ids [B, T] int64 -> hidden [B, T, d]``.
- :class:`GroupGraph`: decoder layers ``a .. b-1``: ``hidden [B, T, d]``, ``positions [B, T] int64`` and the past
  K/V of its layers (``past_k_<j>`` / ``past_v_<j>`` ``[B, n_kv, P, head_dim]``, P >= 0) -> ``hidden [B, T, d]``
  and the new tokens' K/V (``new_k_<j>`` / ``new_v_<j>`` ``[B, n_kv, T, head_dim]``). The past holds positions
  ``0 .. P-1`` and the new tokens sit at ``positions`` (``P .. P+T-1`` in decoding); the causal and the
  sliding-window masks are built in the graph from the positions, exactly as
  :meth:`laserlm.runtime.attention.AttentionContext.mask` does.
- :class:`BridgeGraph`: the ``propagate`` bridge for the layers of one group
  (:func:`laserlm.runtime.projections.project_kv`): ``hidden [B, T, d]``, ``positions`` -> ``new_k_<j>`` / ``new_v_<j>``.
- :class:`AdapterGraph`: a trained exit head's adapter (:meth:`laserlm.depth.heads.ExitHead.adapt`),
  ``hidden [B, T, d] -> hidden [B, T, d]``; the exit head is this graph followed by the final head graph.
- :class:`HeadGraph`: final norm + LM head (+ Gemma soft cap): ``hidden [B, T, d] -> logits [B, T, V]`` float32.
- :class:`WholeModelGraph`: the whole model with seed 004 §3.1's signature, ``input_ids [B, T]`` and
  ``attention_mask [B, T]`` (1 = token, 0 = padding, left or right) -> ``logits [B, T, V]``; no KV cache. A row's
  positions count its tokens only (``cumsum(mask) - 1``) and no query sees a padding key, so a padded row gives
  its unpadded logits at its token positions.

The decoder layers are the transformers modules themselves, called with a small cache object and an attention
function registered for the export (:data:`EXPORT_ATTENTION`), so the graph computes what the engine computes.
Rotary tables (``cos``/``sin`` ``[max_len, head_dim]`` per layer type) are constants of the graphs, taken from the
engine's own tables, so ``positions`` must be below ``max_len`` (the manifest's declared maximum).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

EXPORT_ATTENTION = "laserlm_export"
_local = threading.local()


def export_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     **kwargs):
    """Attention for the exported graphs: ``query [B, H, T, D]``, ``key/value [B, Hkv, S, D]`` (past + new).

    Key ``s`` (absolute position ``s``) is visible to the query at position ``q`` iff ``s <= q`` and, for a
    sliding-window layer, ``q - s < sliding_window``. Softmax in float32. Returns ``([B, T, H, D], None)``.
    """
    q_pos = _local.positions  # [B, T]
    s = key.shape[2]
    key_mask = getattr(_local, "key_mask", None)  # [B, S] bool (whole-model graph: keys are this call's tokens)
    if key_mask is None:
        k_pos = torch.arange(s, dtype=q_pos.dtype).view(1, 1, s)
    else:
        k_pos = q_pos.unsqueeze(1)  # [B, 1, S]
    qp = q_pos.unsqueeze(-1)  # [B, T, 1]
    visible = k_pos <= qp
    if key_mask is not None:
        visible = visible & key_mask.unsqueeze(1)
    if sliding_window is not None:
        visible = visible & ((qp - k_pos) < sliding_window)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), None


def register_export_attention() -> str:
    from transformers import AttentionInterface  # noqa: PLC0415

    AttentionInterface.register(EXPORT_ATTENTION, export_attention)
    return EXPORT_ATTENTION


class _PastCache:
    """Stands in for a transformers ``Cache`` inside a group graph: ``update`` records the new K/V of a layer and
    returns past + new."""

    def __init__(self, past: dict):
        self.past = past  # layer -> (k, v)
        self.new = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new[layer_idx] = (key_states, value_states)
        pk, pv = self.past[layer_idx]
        return torch.cat([pk, key_states], dim=2), torch.cat([pv, value_states], dim=2)

    def get_seq_length(self, layer_idx: int = 0) -> int:  # pragma: no cover - not called by the layers
        return 0


def rope_tables(engine) -> dict:
    """``layer type -> (cos [max_len, hd], sin [max_len, hd])``: the engine's own rotary tables."""
    engine._rope(torch.zeros(1, 1, 1), torch.arange(1))  # builds them once
    return {t: (c.clone(), s.clone()) for t, (c, s) in engine._rope_tables.items()}


class _LayerRange(nn.Module):
    """Decoder layers ``start .. stop-1`` of ``engine`` with their rotary tables as buffers (the base of the graphs)."""

    def __init__(self, engine, start: int, stop: int, tables: dict):
        super().__init__()
        a = engine.adapter
        self.start, self.stop = start, stop
        self.layers = nn.ModuleList(a.layers[start:stop])
        self.layer_types = a.layer_types[start:stop]
        self._init_rope(tables, self.layer_types)

    def _init_rope(self, tables: dict, types: list):
        self.types = list(dict.fromkeys(types))
        for i, t in enumerate(self.types):
            self.register_buffer(f"cos_{i}", tables[t][0], persistent=False)
            self.register_buffer(f"sin_{i}", tables[t][1], persistent=False)

    def _rope(self, positions) -> dict:
        return {t: (getattr(self, f"cos_{i}")[positions], getattr(self, f"sin_{i}")[positions])
                for i, t in enumerate(self.types)}


class GroupGraph(_LayerRange):
    """Decoder layers ``start .. stop-1`` of ``engine`` as one graph (see the module docstring)."""

    def forward(self, hidden, positions, *past):
        rope = self._rope(positions)
        cache = _PastCache({self.start + i: (past[2 * i], past[2 * i + 1]) for i in range(self.stop - self.start)})
        _local.positions = positions
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, attention_mask=None, position_ids=positions, cache=cache,
                           position_embeddings=rope[self.layer_types[i]])
        out = [hidden]
        for j in range(self.start, self.stop):
            out += list(cache.new[j])
        return tuple(out)


class _NoPast:
    """A cache with nothing in it: every layer attends to this call's tokens only."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states


class WholeModelGraph(_LayerRange):
    """Embedding, every decoder layer and the final head in one graph with the seed's signature (module
    docstring). Padding keys are masked out and positions skip the padding, so rows of different lengths batch."""

    def __init__(self, engine, tables: dict):
        super().__init__(engine, 0, engine.num_layers, tables)
        self.embed = EmbedGraph(engine)
        self.head = HeadGraph(engine)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.to(torch.int64)
        positions = (torch.cumsum(mask, dim=-1) - 1).clamp(min=0)  # [B, T]
        rope = self._rope(positions)
        hidden = self.embed(input_ids)
        _local.positions, _local.key_mask = positions, mask.bool()
        try:
            for i, layer in enumerate(self.layers):
                hidden = layer(hidden, attention_mask=None, position_ids=positions, cache=_NoPast(),
                               position_embeddings=rope[self.layer_types[i]])
        finally:
            _local.key_mask = None
        return self.head(hidden)


class BridgeGraph(_LayerRange):
    """The propagate bridge's K/V for layers ``start .. stop-1`` from one hidden state (see the module docstring)."""

    def forward(self, hidden, positions):
        from ..runtime.projections import project_kv  # noqa: PLC0415

        rope = self._rope(positions)
        out = []
        for i, layer in enumerate(self.layers):
            cos, sin = rope[self.layer_types[i]]
            out += list(project_kv(layer, hidden, cos, sin))
        return tuple(out)


class EmbedGraph(nn.Module):
    def __init__(self, engine):
        super().__init__()
        self.embed = engine.adapter.embed_tokens

    def forward(self, input_ids):
        return self.embed(input_ids)


class HeadGraph(nn.Module):
    def __init__(self, engine):
        super().__init__()
        a = engine.adapter
        self.norm, self.lm_head, self.cap = a.norm, a.lm_head, a.final_logit_softcapping

    def forward(self, hidden):
        out = self.lm_head(self.norm(hidden))
        if self.cap is not None:
            out = torch.tanh(out / self.cap) * self.cap
        return out.float()


class AdapterGraph(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, hidden):
        return self.head.adapt(hidden)
