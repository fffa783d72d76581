"""Weight formats: block-quantized linear layers and embeddings that run on laserlm's CPU kernels.

A quantized matrix ``W [N, K]`` is stored in blocks along K, in four formats with the sizes and semantics of
GGUF's (so GGUF tensors of these types can be used without re-quantization):

========  =======  =====  ===============================================================
format    weights  bytes  weight
========  =======  =====  ===============================================================
``Q4_1``  32       20     ``d * q + m``, q in 0..15
``Q8_0``  32       34     ``d * q``, q int8
``Q6_K``  256      210    ``d * sc[k // 16] * (q - 32)``, q in 0..63, sc int8 (GGUF's block)
``Q4_K``  256      144    ``(d * sc[k // 32]) * q - dmin * m[k // 32]``, q in 0..15, sc, m 6-bit (GGUF's block)
========  =======  =====  ===============================================================

Two layouts of the same blocks:

- the *row layout* ``uint8 [N, row_bytes(fmt, K)]``: Q4_1 / Q8_0 rows are "structure of arrays" (``nb = K / 32``):
  ``nb x 16`` bytes of nibbles (byte j of a block: weight j low, weight j + 16 high, as GGUF), ``nb`` fp16 ``d``,
  then (Q4_1) ``nb`` fp16 ``m``; or ``nb x 32`` int8 and ``nb`` fp16 ``d`` (Q8_0). Q6_K and Q4_K rows are GGUF's
  own blocks (``ql[128], qh[64], sc[16], d`` and ``d, dmin, scales[12], qs[128]``). What conversion produces
  (:func:`to_soa` rearranges GGUF's interleaved Q4/Q8 blocks and turns Q4_0 into Q4_1 with ``m = -8 d``, exactly),
  what the ONNX export reads;
- the *kernel layout* ``uint8 [ceil(N / 16), group_bytes(fmt, K)]``: rows taken 16 at a time and
  column-interleaved block by block (:func:`kernel_layout`; the byte order is documented in ``kernels/qgemm.h``),
  what :class:`QuantLinear` and :class:`QuantEmbedding` hold, the kernels multiply and the packed-weights cache
  stores.

How each GGUF tensor type is taken by ``--weights native`` (see :func:`from_gguf`):

- ``Q4_0`` (as Q4_1), ``Q4_1``, ``Q8_0``: the stored values (exact).
- ``Q6_K``: re-quantized to ``Q8_0`` like the types below (the default), or kept as ``Q6_K`` (exact, 23 % fewer
  bytes) with ``LASERLM_KQUANTS=native``.
- ``Q5_0``: re-packed into ``Q8_0`` blocks with the same scale (exact: its values are ``d * (q - 16)``,
  ``q - 16`` in ``[-16, 15]``).
- ``Q4_K``: each 32-weight sub-block becomes a ``Q4_1`` block with ``d = d_super * sc`` and
  ``m = -dmin_super * min``, rounded to fp16 (relative scale error at most 2**-11; the 4-bit values are kept), by
  default; or kept as ``Q4_K`` (exact) with ``LASERLM_KQUANTS=native`` (:func:`kquant_mode`). In the kernel layout
  its 6-bit scales and mins take a byte each (4.625 bits per weight against the file's 4.5 and Q4_1's 5); the
  kernels compute a 32-weight block as Q4_1's with ``d = d_super * sc`` and ``m = -(dmin_super * min)``, exact in
  float32.
- ``Q5_1``, ``Q5_K``, ``Q6_K`` (by default), ``Q2_K``, ``Q3_K``, ``Q8_1``: dequantized by ``gguf`` and re-quantized to ``Q8_0``
  (round to nearest, error at most half a step of ``max|w| / 127`` per block).
- ``F32``, ``F16``, ``BF16``: kept as float matrices.

The native K-quant kernels save bytes but do more work per byte (scales from 6-bit integers per 32 weights; Q6_K also
unpacks 6-bit weights and applies a scale per 16 weights, for int16 activations): on an AMD Zen 4 with a 128k x 2048
head, a one-token product at 1 thread took 6.9 ms as Q4_K against 6.1 as Q4_1 and 14.6 ms as Q6_K against 10.4 as
Q8_0, and a 4-token one 20-70 % longer; only Q4_K at 2 threads was faster (4.4 against 4.8 ms;
``benchmarks/RESULTS.md``). So the conversions stay the default.

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
Q4_0, Q4_1, Q8_0, Q6_K = 2, 3, 8, 14  # GGML type ids
GGUF_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
Q4_K = 12
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34, Q6_K: 210, Q4_K: 144}  # storage formats (Q4_0 is stored as Q4_1): bytes per block
BLOCK_WEIGHTS = {Q4_1: QK, Q8_0: QK, Q6_K: 256, Q4_K: 256}  # ... and weights per block (K must be a multiple)
FORMAT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q6_K: "Q6_K", Q4_K: "Q4_K"}
GROUP_ROWS = 16  # rows of W per group of the kernel layout
Q6K_SUB, Q6K_REGION = 192, 3360  # bytes of a Q6_K sub-block record and region (16 rows x 256 weights)
Q4K_REGION = 2368  # bytes of a Q4_K region (16 rows x 256 weights: 2048 of quants, 128 sc, 128 m, 32 d, 32 dmin)
REGION_BYTES = {Q4_1: 16 * 20, Q8_0: 16 * 34, Q6_K: Q6K_REGION, Q4_K: Q4K_REGION}  # per block of 16 rows


def group_bytes(fmt: int, k: int) -> int:
    """Bytes of one group of 16 rows of ``k`` weights in the kernel layout (``16 * row_bytes`` except for Q4_K, whose
    scales take a byte each there).

    Raises:
        InvalidArgumentError: as :func:`row_bytes`."""
    return row_bytes(fmt, k) // BLOCK_BYTES[fmt] * REGION_BYTES[fmt]


def row_bytes(fmt: int, k: int) -> int:
    """Bytes of one row of ``k`` weights in format ``fmt`` (row layout; the kernel layout holds 16 rows per group).

    Raises:
        InvalidArgumentError: an unknown format, or ``k`` not a whole number of its blocks."""
    if fmt not in BLOCK_BYTES:
        raise InvalidArgumentError(f"unknown block format {fmt}")
    if k % BLOCK_WEIGHTS[fmt]:
        raise InvalidArgumentError(f"rows of {k} weights are not whole {FORMAT_NAMES[fmt]} blocks of "
                                   f"{BLOCK_WEIGHTS[fmt]}")
    return k // BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt]


def _q6k_values(blocks: torch.Tensor):
    """GGUF Q6_K rows ``uint8 [N, nsb * 210]`` -> ``(q uint8 [N, nsb, 256] in 0..63, sc uint8 [N, nsb, 16] (int8
    bytes), d uint8 [N, nsb, 2] (fp16 bytes))``, weight k of a super-block at index k (ggml's ``dequantize_row_q6_K``)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 210)
    nsb = b.shape[1]
    ql = b[..., :128].reshape(n, nsb, 2, 64)
    qh = b[..., 128:192].reshape(n, nsb, 2, 32)
    lo_a, lo_b = ql[..., :32], ql[..., 32:]
    low = torch.stack([lo_a & 0x0F, lo_b & 0x0F, lo_a >> 4, lo_b >> 4], dim=-2)  # [n, nsb, half, quarter, 32]
    high = torch.stack([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=-2)
    return (low | (high << 4)).reshape(n, nsb, 256), b[..., 192:208], b[..., 208:210]


def _q6k_blocks(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_q6k_values`: ``[N, nsb, 256]``, ``[N, nsb, 16]``, ``[N, nsb, 2]`` -> ``uint8 [N, nsb * 210]``."""
    n, nsb = q.shape[:2]
    v = q.reshape(n, nsb, 2, 4, 32)
    low, high = v & 0x0F, v >> 4
    ql = torch.cat([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], dim=-1)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    return torch.cat([ql.reshape(n, nsb, 128), qh.reshape(n, nsb, 64), sc, d], dim=-1).reshape(n, nsb * 210)


def _groups_per_chunk(nsb: int) -> int:
    """Groups of 16 rows of ``nsb`` super-blocks that one layout conversion takes at a time (about 4M weights)."""
    return max(1, (1 << 22) // (GROUP_ROWS * nsb * 256))


def _superblock_kernel_layout(blocks: torch.Tensor, g: int, fmt: int) -> torch.Tensor:
    """Q6_K / Q4_K rows (padded to ``16 g`` rows) -> regions of 16 rows x 256 weights (the layouts in
    ``kernels/qgemm.h``), a few groups at a time (the intermediates of a 128k-row head would take gigabytes)."""
    groups = _q6k_kernel_groups if fmt == Q6_K else _q4k_kernel_groups
    nsb = blocks.shape[1] // BLOCK_BYTES[fmt]
    step = _groups_per_chunk(nsb)
    if g <= step:
        return groups(blocks, g)
    out = torch.empty(g, nsb * REGION_BYTES[fmt], dtype=torch.uint8)
    for g0 in range(0, g, step):
        g1 = min(g, g0 + step)
        out[g0:g1] = groups(blocks[g0 * GROUP_ROWS: g1 * GROUP_ROWS], g1 - g0)
    return out


def _q6k_kernel_groups(blocks: torch.Tensor, g: int) -> torch.Tensor:
    q, sc, d = _q6k_values(blocks)
    nsb = q.shape[1]
    q = q.reshape(g, GROUP_ROWS, nsb, 16, 2, 2, 4)  # [g, c, nsb, s, e, nibble, j]: k = 16 s + 8 e + 4 nibble + j
    lowc = ((q[..., 0, :] & 0x0F) | ((q[..., 1, :] & 0x0F) << 4)).permute(0, 2, 3, 4, 1, 5)  # [g, nsb, s, e, c, j]
    h = (q >> 4).reshape(g, GROUP_ROWS, nsb, 16, 4, 4)  # [g, c, nsb, s, i, j]: k = 16 s + 4 i + j
    highc = (h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)).permute(0, 2, 3, 1, 4)
    rec = torch.cat([lowc.reshape(g, nsb, 16, 128), highc.reshape(g, nsb, 16, 64)], dim=-1)
    scs = sc.reshape(g, GROUP_ROWS, nsb, 16).permute(0, 2, 3, 1).reshape(g, nsb, 256)
    ds = d.reshape(g, GROUP_ROWS, nsb, 2).permute(0, 2, 1, 3).reshape(g, nsb, 32)
    return torch.cat([rec.reshape(g, nsb, 16 * Q6K_SUB), scs, ds], dim=-1).reshape(g, nsb * Q6K_REGION)


def _q6k_row_layout(qweight: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`_q6k_kernel_layout` (the first ``n`` rows)."""
    g = qweight.shape[0]
    r = qweight.reshape(g, -1, Q6K_REGION)
    nsb = r.shape[1]
    rec = r[..., : 16 * Q6K_SUB].reshape(g, nsb, 16, Q6K_SUB)
    lowc = rec[..., :128].reshape(g, nsb, 16, 2, GROUP_ROWS, 4)  # [g, nsb, s, e, c, j]
    low = torch.stack([lowc & 0x0F, lowc >> 4], dim=-2)  # [g, nsb, s, e, c, nibble, j]
    low = low.permute(0, 4, 1, 2, 3, 5, 6).reshape(g, GROUP_ROWS, nsb, 256)
    highc = rec[..., 128:].reshape(g, nsb, 16, GROUP_ROWS, 4)  # [g, nsb, s, c, j]
    high = torch.stack([(highc >> (2 * i)) & 3 for i in range(4)], dim=-2)  # [g, nsb, s, c, i, j]
    high = high.permute(0, 3, 1, 2, 4, 5).reshape(g, GROUP_ROWS, nsb, 256)
    q = (low | (high << 4)).reshape(g * GROUP_ROWS, nsb, 256)
    sc = r[..., 16 * Q6K_SUB: 16 * Q6K_SUB + 256].reshape(g, nsb, 16, GROUP_ROWS).permute(0, 3, 1, 2)
    d = r[..., 16 * Q6K_SUB + 256:].reshape(g, nsb, GROUP_ROWS, 2).permute(0, 2, 1, 3)
    out = _q6k_blocks(q, sc.reshape(g * GROUP_ROWS, nsb, 16), d.reshape(g * GROUP_ROWS, nsb, 2))
    return out[:n].contiguous()


def _q4k_values(blocks: torch.Tensor):
    """GGUF Q4_K rows ``uint8 [N, nsb * 144]`` -> ``(q [N, nsb, 256] in 0..15, sc [N, nsb, 8], m [N, nsb, 8] in
    0..63, d, dmin [N, nsb, 2] fp16 bytes)`` (ggml's ``get_scale_min_k4`` and ``dequantize_row_q4_K``)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 144)
    nsb = b.shape[1]
    s = b[..., 4:16]
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    qs = b[..., 16:].reshape(n, nsb, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(n, nsb, 256)  # chunk j: weights 64 j + (0..31 low, 32..63 high)
    return q, sc, m, b[..., 0:2], b[..., 2:4]


def _q4k_blocks(q, sc, m, d, dmin) -> torch.Tensor:
    """The inverse of :func:`_q4k_values` -> ``uint8 [N, nsb * 144]`` (sc and m must be below 64)."""
    n, nsb = q.shape[:2]
    s = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                   (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], dim=-1)
    v = q.reshape(n, nsb, 4, 2, 32)
    qs = (v[..., 0, :] | (v[..., 1, :] << 4)).reshape(n, nsb, 128)
    return torch.cat([d, dmin, s, qs], dim=-1).reshape(n, nsb * 144)


def _q4k_kernel_groups(blocks: torch.Tensor, g: int) -> torch.Tensor:
    q, sc, m, d, dmin = _q4k_values(blocks)
    nsb = q.shape[1]
    q = q.reshape(g, GROUP_ROWS, nsb, 8, 4, 2, 4)  # [g, c, nsb, b, h, nibble, j]: k = 32 b + 8 h + 4 nibble + j
    quants = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 4, 1, 5).reshape(g, nsb, 2048)

    def by_lane(t, width):  # [g * 16, nsb, width] -> [g, nsb, width, 16] (byte width_i * 16 + c)
        return t.reshape(g, GROUP_ROWS, nsb, width).permute(0, 2, 3, 1).reshape(g, nsb, width * GROUP_ROWS)

    ds = d.reshape(g, GROUP_ROWS, nsb, 2).permute(0, 2, 1, 3).reshape(g, nsb, 32)
    dms = dmin.reshape(g, GROUP_ROWS, nsb, 2).permute(0, 2, 1, 3).reshape(g, nsb, 32)
    return torch.cat([quants, by_lane(sc, 8), by_lane(m, 8), ds, dms], dim=-1).reshape(g, nsb * Q4K_REGION)


def _q4k_row_layout(qweight: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of the Q4_K kernel layout (the first ``n`` rows)."""
    g = qweight.shape[0]
    r = qweight.reshape(g, -1, Q4K_REGION)
    nsb = r.shape[1]
    v = r[..., :2048].reshape(g, nsb, 8, 4, GROUP_ROWS, 4)  # [g, nsb, b, h, c, j]
    q = torch.stack([v & 0x0F, v >> 4], dim=-2)  # [g, nsb, b, h, c, nibble, j]
    q = q.permute(0, 4, 1, 2, 3, 5, 6).reshape(g * GROUP_ROWS, nsb, 256)

    def from_lane(t, width):
        return t.reshape(g, nsb, width, GROUP_ROWS).permute(0, 3, 1, 2).reshape(g * GROUP_ROWS, nsb, width)

    sc, m = from_lane(r[..., 2048:2176], 8), from_lane(r[..., 2176:2304], 8)
    d = r[..., 2304:2336].reshape(g, nsb, GROUP_ROWS, 2).permute(0, 2, 1, 3).reshape(g * GROUP_ROWS, nsb, 2)
    dmin = r[..., 2336:].reshape(g, nsb, GROUP_ROWS, 2).permute(0, 2, 1, 3).reshape(g * GROUP_ROWS, nsb, 2)
    return _q4k_blocks(q, sc, m, d, dmin)[:n].contiguous()


def q6_k_as_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K rows -> Q8_0 rows of their dequantized values (round to nearest), :data:`CONVERT_ROWS` rows at a time:
    for consumers that have no Q6_K form (the ONNX export's ``MatMulNBits``)."""
    k = blocks.shape[1] // 210 * 256
    return torch.cat([quantize_q8_0(dequantize_reference(blocks[r:r + CONVERT_ROWS], Q6_K, k))
                      for r in range(0, blocks.shape[0], CONVERT_ROWS)])


def kernel_layout(blocks: torch.Tensor, fmt: int) -> torch.Tensor:
    """Row layout ``uint8 [N, row_bytes(fmt, K)]`` -> kernel layout ``uint8 [ceil(N / 16), group_bytes(fmt, K)]``
    (rows past N are zero blocks). The inverse is :func:`row_layout`.

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
    if fmt in (Q6_K, Q4_K):
        return _superblock_kernel_layout(blocks, g, fmt).contiguous()
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
    """Kernel layout ``uint8 [ceil(N / 16), group_bytes(fmt, K)]`` -> row layout ``uint8 [N, row_bytes(fmt, K)]``
    (a copy)."""
    if fmt in (Q6_K, Q4_K):  # a few groups at a time, as kernel_layout
        convert = _q6k_row_layout if fmt == Q6_K else _q4k_row_layout
        g = qweight.shape[0]
        step = _groups_per_chunk(qweight.shape[1] // REGION_BYTES[fmt])
        if g <= step:
            return convert(qweight, n)
        return torch.cat([convert(qweight[g0:g0 + step], min(n, (g0 + step) * GROUP_ROWS) - g0 * GROUP_ROWS)
                          for g0 in range(0, g, step)])
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


def quantize_q6_k(w: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest Q6_K: ``w [N, K]`` (K a multiple of 256) -> GGUF Q6_K rows ``uint8 [N, K/256*210]``.

    Each 16-weight sub-block gets the scale ``max|w| / 31``; the super-block's ``d`` (fp16) is the largest of them
    over 127, each ``sc = round(scale / d)``, and ``q = round(w / (d * sc)) + 32`` clamped to 0..63. Simpler than
    llama.cpp's search (``make_qx_quants``), so its error can be larger; used for re-quantizing adapted matrices of a
    GGUF's Q6_K tensors (a merged delta).

    Raises:
        InvalidArgumentError: K not a multiple of 256."""
    if w.dim() != 2 or w.shape[1] % 256:
        raise InvalidArgumentError(f"Q6_K needs rows of a multiple of 256 weights, got shape {tuple(w.shape)}")
    n, k = w.shape
    b = w.detach().float().reshape(n, k // 256, 16, 16)
    scale = b.abs().amax(-1) / 31  # [n, nsb, 16]
    d = (scale.amax(-1, keepdim=True) / 127).to(torch.float16)  # [n, nsb, 1]
    df = d.float()
    sc = torch.where(df == 0, torch.zeros_like(scale), torch.round(scale / torch.where(df == 0, 1, df)))
    sc = sc.clamp(-128, 127)
    eff = (df * sc).unsqueeze(-1)  # [n, nsb, 16, 1]: the dequantizer's d * sc
    q = torch.where(eff == 0, torch.zeros_like(b), torch.round(b / torch.where(eff == 0, 1, eff))).clamp(-32, 31)
    q = (q + 32).to(torch.uint8).reshape(n, k // 256, 256)
    sc8 = sc.to(torch.int8).view(torch.uint8)
    return _q6k_blocks(q, sc8, d.view(torch.uint8).reshape(n, k // 256, 2))


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest Q4_K: ``w [N, K]`` (K a multiple of 256) -> GGUF Q4_K rows ``uint8 [N, K/256*144]``.

    Each 32-weight block gets the step ``(max - min) / 15`` and the offset ``-min`` (min capped at 0, as llama.cpp);
    the super-block's ``d`` and ``dmin`` (fp16) are the largest of them over 63, ``sc`` and ``m`` their rounded
    ratios, and ``q = round((w + dmin * m) / (d * sc))`` clamped to 0..15. Simpler than llama.cpp's search
    (``make_qkx2_quants``); used for re-quantizing adapted matrices of a GGUF's Q4_K tensors (a merged delta).

    Raises:
        InvalidArgumentError: K not a multiple of 256."""
    if w.dim() != 2 or w.shape[1] % 256:
        raise InvalidArgumentError(f"Q4_K needs rows of a multiple of 256 weights, got shape {tuple(w.shape)}")
    n, k = w.shape
    b = w.detach().float().reshape(n, k // 256, 8, 32)
    lo = b.amin(-1).clamp(max=0)
    step, off = (b.amax(-1) - lo) / 15, -lo  # [n, nsb, 8]

    def fp16_max(v):  # the super-block's fp16 scale of 6-bit ratios, and its float value (1 where 0)
        s = (v.amax(-1, keepdim=True) / 63).to(torch.float16)
        return s, torch.where(s.float() == 0, torch.ones_like(s.float()), s.float())

    d, df = fp16_max(step)
    dmin, dmf = fp16_max(off)
    sc = torch.round(step / df).clamp(0, 63)
    m = torch.round(off / dmf).clamp(0, 63)
    eff = (d.float() * sc).unsqueeze(-1)
    shift = (dmin.float() * m).unsqueeze(-1)
    q = torch.where(eff == 0, torch.zeros_like(b), torch.round((b + shift) / torch.where(eff == 0, 1, eff)))
    q = q.clamp(0, 15).to(torch.uint8).reshape(n, k // 256, 256)
    u8 = torch.uint8
    return _q4k_blocks(q, sc.to(u8), m.to(u8), d.view(u8).reshape(n, k // 256, 2), dmin.view(u8).reshape(n, k // 256, 2))


def q4_k_as_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K rows -> Q4_1 rows (row layout), one block per 32 weights with ``d * sc`` and ``-dmin * m`` rounded to fp16
    (relative scale error at most 2**-11): the default conversion of a GGUF's Q4_K tensors, and for consumers that
    have no Q4_K form (the ONNX export's ``MatMulNBits``). :data:`CONVERT_ROWS` rows at a time."""
    if blocks.shape[0] > CONVERT_ROWS:
        return torch.cat([q4_k_as_q4_1(blocks[r:r + CONVERT_ROWS]) for r in range(0, blocks.shape[0], CONVERT_ROWS)])
    q, sc, m, d, dmin = _q4k_values(blocks)
    n, nsb = q.shape[:2]
    dsc = (d.contiguous().view(torch.float16).float() * sc.float()).half()  # [n, nsb, 8]
    mn = (-(dmin.contiguous().view(torch.float16).float() * m.float())).half()
    v = q.reshape(n, nsb * 8, 32)
    nib = (v[..., :16] | (v[..., 16:] << 4)).reshape(n, nsb * 8 * 16)
    return torch.cat([nib, dsc.reshape(n, -1).view(torch.uint8), mn.reshape(n, -1).view(torch.uint8)], dim=1)


def dequantize_reference(blocks: torch.Tensor, fmt: int, k: int) -> torch.Tensor:
    """PyTorch dequantization of laserlm rows ``uint8 [N, row_bytes(fmt, K)]`` -> float32 ``[N, K]`` (the kernels'
    fallback and an independent check of them). Q6_K: ``(d * sc) * (q - 32)``, Q4_K: ``(d * sc) * q - dmin * m``, in
    float32 in gguf's order."""
    if fmt == Q6_K:
        q, sc, d = _q6k_values(blocks)
        dsc = d.contiguous().view(torch.float16).float() * sc.contiguous().view(torch.int8).float()  # [N, nsb, 16]
        return (dsc.repeat_interleave(16, dim=-1) * (q.float() - 32)).reshape(blocks.shape[0], k)
    if fmt == Q4_K:  # (d * sc) * q - dmin * m, gguf's order
        q, sc, m, d, dmin = _q4k_values(blocks)
        dsc = d.contiguous().view(torch.float16).float() * sc.float()  # [N, nsb, 8]
        dm = dmin.contiguous().view(torch.float16).float() * m.float()
        return (dsc.repeat_interleave(32, dim=-1) * q.float() - dm.repeat_interleave(32, dim=-1)).reshape(blocks.shape[0], k)
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
        blocks: ``uint8 [N, row_bytes(fmt, K)]`` blocks in the row layout (see the module docstring); stored in the
            kernel layout (``qweight``). :meth:`from_qweight` takes a matrix already in the kernel layout.
        fmt: ``Q4_1``, ``Q8_0``, ``Q6_K`` or ``Q4_K`` (GGML type id).
        in_features: K (a multiple of 32; of 256 for Q6_K and Q4_K).
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
        if (blocks.dtype != torch.uint8 or blocks.dim() != 2
                or blocks.shape[1] != in_features // BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt]):
            raise InvalidArgumentError(f"{FORMAT_NAMES[fmt]} blocks of shape {tuple(blocks.shape)} do not hold "
                                       f"rows of {in_features} weights")
        self._setup(kernel_layout(blocks, fmt), fmt, in_features, blocks.shape[0], bias)

    @classmethod
    def from_qweight(cls, qweight: torch.Tensor, fmt: int, in_features: int, out_features: int,
                     bias: torch.Tensor | None = None) -> "QuantLinear":
        """A layer over ``qweight`` (kernel layout ``uint8 [ceil(N / 16), group_bytes(fmt, K)]``), shared, not copied.

        Raises:
            InvalidArgumentError: a shape that does not match ``in_features`` / ``out_features``."""
        expect = (-(-out_features // GROUP_ROWS), in_features // BLOCK_WEIGHTS.get(fmt, QK) * REGION_BYTES.get(fmt, 0))
        if fmt not in BLOCK_BYTES or qweight.dtype != torch.uint8 or tuple(qweight.shape) != expect:
            raise InvalidArgumentError(f"a kernel-layout matrix of shape {tuple(qweight.shape)} does not hold "
                                       f"{out_features} rows of {in_features} weights in format {fmt}")
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod._setup(qweight.contiguous(), fmt, in_features, out_features, bias)
        return mod

    def _setup(self, qweight, fmt, in_features, out_features, bias):
        bw = BLOCK_WEIGHTS[fmt]
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0 or in_features % bw:
            raise InvalidArgumentError(f"{FORMAT_NAMES.get(fmt, fmt)} rows hold whole blocks of {bw} weights: "
                                       f"in_features must be a positive multiple of {bw}, got {in_features!r}")
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
    """Float ``[N, K]`` -> blocks of ``fmt`` (``Q4_1``, ``Q8_0``, ``Q6_K`` or ``Q4_K``)."""
    if fmt == Q4_1:
        return quantize_q4_1(w)
    if fmt == Q8_0:
        return quantize_q8_0(w)
    if fmt == Q6_K:
        return quantize_q6_k(w)
    if fmt == Q4_K:
        return quantize_q4_k(w)
    raise InvalidArgumentError(f"cannot quantize to {FORMAT_NAMES.get(fmt, fmt)}")


# -- GGUF tensors ----------------------------------------------------------------------------------
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


KQUANT_MODES = ("convert", "native")


def kquant_mode() -> str:
    """How ``--weights native`` takes a GGUF's Q4_K and Q6_K tensors: ``"convert"`` (Q4_K as Q4_1 with fp16 scales,
    Q6_K re-quantized to Q8_0; the default: the faster kernels on the CPUs measured) or ``"native"`` (both kept as
    they are: exact, fewer bytes), from the environment variable ``LASERLM_KQUANTS`` (empty or unset: ``"convert"``).

    Raises:
        InvalidArgumentError: any other value."""
    import os  # noqa: PLC0415

    mode = os.environ.get("LASERLM_KQUANTS", "").strip().lower() or "convert"
    if mode not in KQUANT_MODES:
        raise InvalidArgumentError(f"LASERLM_KQUANTS={os.environ['LASERLM_KQUANTS']!r}: expected one of "
                                   f"{', '.join(KQUANT_MODES)}")
    return mode


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

    if t in (T.Q4_K, T.Q6_K) and kquant_mode() == "native":  # GGUF's blocks are laserlm's row layout
        return "blocks", torch.from_numpy(np.array(rows, copy=True)), int(t), "exact"
    if t == T.Q4_K:
        blocks = by_rows(lambda c: q4_k_as_q4_1(torch.from_numpy(np.array(c, copy=True))))
        return "blocks", blocks, Q4_1, "Q4_K sub-blocks as Q4_1 (scales rounded to fp16)"
    if t in (T.Q4_0, T.Q4_1, T.Q8_0):
        blocks = by_rows(lambda c: to_soa(torch.from_numpy(np.array(c, copy=True)), int(t))[0])
        return "blocks", blocks, (Q4_1 if t == T.Q4_0 else int(t)), "exact" if t != T.Q4_0 else "exact (Q4_0 as Q4_1, m = -8 d)"
    if t == T.Q5_0:
        blocks = by_rows(lambda c: to_soa(torch.from_numpy(_q5_0_to_q8_0(np.ascontiguousarray(c), len(c), k)), Q8_0)[0])
        return "blocks", blocks, Q8_0, "exact (Q5_0 as Q8_0)"
    if t in (T.Q5_1, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.Q8_1):
        blocks = by_rows(lambda c: quantize_q8_0(torch.from_numpy(
            np.asarray(gguf_dequantize(c, t), dtype=np.float32).reshape(len(c), k))))
        return "blocks", blocks, Q8_0, f"{t.name} re-quantized to Q8_0"
    raise UnsupportedArchitectureError(
        f"GGUF tensor type {t.name} has no laserlm kernel; load it with --weights fp32 or --weights bf16 "
        f"(dequantized by transformers), or int8/int4 to re-quantize from the dequantized copy")
