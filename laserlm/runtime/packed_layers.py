"""Decoder layers over packed (fused, quantized) weights: the fast path of ``--weights int4|int8|native``.

One function per family computes the same function as the transformers layer (transformers 5.24's
``LlamaDecoderLayer`` / ``MistralDecoderLayer`` / ``Qwen2DecoderLayer`` / ``Qwen3DecoderLayer`` /
``Gemma3DecoderLayer``) with fewer, larger operations:

- q, k and v come from one matrix (``qkv``), gate and up from one (``gate_up``) — see
  :mod:`laserlm.models.packing`;
- RMSNorm is one ``F.rms_norm`` call (statistics in float32, like transformers);
- the rotary embedding is applied to q and k together (one ``rotate_half``, two multiplies, one add);
- attention is laserlm's attention function (so attention probabilities for the ATS, block-sparse
  kernels and masked bridge holes work unchanged).

Numerics differ from the float model only by the weight format and the kernels' int16 activation
rounding (``tests/test_quantized.py`` bounds both against float64 references).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models import kernels
from ..models.quant import KERNEL_MAX_ROWS, QuantLinear
from . import attention as attn
from . import fast_layers
from .kv_cache import CacheWindow

_EMPTY = torch.empty(0)
_ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}


def _norm_params(norm) -> tuple[torch.Tensor, float]:
    """``(weight, eps)`` for ``F.rms_norm`` equal to the module (Gemma's norm scales by ``1 + weight``)."""
    cached = getattr(norm, "_laserlm_rms", None)
    if cached is not None and cached[2] is norm.weight._version:
        return cached[0], cached[1]
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
    w = norm.weight.detach().float()
    if type(norm).__name__ == "Gemma3RMSNorm":
        w = 1.0 + w
    object.__setattr__(norm, "_laserlm_rms", (w, float(eps), norm.weight._version))
    return w, float(eps)


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    w, eps = _norm_params(norm)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + fast_layers._rotate_half(x) * sin


def _sliding_window(layer) -> int | None:
    """The window the transformers attention module passes to the attention function (None: global)."""
    rule = fast_layers._SLIDING.get(type(layer).__name__, lambda a: getattr(a, "sliding_window", None))
    return rule(layer.self_attn)


def _attention(layer, pk, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
    """Self-attention block output (before the residual), ``[B, T, d] -> [B, T, d]``."""
    a = layer.self_attn
    b, t, _ = hidden.shape
    hd = a.head_dim
    qkv = pk.qkv(hidden)  # [B, T, (H + 2 Hkv) * hd]
    h, hkv = pk.q_size // hd, pk.kv_size // hd
    qk = qkv[..., : pk.q_size + pk.kv_size].view(b, t, h + hkv, hd)
    v = qkv[..., pk.q_size + pk.kv_size:].view(b, t, hkv, hd).transpose(1, 2)
    q_norm = getattr(a, "q_norm", None)
    if q_norm is not None:  # Qwen3 / Gemma3: RMSNorm over head_dim before the rotary embedding
        q = _rms(q_norm, qk[:, :, :h])
        k = _rms(a.k_norm, qk[:, :, h:])
        qk = torch.cat((q, k), dim=2)
    qk = _rotate(qk, cos.unsqueeze(2), sin.unsqueeze(2))  # cos/sin [1, T, 1, hd]
    q, k = qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, a.layer_idx)
    out, _ = attn.laser_attention_forward(a, q, k, v, None, dropout=0.0, scaling=a.scaling,
                                          sliding_window=_sliding_window(layer))
    return pk.o(out.reshape(b, t, -1))


def _block_parts(mod) -> list | None:
    """The block matrices a packed projection multiplies with, in the order of its output rows: ``[mod]`` for a
    :class:`QuantLinear`, the parts of a fused projection whose parts have different formats, ``None`` when any part
    is a float matrix."""
    parts = getattr(mod, "parts", None) if not isinstance(mod, QuantLinear) else [mod]
    if parts is None or not all(isinstance(p, QuantLinear) for p in parts):
        return None
    return list(parts)


def _native_args(layer):
    """Static arguments of the compiled whole-layer kernel for ``layer``, or ``None`` when it cannot take
    the layer (a float matrix, biases outside q/k/v, another activation). A fused projection of parts in different
    block formats (a Q4_K_M file's v or down beside Q4_K matrices) is passed part by part."""
    pk = layer.laserlm_packed
    cached = getattr(pk, "_native", None)
    if cached is not None:
        return cached or None
    a, cfg = layer.self_attn, layer.self_attn.config
    mats = [_block_parts(m) for m in (pk.qkv, pk.o, pk.gate_up, pk.down)]
    act = _ACTS.get(getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None))
    ok = (all(m is not None for m in mats) and all(p.bias is None for m in mats[1:] for p in m) and act is not None)
    if not ok:
        object.__setattr__(pk, "_native", ())
        return None
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    in_w, eps = _norm_params(layer.input_layernorm)
    if gemma:
        norms = [in_w, _norm_params(layer.post_attention_layernorm)[0], _norm_params(layer.pre_feedforward_layernorm)[0],
                 _norm_params(layer.post_feedforward_layernorm)[0]]
    else:
        norms = [in_w, _EMPTY, _norm_params(layer.post_attention_layernorm)[0], _EMPTY]
    q_norm = getattr(a, "q_norm", None)
    norms += [_norm_params(q_norm)[0], _norm_params(a.k_norm)[0]] if q_norm is not None else [_EMPTY, _EMPTY]
    hd = a.head_dim
    parts = [p for m in mats for p in m]
    qkv_bias = [p.bias for p in mats[0]]
    bias = (_EMPTY if all(b is None for b in qkv_bias) else
            torch.cat([b if b is not None else torch.zeros(p.out_features) for b, p in zip(qkv_bias, mats[0])]))
    args = (norms, eps, [p.qweight for p in parts], [p.fmt for p in parts], [p.out_features for p in parts],
            bias.contiguous(), pk.q_size // hd, pk.kv_size // hd, hd,
            float(a.scaling), int(_sliding_window(layer) or 0), act, pk.intermediate)
    object.__setattr__(pk, "_native", args)
    return args


def _kernel_positions(layer, positions: int) -> bool:
    """Whether the compiled layer kernel takes a forward of ``positions`` new tokens per sequence: a decode or
    verification step (at most ``KERNEL_MAX_ROWS``) always; a prompt chunk when the layer's matrices multiply prompt
    chunks with the kernels' arithmetic (prefill dtype int16, the default), so that a prompt position is computed
    exactly as a decode step computes it, whatever the chunking."""
    if positions <= KERNEL_MAX_ROWS:
        return True
    pk = getattr(layer, "laserlm_packed", None)
    return pk is not None and getattr(pk.qkv, "prefill_dtype", None) == torch.int16


KERNEL_BATCH_ROWS = 2  # per-layer path only (the engine runs layers through NativeStack): a paged batch of at most this
# many rows runs the kernel row by row (faster than the batched matmul at 2 rows, not at 4)


def _paged_kernel_rows(cache) -> bool:
    """A paged window the kernel can run, one request at a time: nothing evicted (each row's K/V are its pages in
    order), at most :data:`KERNEL_BATCH_ROWS` rows."""
    return (getattr(cache, "rows", None) is not None and not cache.evicted
            and (not cache.batched or len(cache.rows) <= KERNEL_BATCH_ROWS))


def _paged_decode_layer(ops, args, hidden, cos, sin, cache, idx):
    """The kernel on each row of a paged window: the row's pages of layer ``idx`` gathered into a contiguous
    ``[1, n_kv, pages * page_size, hd]`` buffer (rows shorter than the batch's longest end in null pages, which
    the kernel never reads: it attends to ``[0, start + T)``), the new positions copied back to their pages."""
    norms, eps, mats, fmts, rows, bias, h, hkv, hd, scaling, window, act, inter = args
    pool, ps = cache.pool, cache.pool.page_size
    outs = []
    for r in range(hidden.shape[0]):
        tab = cache.page_tables[r, idx]  # [P] this row's pages of the layer, in order
        shape = (1, pool.num_kv_heads, tab.numel() * ps, pool.head_dim)
        k = torch.index_select(pool.k, 1, tab).view(shape)  # a copy
        v = torch.index_select(pool.v, 1, tab).view(shape)
        pos = cache.row_positions[r]  # [T] the row's new positions
        c, s_ = (cos[r], sin[r]) if cos.shape[0] > 1 else (cos[0], sin[0])
        outs.append(ops.decode_layer(hidden[r:r + 1], norms, eps, mats, fmts, rows, bias, c, s_, k, v, int(pos[0]), h,
                                     hkv, hd, scaling, window, act, inter))
        page, off = cache.new_slots
        pid = tab[page[r]]
        pool.k[:, pid, off[r]] = k[0, :, pos]
        pool.v[:, pid, off[r]] = v[0, :, pos]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _native_layer(layer, hidden, cos, sin, cache):
    """Run the whole layer in one compiled call when nothing needs laserlm's attention hook; else ``None``.

    The kernel reads a contiguous cache of one request. A paged window (:mod:`laserlm.runtime.kv_pool`) with
    nothing evicted and at most :data:`KERNEL_BATCH_ROWS` rows runs it row by row on each row's pages gathered
    into a contiguous buffer (the copy the paged PyTorch path makes too; :func:`_paged_decode_layer`). Larger
    batches and windows with evicted pages take the PyTorch ops below."""
    paged = _paged_kernel_rows(cache) and hidden.shape[0] == len(cache.rows)
    if not (paged or isinstance(cache, CacheWindow)) or hidden.dtype != torch.float32 \
            or not _kernel_positions(layer, hidden.shape[1]):
        return None
    ops = kernels.ops()
    ctx = attn.current_context()
    idx = layer.self_attn.layer_idx
    if ops is None or ctx is None or ctx.kernel is not None or idx in ctx.want_probs or ctx.key_valid.get(idx) is not None:
        return None
    args = _native_args(layer)
    if args is None or (cache.pool.k.dtype if paged else cache.k[idx].dtype) != torch.float32:
        return None
    norms, eps, mats, fmts, rows, bias, h, hkv, hd, scaling, window, act, inter = args
    if paged:
        return _paged_decode_layer(ops, args, hidden, cos, sin, cache, idx)
    return ops.decode_layer(hidden, norms, eps, mats, fmts, rows, bias, cos[0], sin[0], cache.k[idx], cache.v[idx],
                            cache.start, h, hkv, hd, scaling, window, act, inter)


_NO_PROBS = torch.empty(0)


class NativeStack:
    """An engine's native layers registered once in the kernel's ``LayerStack``, so that a run of consecutive
    layers is one compiled call (a 30-layer decode step crosses from Python into the kernel once, not 30 times).

    Built lazily per layer; holds references to the packed matrices, no copies."""

    def __init__(self, ops):
        self.ops = ops
        self.stack = ops.LayerStack()
        self.ids: dict[int, int | None] = {}

    def id_of(self, layer) -> int | None:
        """The stack id of ``layer`` (registered on first use), or ``None`` when the kernel cannot take it."""
        idx = layer.self_attn.layer_idx
        sid = self.ids.get(idx, -1)
        if sid == -1:
            args = _native_args(layer)
            sid = None if args is None else self.stack.add(*args)
            self.ids[idx] = sid
        return sid


def native_stack_run(stack: NativeStack, layers, start: int, stop: int, hidden: torch.Tensor, rope: dict,
                     types, cache, eligible) -> tuple[torch.Tensor | None, int]:
    """Run layers ``start .. j-1`` in one kernel call, for the longest ``j <= stop`` such that every layer in between
    is ``eligible(i)`` (packed, no hooks), has no key mask and the kernel can take it, with no block-sparse
    attention kernel active, on the engine's contiguous cache (a layer in ``ctx.want_probs`` gets its attention
    probabilities from the kernel) or on a paged window of the KV pool with nothing evicted and no probabilities
    wanted (any number of rows, each at its own position: the weights are read once for all rows). Returns
    ``(hidden, j)``; ``(None, start)`` when not even layer ``start`` qualifies.
    ``hidden [B, T, d]`` float32."""
    paged = getattr(cache, "rows", None) is not None
    if not (paged or isinstance(cache, CacheWindow)) or hidden.dtype != torch.float32 \
            or not _kernel_positions(layers[start], hidden.shape[1]):
        return None, start
    if paged and (cache.evicted or cache.pool.k.dtype != torch.float32 or hidden.shape[0] != len(cache.rows)):
        return None, start
    ctx = attn.current_context()
    if ctx is None or ctx.kernel is not None:
        return None, start
    ids, cos, sin, kv = [], [], [], []
    j = start
    probs = []
    # a layer whose keys are masked (the none bridge) ends the run: it takes the PyTorch path, the layers after it
    # start the next run; so does a layer whose attention probabilities are wanted (adaptive depth's ATS layer) on
    # the paged pool. On the contiguous cache the kernel writes them into ctx.probs ([B, H, T, end], float32).
    while j < stop and eligible(j) and ctx.key_valid.get(j) is None and not (paged and j in ctx.want_probs):
        sid = stack.id_of(layers[j])
        if sid is None or (not paged and cache.k[j].dtype != torch.float32):
            break
        c, s_ = rope[types[j]]
        ids.append(sid)
        if paged:  # [B, T, hd] (rows at their own positions) or [1, T, hd] (one row)
            cos.append(c.contiguous())
            sin.append(s_.contiguous())
            kv.append(cache.page_tables[:, j].contiguous())  # [B, P] each row's pages of layer j
        else:
            cos.append(c[0])
            sin.append(s_[0])
            if j in ctx.want_probs:
                heads = _native_args(layers[j])[6]  # cached on the layer; registered, so not None
                ctx.probs[j] = torch.zeros(hidden.shape[0], heads, hidden.shape[1], cache.end)
                probs.append(ctx.probs[j])
            else:
                probs.append(_NO_PROBS)
        j += 1
    if not ids:
        return None, start
    if paged:
        starts = cache.row_positions[:, 0].tolist()
        return stack.stack.run_paged(hidden, ids, cos, sin, cache.pool.k, cache.pool.v, kv, starts), j
    ks, vs = [cache.k[i] for i in range(start, j)], [cache.v[i] for i in range(start, j)]
    return stack.stack.run(hidden, ids, cos, sin, ks, vs, cache.start, probs), j


def packed_layer(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                 native: bool = True) -> torch.Tensor:
    """``layer(hidden, cache=cache, position_embeddings=(cos, sin))`` on ``layer.laserlm_packed``.

    ``hidden [B, T, d]``; ``cos/sin [1, T, head_dim]``; ``cache`` the forward's
    :class:`~laserlm.runtime.kv_cache.CacheWindow` or ``None``. Must run
    inside an :func:`~laserlm.runtime.attention.attention_context`. ``native``: use the compiled
    whole-layer kernel where it applies. Returns ``[B, T, d]``.
    """
    out = _native_layer(layer, hidden, cos, sin, cache) if native else None
    if out is not None:
        return out
    pk = layer.laserlm_packed
    mlp = layer.mlp
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma3: norms after attention and MLP too
        x = _attention(layer, pk, _rms(layer.input_layernorm, hidden), cos, sin, cache)
        hidden = hidden + _rms(layer.post_attention_layernorm, x)
        gu = pk.gate_up(_rms(layer.pre_feedforward_layernorm, hidden))
        g, u = gu[..., : pk.intermediate], gu[..., pk.intermediate:]
        x = pk.down(F.gelu(g, approximate="tanh") * u)
        return hidden + _rms(layer.post_feedforward_layernorm, x)
    hidden = hidden + _attention(layer, pk, _rms(layer.input_layernorm, hidden), cos, sin, cache)
    gu = pk.gate_up(_rms(layer.post_attention_layernorm, hidden))
    g, u = gu[..., : pk.intermediate], gu[..., pk.intermediate:]
    return hidden + pk.down(mlp.act_fn(g) * u)
