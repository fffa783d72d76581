"""Weight formats: block-quantized linear layers and embeddings that run on laserlm's CPU kernels.

A quantized matrix ``W [N, K]`` is stored in blocks of 32 weights along K, in two formats with the sizes
and semantics of GGUF's (so GGUF tensors of these types are used without re-quantization):

========  ======  =========================
format    bytes   weight
========  ======  =========================
``Q4_1``  20      ``d * q + m``, q in 0..15
``Q8_0``  34      ``d * q``, q int8
========  ======  =========================

Two layouts of the same blocks:

- the *row layout* ``uint8 [N, nb * bytes]`` (``nb = K / 32``), "structure of arrays" per row: ``nb x 16``
  bytes of nibbles (byte j of a block: weight j low, weight j + 16 high, as GGUF), ``nb`` fp16 ``d``, then
  (Q4_1) ``nb`` fp16 ``m``; or ``nb x 32`` int8 and ``nb`` fp16 ``d`` (Q8_0). What conversion produces
  (:func:`to_soa` rearranges GGUF's interleaved blocks and turns Q4_0 into Q4_1 with ``m = -8 d``, exactly),
  what the packed-weights cache and the ONNX export read;
- the *kernel layout* ``uint8 [ceil(N / 16), nb * 16 * bytes]``: rows taken 16 at a time and column-interleaved
  block by block (:func:`kernel_layout`; the byte order is documented in ``kernels/quant.cpp``), what
  :class:`QuantLinear` and :class:`QuantEmbedding` hold and the kernels multiply.

How each GGUF tensor type is taken by ``--weights native`` (see :func:`from_gguf`):

- ``Q4_0`` (as Q4_1), ``Q4_1``, ``Q8_0``: the stored values (exact).
- ``Q5_0``: re-packed into ``Q8_0`` blocks with the same scale (exact: its values are ``d * (q - 16)``,
  ``q - 16`` in ``[-16, 15]``).
- ``Q4_K``: each 32-weight sub-block becomes a ``Q4_1`` block with ``d = d_super * sc`` and
  ``m = -dmin_super * min``, rounded to fp16 (relative scale error at most 2**-11; the 4-bit values are kept).
- ``Q5_1``, ``Q5_K``, ``Q6_K``, ``Q2_K``, ``Q3_K``, ``Q8_1``: dequantized by ``gguf`` and re-quantized to ``Q8_0``
  (round to nearest, error at most half a step of ``max|w| / 127`` per block).
- ``F32``, ``F16``, ``BF16``: kept as float matrices.

``--weights int4`` / ``int8`` quantize any float matrix by round-to-nearest into ``Q4_1`` (affine, group 32,
the layout of llama.cpp's Q4_1) or ``Q8_0`` (symmetric, group 32). Matrices whose in-dimension is not a
multiple of 32 stay in float (a documented fallback, counted in the load report).

The kernels (:mod:`laserlm.models.kernels`) quantize the activations per 32-block to int16 on the fly (the
scheme of llama.cpp's Q8_0 / Q8_1 activation blocks with 16-bit values: int8 activations cost SmolLM2 0.92
decode agreement with the float model, int16 keeps it at 1.0). Each output is an exact integer dot product
per block, accumulated in float block by block, so a row's result is the same whatever else is in the call.
Decode and verification steps (at most ``KERNEL_MAX_ROWS`` new tokens per sequence, any number of sequences)
always run the kernels. Inputs of more positions (prompt chunks) multiply in the *prefill dtype*
(:func:`resolve_prefill_dtype`): ``int16`` (the default: the same kernels, so a prompt position gets exactly the
arithmetic of a decode step, whatever the chunking, and pp512 was 1.1-1.3x the bfloat16 GEMM's on an AMD Zen 5), or
a GEMM over the matrix dequantized once per call: float32 (BLAS; exact to the dequantized weights), or bfloat16
(oneDNN on AMX tiles or AVX512-BF16, products accumulated in float32, the result rounded to bfloat16 and returned
in float32).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgumentError, UnsupportedArchitectureError
from . import kernels
from .dtypes import PREFILL_DTYPES, WEIGHT_FORMATS  # noqa: F401  (re-exported: quant.WEIGHT_FORMATS)

QK = 32
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML type ids
GGUF_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}  # storage formats of laserlm (Q4_0 is stored as Q4_1)
FORMAT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
GROUP_ROWS = 16  # rows of W per group of the kernel layout


def kernel_layout(blocks: torch.Tensor, fmt: int) -> torch.Tensor:
    """Row layout ``uint8 [N, nb * bytes]`` -> kernel layout ``uint8 [ceil(N / 16), nb * 16 * bytes]`` (rows past N
    are zero blocks). The inverse is :func:`row_layout`.

    Raises:
        InvalidArgumentError: an unknown format or a row size that is not a whole number of blocks."""
    if fmt not in BLOCK_BYTES:
        raise InvalidArgumentError(f"unknown block format {fmt}")
    n, rb = blocks.shape
    bb = BLOCK_BYTES[fmt]
    if rb % bb:
        raise InvalidArgumentError(f"rows of {rb} bytes are not whole {FORMAT_NAMES[fmt]} blocks")
    nb, g = rb // bb, -(-n // GROUP_ROWS)
    if g * GROUP_ROWS != n:
        blocks = torch.cat([blocks, blocks.new_zeros(g * GROUP_ROWS - n, rb)])
    b = blocks.reshape(g, GROUP_ROWS, rb)
    if fmt == Q4_1:
        qs = b[..., : nb * 16].reshape(g, GROUP_ROWS, nb, 16)
        v = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(g, GROUP_ROWS, nb, 4, 2, 4)  # [.., h, low/high, j]
        q = (v[..., 0, :] | (v[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(g, nb, 256)  # [g, nb, h, c, j]
        sc = b[..., nb * 16:].reshape(g, GROUP_ROWS, 2, nb, 2).permute(0, 3, 2, 1, 4).reshape(g, nb, 64)
    else:
        q = b[..., : nb * 32].reshape(g, GROUP_ROWS, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, nb, 512)
        sc = b[..., nb * 32:].reshape(g, GROUP_ROWS, nb, 2).permute(0, 2, 1, 3).reshape(g, nb, 32)
    return torch.cat([q, sc], dim=-1).reshape(g, nb * GROUP_ROWS * bb).contiguous()


def row_layout(qweight: torch.Tensor, fmt: int, n: int) -> torch.Tensor:
    """Kernel layout ``uint8 [ceil(N / 16), nb * 16 * bytes]`` -> row layout ``uint8 [N, nb * bytes]`` (a copy)."""
    g, gb = qweight.shape
    bb = BLOCK_BYTES[fmt]
    nb = gb // (GROUP_ROWS * bb)
    r = qweight.reshape(g, nb, GROUP_ROWS * bb)
    if fmt == Q4_1:
        q = r[..., :256].reshape(g, nb, 4, GROUP_ROWS, 4).permute(0, 3, 1, 2, 4)  # [g, c, nb, h, j]
        v = torch.stack([q & 0x0F, q >> 4], dim=-2).reshape(g, GROUP_ROWS, nb, 32)
        qs = (v[..., :16] | (v[..., 16:] << 4)).reshape(g * GROUP_ROWS, nb * 16)
        sc = r[..., 256:].reshape(g, nb, 2, GROUP_ROWS, 2).permute(0, 3, 2, 1, 4).reshape(g * GROUP_ROWS, nb * 4)
    else:
        qs = r[..., :512].reshape(g, nb, 8, GROUP_ROWS, 4).permute(0, 3, 1, 2, 4)
        qs = qs.reshape(g * GROUP_ROWS, nb * 32)
        sc = r[..., 512:].reshape(g, nb, GROUP_ROWS, 2).permute(0, 2, 1, 3).reshape(g * GROUP_ROWS, nb * 2)
    return torch.cat([qs, sc], dim=1)[:n].contiguous()


def to_soa(aos: torch.Tensor, fmt: int) -> tuple[torch.Tensor, int]:
    """GGUF's interleaved blocks ``uint8 [N, nb * block_bytes]`` -> laserlm's row layout; returns
    ``(blocks, storage_fmt)`` (Q4_0 becomes Q4_1 with ``m = -8 d``, exact in fp16)."""
    n = aos.shape[0]
    b = aos.reshape(n, -1, GGUF_BLOCK_BYTES[fmt])
    nb = b.shape[1]
    d = b[..., 0:2].reshape(n, nb * 2)
    if fmt == Q8_0:
        return torch.cat([b[..., 2:].reshape(n, nb * 32), d], dim=1).contiguous(), Q8_0
    if fmt == Q4_1:
        return torch.cat([b[..., 4:].reshape(n, nb * 16), d, b[..., 2:4].reshape(n, nb * 2)], dim=1).contiguous(), Q4_1
    if fmt == Q4_0:
        m = (-8 * d.contiguous().view(torch.float16)).view(torch.uint8)
        return torch.cat([b[..., 2:].reshape(n, nb * 16), d, m], dim=1).contiguous(), Q4_1
    raise InvalidArgumentError(f"no block layout for GGML type {fmt}")
# inputs with more new tokens per sequence than this (prompt chunks) are multiplied by a dequantized copy (GEMM)
KERNEL_MAX_ROWS = 16

QUANTIZED_FORMATS = ("int8", "int4", "native")


# -- quantize / dequantize in PyTorch (reference path and load-time packing) -----------------------
def _check_k(w: torch.Tensor) -> tuple[int, int]:
    if w.dim() != 2:
        raise InvalidArgumentError(f"expected a 2-D weight matrix, got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % QK:
        raise InvalidArgumentError(f"in_features {k} is not a multiple of {QK}: no block format fits")
    return n, k


def quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest affine 4-bit, group 32: ``w [N, K]`` float -> ``uint8 [N, K/32*20]`` Q4_1 rows.

    Same rule as ``gguf.quants.Q4_1.quantize_blocks`` (``d = (max - min) / 15``, ``m = min``)."""
    n, k = _check_k(w)
    b = w.detach().float().reshape(n, k // QK, QK)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((b - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    dh = d.to(torch.float16).view(torch.uint8).reshape(n, k // QK, 2)
    mh = lo.to(torch.float16).view(torch.uint8).reshape(n, k // QK, 2)
    return to_soa(torch.cat([dh, mh, qs], dim=-1).reshape(n, -1), Q4_1)[0]


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest symmetric 8-bit, group 32: ``w [N, K]`` -> ``uint8 [N, K/32*34]`` Q8_0 blocks
    (``d = max|w| / 127``, as ``gguf.quants.Q8_0``)."""
    n, k = _check_k(w)
    b = w.detach().float().reshape(n, k // QK, QK)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(b * inv).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    dh = d.to(torch.float16).view(torch.uint8).reshape(n, k // QK, 2)
    return to_soa(torch.cat([dh, q], dim=-1).reshape(n, -1), Q8_0)[0]


def dequantize_reference(blocks: torch.Tensor, fmt: int, k: int) -> torch.Tensor:
    """PyTorch dequantization of laserlm rows ``uint8 [N, K/32*bytes]`` -> float32 ``[N, K]`` (the kernels'
    fallback and an independent check of them)."""
    n, nb = blocks.shape[0], k // QK
    qb = 32 if fmt == Q8_0 else 16
    qs = blocks[:, : nb * qb].reshape(n, nb, qb)
    d = blocks[:, nb * qb: nb * qb + nb * 2].contiguous().view(torch.float16).float().unsqueeze(-1)  # [N, nb, 1]
    if fmt == Q8_0:
        return (d * qs.contiguous().view(torch.int8).float()).reshape(n, k)
    m = blocks[:, nb * qb + nb * 2:].contiguous().view(torch.float16).float().unsqueeze(-1)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    return (d * q + m).reshape(n, k)


def dequantize(qweight: torch.Tensor, fmt: int, k: int, n: int, rows: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` (or ``[len(rows), K]``) from a matrix in the kernel layout, in ``dtype`` (float32, or bfloat16: each
    float32 value rounded to nearest even), with the compiled kernel when available."""
    ops = kernels.ops()
    if ops is not None:
        idx = rows if rows is not None else torch.empty(0, dtype=torch.long)
        return ops.dequantize(qweight, fmt, k, n, idx, dtype == torch.bfloat16)
    blocks = row_layout(qweight, fmt, n)
    sub = blocks if rows is None else blocks[rows]
    return dequantize_reference(sub, fmt, k).to(dtype)


def resolve_prefill_dtype(name: str | torch.dtype | None) -> torch.dtype:
    """The arithmetic of the quantized weights' products over more than ``KERNEL_MAX_ROWS`` positions.

    ``torch.int16``: the block kernels (activations rounded to int16 per block, exact integer sums), the arithmetic
    of a decode step; ``torch.float32`` / ``torch.bfloat16``: a GEMM over the dequantized matrix (float32 is exact to
    the dequantized weights). ``"auto"``/``None``: int16 where the kernels are built, else bfloat16 where the CPU
    multiplies bfloat16 matrices in hardware (:func:`laserlm.models.kernels.hardware_bf16_gemm`), else float32.
    An explicit ``"int16"`` without the kernels falls back the same way (the kernels warned once).

    Raises:
        InvalidArgumentError: any other value.
    """
    if isinstance(name, torch.dtype) and name in (torch.int16, torch.float32, torch.bfloat16):
        return name
    if name in (None, "auto", "int16"):
        if kernels.ops() is not None:
            return torch.int16
        fallback = torch.bfloat16 if kernels.hardware_bf16_gemm() else torch.float32
        if name == "int16":
            import warnings  # noqa: PLC0415

            warnings.warn(f"laserlm: --prefill-dtype int16 needs the block kernels, which are off "
                          f"({kernels.unavailable_reason() or 'not built'}); prompt chunks run in {fallback}",
                          RuntimeWarning, stacklevel=2)
        return fallback
    if name in ("float32", "bfloat16"):
        return getattr(torch, name)
    raise InvalidArgumentError(f"unknown prefill dtype {name!r}; expected one of {', '.join(PREFILL_DTYPES)}")


def matmul(x: torch.Tensor, qweight: torch.Tensor, fmt: int, k: int, n: int,
           prefill_dtype: torch.dtype = torch.int16, kernel: bool | None = None) -> torch.Tensor:
    """``x [M, K]`` float32 @ ``W.T`` -> ``[M, N]`` float32, W in the kernel layout.

    ``kernel``: run the block kernel (int16 activations; each row's result independent of the others); else the
    ``prefill_dtype`` arithmetic: the kernel too for ``torch.int16``, or a GEMM over the dequantized matrix (bfloat16:
    operands rounded to bfloat16, float32 accumulation, the result rounded to bfloat16). ``None``: the kernel for at
    most ``KERNEL_MAX_ROWS`` rows."""
    ops = kernels.ops()
    if kernel is None:
        kernel = x.shape[0] <= KERNEL_MAX_ROWS
    if ops is not None and (kernel or prefill_dtype == torch.int16):
        return ops.qmatmul(x, qweight, fmt, k, n)
    if prefill_dtype == torch.bfloat16:
        return F.linear(x.bfloat16(), dequantize(qweight, fmt, k, n, dtype=torch.bfloat16)).float()
    return x @ dequantize(qweight, fmt, k, n).T


# -- modules ---------------------------------------------------------------------------------------
class QuantLinear(nn.Module):
    """A linear layer over block-quantized weights: ``[..., K] -> [..., N]``.

    Args:
        blocks: ``uint8 [N, K/32 * bytes]`` blocks in the row layout (see the module docstring); stored in the
            kernel layout (``qweight``). :meth:`from_qweight` takes a matrix already in the kernel layout.
        fmt: ``Q4_1`` or ``Q8_0`` (GGML type id).
        in_features: K (a multiple of 32).
        bias: optional float ``[N]``.

    Inputs of any float dtype are computed in float32 and returned in the input's dtype. An input ``[..., T, K]``
    with at most ``KERNEL_MAX_ROWS`` positions ``T`` (a decode or verification step of any number of sequences, or a
    2-D input of at most that many rows) runs the block kernel, so a sequence's result never depends on the batch it
    is in; longer inputs (prompt chunks) multiply in ``prefill_dtype`` (an attribute: int16, the kernel, unless the
    loader sets another: see :func:`resolve_prefill_dtype`). ``weight`` dequantizes on demand (float32 ``[N, K]``; for code that reads weights, not
    for the hot path); ``blocks`` gives the row layout (a copy).

    Raises:
        InvalidArgumentError: an unknown format or blocks that do not hold rows of ``in_features`` weights.
    """

    def __init__(self, blocks: torch.Tensor, fmt: int, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        if fmt not in BLOCK_BYTES:
            raise InvalidArgumentError(f"unknown block format {fmt}")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != in_features // QK * BLOCK_BYTES[fmt]:
            raise InvalidArgumentError(f"{FORMAT_NAMES[fmt]} blocks of shape {tuple(blocks.shape)} do not hold "
                                       f"rows of {in_features} weights")
        self._setup(kernel_layout(blocks, fmt), fmt, in_features, blocks.shape[0], bias)

    @classmethod
    def from_qweight(cls, qweight: torch.Tensor, fmt: int, in_features: int, out_features: int,
                     bias: torch.Tensor | None = None) -> "QuantLinear":
        """A layer over ``qweight`` (kernel layout ``uint8 [ceil(N / 16), K/32 * 16 * bytes]``), shared, not copied.

        Raises:
            InvalidArgumentError: a shape that does not match ``in_features`` / ``out_features``."""
        expect = (-(-out_features // GROUP_ROWS), in_features // QK * GROUP_ROWS * BLOCK_BYTES.get(fmt, 0))
        if fmt not in BLOCK_BYTES or qweight.dtype != torch.uint8 or tuple(qweight.shape) != expect:
            raise InvalidArgumentError(f"a kernel-layout matrix of shape {tuple(qweight.shape)} does not hold "
                                       f"{out_features} rows of {in_features} weights in format {fmt}")
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod._setup(qweight.contiguous(), fmt, in_features, out_features, bias)
        return mod

    def _setup(self, qweight, fmt, in_features, out_features, bias):
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0 or in_features % QK:
            raise InvalidArgumentError(f"{FORMAT_NAMES.get(fmt, fmt)} rows hold whole blocks of {QK} weights: "
                                       f"in_features must be a positive multiple of {QK}, got {in_features!r}")
        if out_features <= 0:
            raise InvalidArgumentError(f"a quantized matrix needs at least one output row, got {out_features}")
        self.register_buffer("qweight", qweight)
        self.fmt = fmt
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.prefill_dtype = torch.int16

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.qweight, self.fmt, self.in_features, self.out_features)

    @property
    def blocks(self) -> torch.Tensor:
        return row_layout(self.qweight, self.fmt, self.out_features)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        positions = x.shape[-2] if x.dim() >= 3 else x2.shape[0]
        y = matmul(x2, self.qweight, self.fmt, self.in_features, self.out_features, self.prefill_dtype,
                   kernel=positions <= KERNEL_MAX_ROWS)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={FORMAT_NAMES[self.fmt]}"


class DenseLinear(nn.Module):
    """A float matrix in the same role as :class:`QuantLinear` (a matrix no block format fits)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.out_features, self.in_features = self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


class RowSlice(nn.Module):
    """Rows ``[start, stop)`` of a fused projection's output (keeps ``q_proj``/``k_proj``/... callable on
    the transformers modules after fusion; the packed layer path calls the fused matrix once instead)."""

    def __init__(self, fused: nn.Module, start: int, stop: int):
        super().__init__()
        self.fused = fused
        self.start, self.stop = start, stop
        self.in_features = fused.in_features
        self.out_features = stop - start

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight[self.start:self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start:self.stop]


class QuantEmbedding(nn.Module):
    """Token embedding read from block-quantized rows: ``ids [B, T] -> [B, T, d]`` (float32 unless
    ``dtype``), times ``scale`` (Gemma's ``sqrt(d)``) when given. Only the rows of the ids are dequantized.
    ``blocks`` is the row layout (stored in the kernel layout, ``qweight``, so that a tied LM head shares it)."""

    def __init__(self, blocks: torch.Tensor, fmt: int, dim: int, scale: float | None = None,
                 dtype: torch.dtype = torch.float32, *, qweight: torch.Tensor | None = None,
                 num_embeddings: int | None = None):
        super().__init__()
        if qweight is None:
            qweight, num_embeddings = kernel_layout(blocks, fmt), blocks.shape[0]
        self.register_buffer("qweight", qweight)
        self.fmt, self.embedding_dim, self.num_embeddings = fmt, dim, num_embeddings
        self.scale = scale
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.qweight, self.fmt, self.embedding_dim, self.num_embeddings)

    @property
    def blocks(self) -> torch.Tensor:
        return row_layout(self.qweight, self.fmt, self.num_embeddings)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        out = dequantize(self.qweight, self.fmt, self.embedding_dim, self.num_embeddings, flat)
        if self.scale is not None:
            out = out * torch.tensor(self.scale, dtype=self.dtype).float()
        return out.to(self.dtype).view(*input_ids.shape, self.embedding_dim)


def quantize_matrix(w: torch.Tensor, fmt: int) -> torch.Tensor:
    """Float ``[N, K]`` -> blocks of ``fmt`` (``Q4_1`` or ``Q8_0``)."""
    if fmt == Q4_1:
        return quantize_q4_1(w)
    if fmt == Q8_0:
        return quantize_q8_0(w)
    raise InvalidArgumentError(f"cannot quantize to {FORMAT_NAMES.get(fmt, fmt)}")


# -- GGUF tensors ----------------------------------------------------------------------------------
def _q4_k_to_q4_1(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """Q4_K super-blocks (256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of
    nibbles) -> Q4_1 blocks, one per 32-weight sub-block (``d*sc`` and ``-dmin*m`` rounded to fp16)."""
    from gguf.quants import Q4_K  # noqa: PLC0415

    blocks = raw.reshape(-1, 144)
    nsb = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scale = (d * sc.astype(np.float32)).astype(np.float16)      # [nsb, 8]
    zero = (-(dmin * mn.astype(np.float32))).astype(np.float16)  # [nsb, 8]
    qs = blocks[:, 16:].reshape(nsb, 4, 32)  # chunk j: low nibbles = sub-block 2j, high = 2j+1
    lo, hi = qs & 0x0F, qs >> 4
    vals = np.stack([lo, hi], axis=2).reshape(nsb, 8, 32)  # [nsb, sub-block, 32] values 0..15
    packed = vals[..., :16] | (vals[..., 16:] << 4)
    out = np.concatenate([scale.view(np.uint8).reshape(nsb, 8, 2), zero.view(np.uint8).reshape(nsb, 8, 2),
                          packed.astype(np.uint8)], axis=-1)
    return out.reshape(n, k // QK * 20)


def _q5_0_to_q8_0(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """Q5_0 blocks (fp16 d, 4 bytes of high bits, 16 bytes of nibbles) -> Q8_0 blocks, exactly."""
    b = raw.reshape(-1, 22)
    nb = b.shape[0]
    qh = b[:, 2:6].copy().view(np.uint32).reshape(nb, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    qh = (qh & 1).astype(np.uint8)
    qs = b[:, 6:]
    ql = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    q = (ql | (qh << 4)).astype(np.int16) - 16
    out = np.concatenate([b[:, 0:2], q.astype(np.int8).view(np.uint8)], axis=-1)
    return out.reshape(n, k // QK * 34)


CONVERT_WEIGHTS = 1 << 20  # weights per chunk of a GGUF matrix's conversion at most (4 MiB as float32) ...
CONVERT_ROWS = 128  # ... and rows: never a whole matrix as float (every projection of a real model has more rows)


def from_gguf(raw: np.ndarray, ggml_type: int, n: int, k: int) -> tuple[str, torch.Tensor, int | None, str]:
    """Convert one GGUF matrix ``[N, K]`` for ``--weights native``.

    Args:
        raw: the tensor's bytes as ``gguf.GGUFReader`` gives them (``[N, row_bytes]`` uint8 for block types,
            ``[N, K]`` float for float types).
        ggml_type: its ``GGMLQuantizationType`` value.

    Returns:
        ``(kind, data, fmt, how)``: ``kind`` is ``"blocks"`` (``data`` uint8 blocks of ``fmt``) or
        ``"float"`` (``data`` float32 ``[N, K]``, ``fmt`` None); ``how`` is ``"exact"`` or a note on re-quantization.

    Raises:
        UnsupportedArchitectureError: a tensor type without a kernel or conversion.
    """
    from gguf import GGMLQuantizationType as T  # noqa: PLC0415
    from gguf.quants import dequantize as gguf_dequantize  # noqa: PLC0415

    t = T(ggml_type)
    if t in (T.F32, T.F16, T.BF16):
        w = torch.from_numpy(np.asarray(gguf_dequantize(raw, t), dtype=np.float32).reshape(n, k).copy())
        return "float", w, None, "exact"
    if k % QK:
        raise UnsupportedArchitectureError(f"GGUF tensor of type {t.name} with rows of {k} (not a multiple of 32)")
    rows = np.asarray(raw).reshape(n, -1)
    step = max(1, min(CONVERT_ROWS, CONVERT_WEIGHTS // k))  # rows converted at a time: a chunk's intermediates only

    def by_rows(convert) -> torch.Tensor:
        return torch.cat([convert(rows[r:r + step]) for r in range(0, n, step)])

    if t in (T.Q4_0, T.Q4_1, T.Q8_0):
        blocks = by_rows(lambda c: to_soa(torch.from_numpy(np.array(c, copy=True)), int(t))[0])
        return "blocks", blocks, (Q4_1 if t == T.Q4_0 else int(t)), "exact" if t != T.Q4_0 else "exact (Q4_0 as Q4_1, m = -8 d)"
    if t == T.Q5_0:
        blocks = by_rows(lambda c: to_soa(torch.from_numpy(_q5_0_to_q8_0(np.ascontiguousarray(c), len(c), k)), Q8_0)[0])
        return "blocks", blocks, Q8_0, "exact (Q5_0 as Q8_0)"
    if t == T.Q4_K:
        blocks = by_rows(lambda c: to_soa(torch.from_numpy(_q4_k_to_q4_1(np.ascontiguousarray(c), len(c), k)), Q4_1)[0])
        return "blocks", blocks, Q4_1, "Q4_K sub-blocks as Q4_1 (scales rounded to fp16)"
    if t in (T.Q5_1, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.Q8_1):
        blocks = by_rows(lambda c: quantize_q8_0(torch.from_numpy(
            np.asarray(gguf_dequantize(c, t), dtype=np.float32).reshape(len(c), k))))
        return "blocks", blocks, Q8_0, f"{t.name} re-quantized to Q8_0"
    raise UnsupportedArchitectureError(
        f"GGUF tensor type {t.name} has no laserlm kernel; load it with --weights fp32 or --weights bf16 "
        f"(dequantized by transformers), or int8/int4 to re-quantize from the dequantized copy")
