"""Quantized weights (``--weights int8|int4|native``): the block kernels against float64 references built
from ``gguf``'s own dequantization, the native GGUF path against transformers' converted float copy, the
compiled whole-layer kernel against the PyTorch ops, every family on tiny random configs, end-to-end
quality on the real model, the decoding modes on packed weights, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import laserlm
from laserlm.errors import InvalidArgumentError, UnsupportedArchitectureError
from laserlm.models import kernels, quant
from laserlm.models.packing import pack_model
from laserlm.runtime import packed_layers
from laserlm.runtime.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reader(model: str):
    from gguf import GGUFReader

    from laserlm.models.registry import BUNDLED

    return GGUFReader(str(BUNDLED[model].locate()))


def _act_rounding_bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Worst-case |y - y_exact| from rounding the activations to int8 per 32-block (d = max|x_b| / 127,
    error <= d / 2 per element): sum over blocks of ||w_row,b||_1 * d_b / 2, per (row of x, row of w)."""
    t, k = x.shape
    xb = np.abs(x.reshape(t, k // 32, 32)).max(-1) / 127 / 2          # [T, nb]
    wb = np.abs(w.reshape(w.shape[0], k // 32, 32)).sum(-1)            # [N, nb]
    return xb @ wb.T                                                   # [T, N]


def _check_matmul(raw_blocks: torch.Tensor, fmt: int, w64: np.ndarray, rows: int = 3):
    """qmatmul(x) vs float64 x @ w64.T within the activation-rounding bound (+ float32 summation slack)."""
    n, k = w64.shape
    qweight = quant.kernel_layout(raw_blocks, fmt)
    g = torch.Generator().manual_seed(0)
    for t in (1, rows, 7):
        x = torch.randn(t, k, generator=g)
        got = quant.matmul(x, qweight, fmt, k, n).double().numpy()
        ref = x.double().numpy() @ w64.T
        bound = _act_rounding_bound(w64, x.double().numpy()) + 1e-5 * (np.abs(x.double().numpy()) @ np.abs(w64).T) + 1e-6
        assert np.all(np.abs(got - ref) <= bound), f"{quant.FORMAT_NAMES[fmt]} T={t}: max excess {np.max(np.abs(got - ref) - bound)}"


def test_kernels_are_built():
    assert kernels.ops() is not None, kernels.unavailable_reason()


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight"])
def test_smollm2_tensors_match_gguf_dequantize(name):
    """Real SmolLM2 tensors (Q4_1 layers, Q8_0 embedding): dequantization is bit-exact with gguf's, and the
    matmul kernel is within the stated activation-rounding bound of a float64 matmul."""
    from gguf.quants import dequantize

    t = {t.name: t for t in _reader("smollm2-135m").tensors}[name]
    raw = np.asarray(t.data)[:2048]  # the embedding has 49152 rows: a slice is enough
    n, k = raw.shape[0], int(t.shape[0])
    kind, blocks, fmt, how = quant.from_gguf(raw, int(t.tensor_type), n, k)
    assert kind == "blocks" and how == "exact"
    ref = dequantize(raw, t.tensor_type).astype(np.float32).reshape(n, k)
    assert np.array_equal(quant.dequantize(quant.kernel_layout(blocks, fmt), fmt, k, n).numpy(), ref)
    assert np.array_equal(quant.dequantize_reference(blocks, fmt, k).numpy(), ref)
    _check_matmul(blocks, fmt, ref.astype(np.float64))


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "token_embd.weight"])
def test_bfloat16_prefill_matmul_of_real_tensors(name):
    """The bfloat16 prefill path on real SmolLM2 tensors (Q4_1, Q8_0): the kernel's bfloat16 dequantization is gguf's
    float32 values rounded to nearest even, and a 40-row product in prefill dtype bfloat16 is within bfloat16's
    rounding of a float64 matmul (operands 2**-9 relative each, so 2**-8 per product; float32 accumulation; the
    result rounded, 2**-9 relative) -- and is not the float32 path's result (the bfloat16 path was taken)."""
    from gguf.quants import dequantize

    t = {t.name: t for t in _reader("smollm2-135m").tensors}[name]
    raw = np.asarray(t.data)[:512]
    n, k = raw.shape[0], int(t.shape[0])
    _, blocks, fmt, _ = quant.from_gguf(raw, int(t.tensor_type), n, k)
    qweight = quant.kernel_layout(blocks, fmt)
    w = torch.from_numpy(dequantize(raw, t.tensor_type).astype(np.float32).reshape(n, k))
    assert torch.equal(quant.dequantize(qweight, fmt, k, n, dtype=torch.bfloat16), w.to(torch.bfloat16))
    x = torch.randn(quant.KERNEL_MAX_ROWS + 24, k, generator=torch.Generator().manual_seed(1))
    got = quant.matmul(x, qweight, fmt, k, n, torch.bfloat16).double()
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    bound = 1.01 * (2 ** -8 * mag + 2 ** -9 * (ref.abs() + 2 ** -8 * mag)) + 1e-6
    assert bool(((got - ref).abs() <= bound).all()), float(((got - ref).abs() - bound).max())
    assert not torch.equal(got.float(), quant.matmul(x, qweight, fmt, k, n))


def test_prefill_dtype_choice_and_errors(capsys):
    from laserlm.cli import main

    assert quant.resolve_prefill_dtype("float32") is torch.float32
    assert quant.resolve_prefill_dtype("bfloat16") is torch.bfloat16
    assert quant.resolve_prefill_dtype("auto") is torch.int16  # the kernels are built here (test_kernels_are_built)
    assert quant.resolve_prefill_dtype("int16") is torch.int16
    with pytest.raises(InvalidArgumentError, match="unknown prefill dtype 'fp8'"):
        laserlm.load("smollm2-135m", prefill_dtype="fp8")
    with pytest.raises(InvalidArgumentError, match="applies to quantized weights .* not to --weights fp32"):
        laserlm.load("smollm2-135m", weights="fp32", prefill_dtype="bfloat16")
    assert main(["generate", "-t", "1", "--weights", "fp32", "--prefill-dtype", "bfloat16", "hi"]) == 2
    assert "applies to quantized weights" in capsys.readouterr().err


@pytest.mark.parametrize("flags, amx_granted, expected", [
    ("flags : fpu avx2 fma", True, False),  # AVX2 only: oneDNN would emulate bfloat16
    ("flags : fpu avx2 avx512f avx512_bf16", False, True),  # AMD Zen 4
    ("flags : fpu avx512f avx512_bf16 amx_bf16 amx_tile", True, True),  # Xeon, AMX granted
    ("flags : fpu avx512f amx_bf16 amx_tile", False, False),  # AMX not granted by the VM, no AVX512-BF16
])
def test_hardware_bf16_gemm_reads_the_cpu_flags(monkeypatch, flags, amx_granted, expected):
    from laserlm.models import kernels

    monkeypatch.setattr(kernels, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(torch._C._cpu, "_init_amx", lambda: amx_granted)
    monkeypatch.setattr(quant.kernels, "ops", lambda: None)  # no compiler: auto falls back to a GEMM
    kernels.hardware_bf16_gemm.cache_clear()
    try:
        assert kernels.hardware_bf16_gemm() is expected
        assert quant.resolve_prefill_dtype("auto") is (torch.bfloat16 if expected else torch.float32)
    finally:
        kernels.hardware_bf16_gemm.cache_clear()


def test_q4_0_blocks_match_gguf():
    """Q4_0 is in neither bundled model: gguf quantizes a random matrix, laserlm multiplies it."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(0).standard_normal((96, 128)).astype(np.float32)
    raw = quantize(w, T.Q4_0)
    kind, blocks, fmt, _ = quant.from_gguf(raw, int(T.Q4_0), 96, 128)
    ref = dequantize(raw, T.Q4_0).astype(np.float32)
    assert fmt == quant.Q4_1
    assert np.array_equal(quant.dequantize(quant.kernel_layout(blocks, fmt), fmt, 128, 96).numpy(), ref)
    _check_matmul(blocks, fmt, ref.astype(np.float64))


def _random_q6_k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF Q6_K rows ``uint8 [n, k / 256 * 210]`` of random bytes (every 6-bit value and int8 scale occurs) with a
    finite positive fp16 ``d`` per super-block."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
    d = (rng.random((n, k // 256)) * 1e-3 + 1e-5).astype(np.float16)
    raw[..., 208:] = d.view(np.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1)


def test_q6_k_blocks_are_kept_and_match_gguf(monkeypatch):
    """With ``LASERLM_KQUANTS=native`` a GGUF Q6_K matrix is kept as Q6_K (no re-quantization): the PyTorch and compiled
    dequantizations are bit-exact with gguf's, the kernel layout round-trips, and the matmul is within the
    activation-rounding bound of a float64 matmul over gguf's values. By default it becomes Q8_0; a bad value is
    refused."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    n, k = 37, 512
    raw = _random_q6_k(n, k)
    monkeypatch.delenv("LASERLM_KQUANTS", raising=False)
    assert quant.from_gguf(raw, int(T.Q6_K), n, k)[2] == quant.Q8_0
    monkeypatch.setenv("LASERLM_KQUANTS", "bogus")
    with pytest.raises(InvalidArgumentError, match="LASERLM_KQUANTS='bogus'"):
        quant.from_gguf(raw, int(T.Q6_K), n, k)
    monkeypatch.setenv("LASERLM_KQUANTS", " Native ")
    kind, blocks, fmt, how = quant.from_gguf(raw, int(T.Q6_K), n, k)
    assert (kind, fmt, how) == ("blocks", quant.Q6_K, "exact") and blocks.shape == (n, quant.row_bytes(fmt, k))
    ref = np.asarray(dequantize(raw, T.Q6_K), dtype=np.float32).reshape(n, k)
    assert quant.group_bytes(fmt, k) == 16 * 2 * 210  # groups of 16 rows x 2 super-blocks x 210 bytes: Q6_K's bytes
    _check_kept_superblock_matrix(blocks, fmt, ref)


def _check_kept_superblock_matrix(blocks: torch.Tensor, fmt: int, ref: np.ndarray) -> torch.Tensor:
    """Rows of a kept Q6_K / Q4_K matrix (37 rows: 3 groups) against gguf's dequantized values ``ref``: the PyTorch
    and compiled dequantizations bit-exact, the kernel layout's shape and round trip, row gathers, the matmul within
    the activation-rounding bound, and a QuantLinear's bytes and blocks. Returns the kernel layout."""
    n, k = ref.shape
    assert np.array_equal(quant.dequantize_reference(blocks, fmt, k).numpy(), ref)
    qweight = quant.kernel_layout(blocks, fmt)
    assert qweight.shape == (3, quant.group_bytes(fmt, k))
    assert torch.equal(quant.row_layout(qweight, fmt, n), blocks)
    assert np.array_equal(quant.dequantize(qweight, fmt, k, n).numpy(), ref)
    rows = torch.tensor([36, 0, 17])
    assert np.array_equal(quant.dequantize(qweight, fmt, k, n, rows).numpy(), ref[rows.numpy()])
    _check_matmul(blocks, fmt, ref.astype(np.float64))
    lin = quant.QuantLinear(blocks, fmt, k)
    assert lin.nbytes == 3 * quant.group_bytes(fmt, k) and torch.equal(lin.blocks, blocks)
    return qweight


def _random_q4_k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF Q4_K rows ``uint8 [n, k / 256 * 144]`` of random bytes (every 6-bit scale and min occurs) with finite
    positive fp16 ``d`` and ``dmin``."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = (rng.random((n, k // 256, 2)) * 1e-3 + 1e-5).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def test_q4_k_blocks_are_kept_and_match_gguf(monkeypatch):
    """With ``LASERLM_KQUANTS=native`` a GGUF Q4_K matrix is kept as Q4_K: the PyTorch and compiled dequantizations
    are bit-exact with gguf's, the kernel layout round-trips, the matmul is within the activation-rounding bound of a
    float64 matmul over gguf's values. By default, and for the ONNX export, it becomes Q4_1 blocks within fp16
    rounding of the scales."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    n, k = 37, 512
    raw = _random_q4_k(n, k)
    ref = np.asarray(dequantize(raw, T.Q4_K), dtype=np.float32).reshape(n, k)
    monkeypatch.delenv("LASERLM_KQUANTS", raising=False)
    kind, blocks, fmt, how = quant.from_gguf(raw, int(T.Q4_K), n, k)
    assert fmt == quant.Q4_1 and "fp16" in how
    as_q4_1 = quant.dequantize_reference(blocks, quant.Q4_1, k).numpy()
    assert np.all(np.abs(as_q4_1 - ref) <= 2 ** -10 * (np.abs(ref) + np.abs(ref).max(-1, keepdims=True)))
    monkeypatch.setenv("LASERLM_KQUANTS", "native")
    kind, blocks, fmt, how = quant.from_gguf(raw, int(T.Q4_K), n, k)
    assert (kind, fmt, how) == ("blocks", quant.Q4_K, "exact") and blocks.shape == (n, 2 * 144)
    assert quant.group_bytes(fmt, k) == 2 * 2368
    qweight = _check_kept_superblock_matrix(blocks, fmt, ref)
    assert quant.QuantLinear.from_qweight(qweight, fmt, k, n).qweight.data_ptr() == qweight.data_ptr()
    assert np.array_equal(quant.dequantize_reference(quant.q4_k_as_q4_1(blocks), quant.Q4_1, k).numpy(), as_q4_1)


@pytest.mark.parametrize("fmt_name", ["Q6_K", "Q4_K"])
def test_superblock_layouts_round_trip_in_chunks(fmt_name):
    """A matrix larger than one conversion chunk (2,100 rows x 2,048: 132 groups, chunks of 128) goes to the kernel
    layout and back unchanged, and its ONNX-export conversions match the dequantized values."""
    n, k = 2100, 2048
    raw = torch.from_numpy((_random_q6_k if fmt_name == "Q6_K" else _random_q4_k)(n, k, seed=5))
    fmt = getattr(quant, fmt_name)
    qweight = quant.kernel_layout(raw, fmt)
    assert qweight.shape == (132, quant.group_bytes(fmt, k))
    assert torch.equal(quant.row_layout(qweight, fmt, n), raw)
    ref = quant.dequantize_reference(raw, fmt, k)
    if fmt == quant.Q6_K:
        conv, f2 = quant.q6_k_as_q8_0(raw), quant.Q8_0
        # half a step, plus 127 times the fp16 rounding of d (relative 2**-11, or 2**-25 absolute among subnormals)
        bound = ref.reshape(n, k // 32, 32).abs().amax(-1, keepdim=True) / 127 * (0.5 + 127 * 2 ** -11) + 127 * 2 ** -25
    else:
        conv, f2 = quant.q4_k_as_q4_1(raw), quant.Q4_1
        bound = 2 ** -10 * (ref.abs() + ref.abs().amax(-1, keepdim=True)).reshape(n, k // 32, 32)
    err = (quant.dequantize_reference(conv, f2, k) - ref).abs().reshape(n, k // 32, 32)
    assert bool((err <= bound + 1e-7).all())


@pytest.mark.parametrize("fmt_name", ["Q6_K", "Q4_K"])
def test_superblock_kernel_variants_agree_and_rows_are_independent(fmt_name, monkeypatch):
    """The avx512, avx2 and scalar Q6_K / Q4_K kernels give bit-identical results, and a row's result never depends
    on how many rows share the call (1 to 20: one pass, and passes over spans in L1)."""
    from gguf import GGMLQuantizationType as T

    ops = kernels.ops()
    n, k = 300, 1024
    make = _random_q6_k if fmt_name == "Q6_K" else _random_q4_k
    monkeypatch.setenv("LASERLM_KQUANTS", "native")
    _, blocks, fmt, _ = quant.from_gguf(make(n, k, seed=3), int(T[fmt_name]), n, k)
    qweight = quant.kernel_layout(blocks, fmt)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(0))
    best = ops.kernel_isa()
    outs = {}
    try:
        for isa in ("avx512", "avx2", "scalar"):
            if isa == "avx512" and ops.best_isa() != "avx512" or isa == "avx2" and ops.best_isa() == "scalar":
                continue
            ops.set_isa(isa)
            outs[isa] = full = ops.qmatmul(x, qweight, fmt, k, n)
            for t in (1, 2, 5, 6, 7, 16, 20):
                assert torch.equal(ops.qmatmul(x[:t], qweight, fmt, k, n), full[:t]), (isa, t)
    finally:
        ops.set_isa(best)
    first = next(iter(outs.values()))
    assert all(torch.equal(o, first) for o in outs.values()), list(outs)


def test_q6_k_quantizer_writes_blocks_gguf_reads():
    """laserlm's round-to-nearest Q6_K (used for adapted matrices of a GGUF's Q6_K tensors) writes GGUF's block
    format: gguf's dequantization of its bytes is laserlm's, within a 6-bit rounding of the float matrix."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    w = torch.from_numpy(np.random.default_rng(2).standard_normal((48, 512)).astype(np.float32))
    blocks = quant.quantize_matrix(w, quant.Q6_K)
    ours = quant.dequantize_reference(blocks, quant.Q6_K, 512)
    assert np.array_equal(np.asarray(dequantize(blocks.numpy(), T.Q6_K), dtype=np.float32).reshape(48, 512), ours.numpy())
    step = w.reshape(48, 2, 16, 16).abs().amax(-1, keepdim=True) / 31  # a sub-block's step before sc's rounding
    err = (ours - w).reshape(48, 2, 16, 16).abs()
    assert (err <= step * 0.6 + 1e-6).float().mean() > 0.999 and ((ours - w).norm() / w.norm()) < 0.03
    with pytest.raises(InvalidArgumentError, match="multiple of 256"):
        quant.quantize_q6_k(w[:, :320])
    with pytest.raises(InvalidArgumentError, match="multiple of 256"):
        quant.QuantLinear(blocks[:, :210], quant.Q6_K, 320)


def test_q4_k_quantizer_writes_blocks_gguf_reads():
    """laserlm's round-to-nearest Q4_K (for adapted matrices of a GGUF's Q4_K tensors) writes GGUF's block format:
    gguf's dequantization of its bytes is laserlm's, within a 4-bit rounding of the float matrix."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    w = torch.from_numpy(np.random.default_rng(4).standard_normal((48, 512)).astype(np.float32))
    blocks = quant.quantize_matrix(w, quant.Q4_K)
    ours = quant.dequantize_reference(blocks, quant.Q4_K, 512)
    assert np.array_equal(np.asarray(dequantize(blocks.numpy(), T.Q4_K), dtype=np.float32).reshape(48, 512), ours.numpy())
    b = w.reshape(48, 2, 8, 32)
    step = (b.amax(-1, keepdim=True) - b.amin(-1, keepdim=True).clamp(max=0)) / 15
    err = (ours - w).reshape(48, 2, 8, 32).abs()
    assert (err <= step * 0.6 + 1e-6).float().mean() > 0.99 and ((ours - w).norm() / w.norm()) < 0.12
    with pytest.raises(InvalidArgumentError, match="multiple of 256"):
        quant.quantize_q4_k(w[:, :320])


def test_int4_int8_quantizers_match_gguf_reference():
    """laserlm's round-to-nearest Q4_1 / Q8_0 quantizers produce gguf's blocks (its reference quantizer)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    w = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    for ours, qt in ((quant.quantize_q4_1, T.Q4_1), (quant.quantize_q8_0, T.Q8_0)):
        fmt = quant.Q4_1 if qt == T.Q4_1 else quant.Q8_0
        theirs = quant.to_soa(torch.from_numpy(quantize(w, qt).reshape(64, -1).copy()), fmt)[0]
        mine = ours(torch.from_numpy(w))
        # identical up to ties in rounding (a handful of weights exactly half-way): compare dequantized values
        a, b = quant.dequantize_reference(mine, fmt, 96), quant.dequantize_reference(theirs, fmt, 96)
        assert (a != b).float().mean() < 1e-3


@pytest.mark.slow
def test_gemma3_tensor_types_match_gguf_dequantize():
    """Gemma3-270M's Q5_0 (exact as Q8_0), Q4_K (as Q4_1, scales rounded to fp16), Q6_K (as Q8_0) and Q8_0 tensors."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    seen = set()
    for t in _reader("gemma3-270m").tensors:
        if t.tensor_type in seen or t.tensor_type in (T.F32, T.F16) or not t.name.startswith("blk."):
            continue
        seen.add(t.tensor_type)
        raw = np.asarray(t.data)
        n, k = raw.shape[0], int(t.shape[0])
        kind, blocks, fmt, how = quant.from_gguf(raw, int(t.tensor_type), n, k)
        ref = dequantize(raw, t.tensor_type).astype(np.float64).reshape(n, k)
        got = quant.dequantize(quant.kernel_layout(blocks, fmt), fmt, k, n).double().numpy()
        blockmax = np.abs(ref.reshape(n, k // 32, 32)).max(-1, keepdims=True)
        err = np.abs(got - ref).reshape(n, k // 32, 32)
        if t.tensor_type in (T.Q5_0, T.Q8_0):
            assert np.array_equal(got, ref), t.tensor_type.name
        elif t.tensor_type == T.Q4_K:  # d and m re-rounded to fp16: <= 2**-11 relative on d*q and on m
            assert np.all(err <= 2 ** -10 * (blockmax + np.abs(ref.reshape(n, k // 32, 32)).max(-1, keepdims=True)) + 1e-7)
        else:  # re-quantized to Q8_0: half a step d = max|w|/127, plus |q| <= 127 times d's fp16 rounding (2**-11 d)
            assert np.all(err <= blockmax / 127 * (0.5 + 127 * 2 ** -11) + 1e-7), t.tensor_type.name
        _check_matmul(blocks, fmt, got)
    assert {T.Q5_0, T.Q4_K, T.Q6_K, T.Q8_0} <= seen


# -- the native path on the real model -------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_native():
    return laserlm.load("smollm2-135m", weights="native")


def test_auto_weights_pick_native_for_gguf_and_fp32_when_dtype_given(smol, smol_native):
    assert smol.weights == "fp32" and smol_native.weights == "native"
    assert smol_native.loaded.pack_report.formats == {"Q4_1": 120, "Q8_0": 1}


def test_native_matrices_equal_the_converted_float_copy(smol, smol_native):
    """Every fused/native matrix dequantizes to exactly transformers' dequantized weights (checks the q/k
    row permutation of Llama GGUF files, the fusion order and the tied head)."""
    for ref_layer, layer in zip(smol.engine.adapter.layers, smol_native.engine.adapter.layers):
        pk, a, m = layer.laserlm_packed, ref_layer.self_attn, ref_layer.mlp
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        assert torch.equal(pk.qkv.weight, qkv)
        assert torch.equal(pk.o.weight, a.o_proj.weight)
        assert torch.equal(pk.gate_up.weight, torch.cat([m.gate_proj.weight, m.up_proj.weight]))
        assert torch.equal(pk.down.weight, m.down_proj.weight)
    assert torch.equal(smol_native.engine.adapter.lm_head.weight, smol.engine.adapter.lm_head.weight)
    ids = torch.tensor([[1, 500, 49151]])
    assert torch.equal(smol_native.engine.adapter.embed(ids), smol.engine.adapter.embed(ids))


def _logits(eng: Engine, ids: torch.Tensor, steps=()):
    eng.reset()
    out = [eng.forward(ids, logits="all").logits[0]]
    for s in steps:
        out.append(eng.forward(s, logits="all").logits[0])
    return torch.cat(out)


def test_compiled_layer_equals_the_pytorch_ops(smol_native):
    """The whole-layer C++ kernel (decode / verification sizes) against packed_layers' PyTorch ops on the
    same matrices: independent norms, rotary, KV writes and attention."""
    eng = smol_native.engine
    ids = torch.tensor([[1, 415, 3575, 282, 4649, 314]])
    steps = [torch.tensor([[28]]), torch.tensor([[253, 30, 1013]]), torch.tensor([[13]])]
    eng.native_layers = True
    a = _logits(eng, ids, steps)
    eng.native_layers = False
    try:
        b = _logits(eng, ids, steps)
    finally:
        eng.native_layers = True
    # both round the activations to int16 per 32-block, and slightly different float sums flip a rounding now
    # and then, so the paths agree to the size of one such flip, far closer than either is to fp32
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < 1e-2, rel
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_layer_stack_equals_one_call_per_layer(smol_native):
    """A run of layers in one ``LayerStack.run`` call computes exactly what one ``decode_layer`` call per layer
    computes (same kernels, same order), for a prompt, a 1-token step and a 3-token step."""
    eng = smol_native.engine
    ids = torch.tensor([[1, 415, 3575, 282, 4649, 314]])
    steps = [torch.tensor([[28]]), torch.tensor([[253, 30, 1013]])]
    assert eng._native_stack() is not None
    a = _logits(eng, ids, steps)
    saved, eng._stack = eng._stack, False  # no stack: the per-layer kernel path
    try:
        b = _logits(eng, ids, steps)
    finally:
        eng._stack = saved
    assert torch.equal(a, b)
    ops = kernels.ops()
    with pytest.raises(RuntimeError, match="not registered"):
        eng._stack.stack.run(torch.zeros(1, 1, 576), [10_000], [torch.zeros(1, 64)], [torch.zeros(1, 64)],
                             [torch.zeros(1, 3, 8, 64)], [torch.zeros(1, 3, 8, 64)], 0, [torch.empty(0)])
    assert isinstance(ops.LayerStack(), ops.LayerStack)


def test_layer_kernel_takes_a_projection_in_parts(smol_native):
    """The whole-layer kernel given q/k/v and gate/up as separate row blocks (what a fused projection of mixed formats
    passes) computes exactly what the fused matrices compute; row counts that do not add up are refused."""
    ops = kernels.ops()
    norms, eps, mats, fmts, rows, bias, h, hkv, hd, scaling, window, act, inter = \
        packed_layers._native_args(smol_native.engine.adapter.layers[0])
    assert len(mats) == 4
    qr, kvr = h * hd, hkv * hd
    parts = [mats[0][: qr // 16], mats[0][qr // 16: (qr + kvr) // 16], mats[0][(qr + kvr) // 16:], mats[1],
             mats[2][: inter // 16], mats[2][inter // 16:], mats[3]]
    pfmts = [fmts[0]] * 3 + [fmts[1]] + [fmts[2]] * 2 + [fmts[3]]
    prows = [qr, kvr, kvr, rows[1], inter, inter, rows[3]]
    g = torch.Generator().manual_seed(0)
    hidden, cos, sin = torch.randn(1, 3, 576, generator=g), torch.randn(3, hd, generator=g), torch.randn(3, hd, generator=g)

    def run(m, f, r):
        k, v = torch.zeros(1, hkv, 8, hd), torch.zeros(1, hkv, 8, hd)
        out = ops.decode_layer(hidden, norms, eps, [t.contiguous() for t in m], f, r, bias, cos, sin, k, v, 0, h, hkv,
                               hd, scaling, window, act, inter)
        return out, k, v

    whole, split, unnamed = run(mats, fmts, rows), run(parts, pfmts, prows), run(mats, fmts, [])
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(whole, split, unnamed))
    with pytest.raises(RuntimeError, match="exceed"):
        run(parts, pfmts, [qr, kvr, kvr + 16] + prows[3:])
    with pytest.raises(RuntimeError, match="one format and one row count per matrix part"):
        run(parts, pfmts, [])


def _layer_float64(hidden, norms, eps, mats, cos, sin, h, hkv, hd, scaling, inter):
    """A Llama decoder layer in float64 (``mats``: float ``[N, K]`` q, k, v, o, gate, up, down), causal from position 0,
    with the kernel's rotary convention (rotate-half on ``cos`` / ``sin`` ``[T, hd]``): the independent reference."""
    x = hidden.double()[0]  # [T, d]
    wq, wk, wv, wo, wg, wu, wd = (m.double() for m in mats)
    rms = lambda t, w: t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.double()  # noqa: E731
    T, half = x.shape[0], hd // 2
    c, sn = cos.double(), sin.double()

    def rope(t):  # [T, heads, hd]
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * c[:, None, :half] - b * sn[:, None, :half], b * c[:, None, half:] + a * sn[:, None, half:]], -1)

    xn = rms(x, norms[0])
    q, k, v = rope((xn @ wq.T).view(T, h, hd)), rope((xn @ wk.T).view(T, hkv, hd)), (xn @ wv.T).view(T, hkv, hd)
    k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    sc = torch.einsum("thd,shd->hts", q, k) * scaling
    sc = sc.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    att = torch.einsum("hts,shd->thd", sc.softmax(-1), v).reshape(T, h * hd)
    x = x + att @ wo.T
    xn = rms(x, norms[2])
    g = xn @ wg.T
    x = x + (g * torch.sigmoid(g) * (xn @ wu.T)) @ wd.T
    return x[None]


def test_layer_kernel_runs_k_quant_parts_against_float64():
    """The whole-layer kernel with the formats of a Q4_K_M file kept natively (``LASERLM_KQUANTS=native``): Q4_K
    q / k and gate / up, Q6_K v and down, Q8_0 o; q / k / v and gate / up each passed as parts of different formats.
    Widths are multiples of 256 (the bundled models' are not). Against the layer in float64 on the dequantized
    matrices, for a 5-token prompt, and its K / V against the float64 keys and values; the only difference allowed
    is the int16 rounding of the activations (relative 2**-15 per 32-block)."""
    ops = kernels.ops()
    d, h, hkv, hd, inter, T = 256, 4, 2, 64, 512, 5
    g = torch.Generator().manual_seed(3)
    shapes = {"q": (h * hd, d), "k": (hkv * hd, d), "v": (hkv * hd, d), "o": (d, h * hd), "gate": (inter, d),
              "up": (inter, d), "down": (d, inter)}
    fmts = {"q": quant.Q4_K, "k": quant.Q4_K, "v": quant.Q6_K, "o": quant.Q8_0, "gate": quant.Q4_K, "up": quant.Q4_K,
            "down": quant.Q6_K}
    blocks = {n: quant.quantize_matrix(torch.randn(*s, generator=g) * 0.06, fmts[n]) for n, s in shapes.items()}
    dense = {n: quant.dequantize_reference(b, fmts[n], shapes[n][1]) for n, b in blocks.items()}
    kern = {n: quant.kernel_layout(b, fmts[n]).contiguous() for n, b in blocks.items()}
    norms = [torch.rand(d, generator=g) + 0.5, torch.empty(0), torch.rand(d, generator=g) + 0.5, torch.empty(0),
             torch.empty(0), torch.empty(0)]
    hidden = torch.randn(1, T, d, generator=g)
    pos = torch.arange(T, dtype=torch.float64)[:, None] / (10000 ** (torch.arange(hd // 2, dtype=torch.float64) / (hd // 2)))
    cos, sin = torch.cat([pos.cos()] * 2, -1).float(), torch.cat([pos.sin()] * 2, -1).float()
    order = ["q", "k", "v", "o", "gate", "up", "down"]
    kc, vc = torch.zeros(1, hkv, 8, hd), torch.zeros(1, hkv, 8, hd)
    out = ops.decode_layer(hidden, norms, 1e-5, [kern[n] for n in order], [fmts[n] for n in order],
                           [shapes[n][0] for n in order], torch.empty(0), cos, sin, kc, vc, 0, h, hkv, hd, hd ** -0.5,
                           0, 0, inter)
    ref = _layer_float64(hidden, norms, 1e-5, [dense[n] for n in order], cos, sin, h, hkv, hd, hd ** -0.5, inter)
    rel = ((out.double() - ref).norm() / (ref - hidden.double()).norm()).item()  # of what the layer adds
    assert rel < 2e-4, rel
    xn = hidden.double()[0] / torch.sqrt(hidden.double()[0].pow(2).mean(-1, keepdim=True) + 1e-5) * norms[0].double()
    v_ref = (xn @ dense["v"].double().T).view(T, hkv, hd).transpose(0, 1)
    assert ((vc[0, :, :T].double() - v_ref).norm() / v_ref.norm()).item() < 2e-4
    assert bool((kc[0, :, T:] == 0).all() and (vc[0, :, T:] == 0).all())  # nothing written past the prompt


def test_fused_parts_of_one_format_are_stacked_and_counted_by_format():
    """Converted q / k / v parts in Q4_1, Q4_1, Q8_0 (a Q4_K_M file's layer) become two matrices, q+k and v, whose
    output equals each part's own product; the load report counts them by format, not as float."""
    from laserlm.models.packing import PackReport, _Concat, _fuse

    g = torch.Generator().manual_seed(0)
    w = [torch.randn(r, 64, generator=g) for r in (48, 16, 16)]
    parts = [("blocks", quant.quantize_q4_1(w[0]), quant.Q4_1), ("blocks", quant.quantize_q4_1(w[1]), quant.Q4_1),
             ("blocks", quant.quantize_q8_0(w[2]), quant.Q8_0)]
    fused = _fuse(parts, 64, None)
    assert isinstance(fused, _Concat) and [(p.fmt, p.out_features) for p in fused.parts] == [(quant.Q4_1, 64),
                                                                                            (quant.Q8_0, 16)]
    x = torch.randn(3, 64, generator=g)
    alone = torch.cat([quant.QuantLinear(d, f, 64)(x) for _, d, f in parts], dim=-1)
    assert torch.equal(fused(x), alone)
    report = PackReport("native")
    report.add(fused)
    assert report.formats == {"Q4_1": 1, "Q8_0": 1}


def test_mixed_format_projection_runs_the_layer_kernel(smol_native):
    """A fused q/k/v whose v has another block format (a Q4_K_M file's Q6_K v beside Q4_K q/k; here Q8_0 beside the
    file's Q4_1) still takes the compiled layer kernel, and its logits match the PyTorch ops on the same matrices."""
    from laserlm.models.packing import _Concat

    eng = smol_native.engine
    layer = eng.adapter.layers[0]
    pk = layer.laserlm_packed
    saved = pk.qkv
    qkv_w = saved.weight  # [(H + 2 Hkv) hd, d] dequantized
    split = pk.q_size + pk.kv_size
    qk = quant.QuantLinear.from_qweight(saved.qweight[: split // 16], saved.fmt, saved.in_features, split)
    v = quant.QuantLinear(quant.quantize_q8_0(qkv_w[split:]), quant.Q8_0, saved.in_features)
    ids = torch.tensor([[1, 415, 3575, 282, 4649, 314]])
    steps = [torch.tensor([[28]]), torch.tensor([[253, 30, 1013]])]
    try:
        object.__setattr__(pk, "qkv", _Concat([qk, v]))
        object.__setattr__(pk, "_native", None)
        eng._stack = None
        assert packed_layers._native_args(layer) is not None
        assert eng._native_stack().id_of(layer) is not None
        a = _logits(eng, ids, steps)
        eng.native_layers = False
        try:
            b = _logits(eng, ids, steps)
        finally:
            eng.native_layers = True
    finally:
        object.__setattr__(pk, "qkv", saved)
        object.__setattr__(pk, "_native", None)
        eng._stack = None
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < 1e-2, rel
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_stack_returns_the_attention_probabilities_adaptive_depth_wants(smol_native):
    """Adaptive depth's ATS layer wants its attention probabilities: the kernel writes them while the step stays one
    stack run. With the same input (layers 0-8 run by the kernel in both), they match the PyTorch attention's softmax
    of layer 9 (the per-layer path sends that layer to PyTorch) within 1e-6, in its shape [B, H, T, S], rows summing
    to 1, causal for a 3-token step; the all-PyTorch path agrees to activation rounding."""
    eng = smol_native.engine
    ids = torch.tensor([[1, 415, 3575, 282, 4649, 314]])

    def run(path: str, step):
        eng.reset()
        saved = eng._stack
        if path != "stack":
            eng._stack = False
        saved_native = eng.native_layers
        if path == "pytorch":
            eng.native_layers = False
        try:
            with torch.inference_mode():
                eng.forward(ids)
                h, st = eng.begin(step)
                st.ctx.want_probs = frozenset({9})
                out = eng.run_layers(0, eng.num_layers, h, st)
                eng.commit(st)
            return out, st.ctx.probs[9]
        finally:
            eng._stack, eng.native_layers = saved, saved_native

    assert eng._native_stack() is not None
    for step in (torch.tensor([[28]]), torch.tensor([[253, 30, 1013]])):
        (a, pa), (b, pb), (_, pt) = run("stack", step), run("per-layer", step), run("pytorch", step)
        t = step.shape[1]
        assert pa.shape == pb.shape == pt.shape == (1, 9, t, ids.shape[1] + t)
        assert torch.allclose(pa, pb, atol=1e-6, rtol=0)  # the kernel's exp is a polynomial, torch's is not
        assert torch.allclose(pa, pt, atol=1e-3, rtol=0)
        assert torch.allclose(pa.sum(-1), torch.ones(()), atol=1e-5)
        assert torch.equal(pa, torch.tril(pa, diagonal=ids.shape[1]))
        assert ((a - b).abs().max() / a.abs().max()).item() < 1e-3  # layer 9 in the kernel vs in PyTorch


def _windows(smol, n_windows=6, length=256):
    from laserlm.evaluation.data import read_wikitext, task_paths

    text = read_wikitext(task_paths("wikitext")[0])[:200_000]
    ids = torch.tensor(smol.tokenizer(text)["input_ids"])
    return [ids[i * length:(i + 1) * length] for i in range(n_windows)]


@pytest.mark.parametrize("prefill", ["float32", "bfloat16"])
def test_native_perplexity_and_agreement_vs_fp32(smol, prefill):
    """WikiText-2 test: perplexity within 1 % of the dequantized-fp32 reference, and teacher-forced greedy
    top-1 agreement >= 0.95, with the prefill matmuls (512-token windows) in float32 and in bfloat16."""
    smol_native = laserlm.load("smollm2-135m", weights="native", prefill_dtype=prefill)
    assert all(m.prefill_dtype is getattr(torch, prefill) for m in smol_native.engine.model.modules()
               if isinstance(m, quant.QuantLinear))
    nll_ref, nll_q, agree, n = 0.0, 0.0, 0, 0
    for w in _windows(smol):
        x = w.unsqueeze(0)
        with torch.inference_mode():
            ref = smol.engine.forward(x, logits="all", use_cache=False).logits[0, :-1]
            got = smol_native.engine.forward(x, logits="all", use_cache=False).logits[0, :-1]
        tgt = w[1:]
        nll_ref += torch.nn.functional.cross_entropy(ref, tgt, reduction="sum").item()
        nll_q += torch.nn.functional.cross_entropy(got, tgt, reduction="sum").item()
        agree += (ref.argmax(-1) == got.argmax(-1)).sum().item()
        n += tgt.numel()
    ppl_ref, ppl_q = np.exp(nll_ref / n), np.exp(nll_q / n)
    assert abs(ppl_q / ppl_ref - 1) < 0.01, (ppl_ref, ppl_q)
    assert agree / n >= 0.95, agree / n


def test_native_decode_agrees_with_fp32_token_by_token(smol, smol_native):
    """The decode path (compiled layer, T = 1) gives the same next-token argmax as fp32 on >= 95 % of
    teacher-forced positions."""
    w = _windows(smol, 1, 96)[0]
    eng_q, eng_f = smol_native.engine, smol.engine
    eng_q.reset(), eng_f.reset()
    eng_q.prefill(w[:8].unsqueeze(0)), eng_f.prefill(w[:8].unsqueeze(0))
    same = 0
    for tok in w[8:]:
        a = eng_q.decode_step(tok.view(1)).logits.argmax()
        b = eng_f.decode_step(tok.view(1)).logits.argmax()
        same += int(a == b)
    assert same / (len(w) - 8) >= 0.95


@pytest.mark.parametrize("mode", ["adaptive:groups=5,policy=confidence,threshold=0.5,bridge=propagate",
                                  "adaptive:groups=5,policy=confidence+ats,threshold=0.5,bridge=deferred",
                                  "adaptive:groups=5,policy=saturation,threshold=0.99,bridge=none",
                                  "static:layers=26", "early-exit:layer=24"])
def test_modes_run_on_native_weights(smol_native, mode):
    r = smol_native.generate("The history of Rome", mode=mode, max_new_tokens=8, ignore_eos=True)
    assert r.generated_tokens == 8 and r.text.strip()


def test_speculative_equals_full_greedy_on_native_weights(smol_native):
    full = smol_native.generate("The history of Rome", max_new_tokens=24, ignore_eos=True)
    spec = smol_native.generate("The history of Rome", mode="speculative:draft_layers=20,k=3,threshold=0.0",
                                max_new_tokens=24, ignore_eos=True)
    assert spec.token_ids == full.token_ids


def test_lookup_drafts_equal_full_greedy_on_native_weights(smol_native):
    """Verifies of up to 16 positions on the packed kernels (each row computed as alone) accept long copied drafts
    and still give exactly the full-depth greedy tokens."""
    passage = ("The old lighthouse stood on the rocks at the edge of the bay, and every night its keeper climbed the "
               "hundred steps to light the lamp.")
    prompt = f"Repeat this sentence exactly, twice:\n{passage}"
    full = smol_native.generate(prompt, chat=True, max_new_tokens=48, ignore_eos=True)
    spec = smol_native.generate(prompt, chat=True, mode="speculative:draft=ngram,k=15", max_new_tokens=48,
                                ignore_eos=True)
    assert spec.token_ids == full.token_ids
    stats = spec.stats()["speculative"]
    assert stats["accepted"] >= 10 and stats["emitted"] / stats["cycles"] > 1.5  # multi-row verifies did run


def test_sparse_attention_runs_on_native_weights(smol_native):
    from laserlm.attention import configure

    eng = smol_native.engine
    configure(eng, "sparse", threshold=0.5, block_size=16, dense_layers=2)
    try:
        r = smol_native.generate("word " * 80, max_new_tokens=4, ignore_eos=True)
    finally:
        configure(eng, "dense")
    assert r.generated_tokens == 4


# -- every family on tiny random configs -------------------------------------------------------------
def _tiny(family: str):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=5))
    elif family == "qwen2":  # q/k/v biases
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif family == "qwen3":  # q/k norms
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=16))
    else:
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]))
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms and biases
            if p.dim() == 1:
                p.normal_(0.5 if family != "gemma3" else 0.0, 0.3)
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_packed_families_match_the_dequantized_float_model(family, weights):
    """Pack a tiny random model, then give an unpacked copy exactly the packed weights (dequantized): the
    packed engine's logits (compiled layer for decode, BLAS for the prefill) equal the fp32 engine's up to
    the kernels' activation rounding."""
    import copy

    model = _tiny(family)
    ref = copy.deepcopy(model)
    pack_model(model, weights)
    with torch.no_grad():
        for lr, lp in zip(ref.model.layers, model.model.layers):
            for owner, names in ((lr.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                 (lr.mlp, ("gate_proj", "up_proj", "down_proj"))):
                for nm in names:
                    getattr(owner, nm).weight.copy_(getattr(lp.self_attn if owner is lr.self_attn else lp.mlp, nm).weight)
        ref.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())
        ref.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
    eng_p, eng_r = Engine(model, max_seq_len=64), Engine(ref, max_seq_len=64)
    assert len(eng_p._packed) == 3
    ids = torch.tensor([[3, 17, 42, 8, 90, 11, 5, 60, 33, 2]])
    steps = [torch.tensor([[7]]), torch.tensor([[1, 2, 3]]), torch.tensor([[44]])]
    a, b = _logits(eng_p, ids, steps), _logits(eng_r, ids, steps)
    rel = (a - b).norm() / b.norm()
    assert rel < 0.02, rel
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.85


def test_non_multiple_of_32_in_features_stay_float():
    """A matrix whose in-dimension no block format fits is kept in float (documented fallback)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    report = pack_model(model.eval(), "int4")
    assert report.formats["float32"] == 2  # the two down projections (80 inputs)
    eng = Engine(model, max_seq_len=32)
    out = eng.forward(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(out).all()


# -- errors -------------------------------------------------------------------------------------------
def test_weights_errors(tmp_path):
    from laserlm.models.loader import resolve_weights

    with pytest.raises(InvalidArgumentError, match="unknown weight format 'int3'"):
        laserlm.load("smollm2-135m", weights="int3")
    with pytest.raises(InvalidArgumentError, match="contradicts --dtype bfloat16"):
        resolve_weights("fp32", "bfloat16", True)
    with pytest.raises(InvalidArgumentError, match="not a GGUF file"):
        resolve_weights("native", None, False)
    assert resolve_weights("auto", None, True)[0] == "native"
    assert resolve_weights("auto", "float32", True)[0] == "fp32"
    assert resolve_weights("auto", None, False)[0] == "fp32"


def test_native_on_a_float_checkpoint_is_a_clear_error(tmp_path):
    model = _tiny("llama")
    model.save_pretrained(tmp_path)
    from laserlm.models.loader import load_model

    with pytest.raises(InvalidArgumentError, match="not a GGUF file; use --weights int4, int8, bf16 or fp32"):
        load_model(str(tmp_path), weights="native")


def test_unsupported_gguf_type_names_type_and_alternatives():
    from gguf import GGMLQuantizationType as T

    with pytest.raises(UnsupportedArchitectureError, match=r"IQ2_XXS has no laserlm kernel.*--weights fp32"):
        quant.from_gguf(np.zeros((4, 66), dtype=np.uint8), int(T.IQ2_XXS), 4, 256)


def test_cli_rejects_unknown_weights(capsys):
    from laserlm.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--weights", "int3", "hi"])
    assert exc.value.code == 2
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_laser_file_from_the_fp32_model_runs_on_native_weights(smol, smol_native, tmp_path):
    """A laser file made on the float model (identity check on embedding values) loads on the native
    model, whose exit heads then use the packed LM head; decoding with it runs and exits."""
    from laserlm.depth import ExitHead, LaserArtifact, save_laser_file

    heads = {15: ExitHead(smol.engine.adapter, "affine"), 20: ExitHead(smol.engine.adapter, "affine")}
    path = save_laser_file(tmp_path / "smol.laser", smol.engine,
                           LaserArtifact(heads=heads, thresholds={"threshold": 0.3}))
    r = smol_native.generate("The history of Rome", mode=f"adaptive:laser={path},groups=6,min_depth=10",
                             max_new_tokens=12, ignore_eos=True)
    assert r.generated_tokens == 12 and r.mean_layers_per_token < 30
    h = torch.randn(2, 576)
    ref = ExitHead(smol_native.engine.adapter, "affine")  # identity init: final norm + the packed head
    torch.testing.assert_close(ref(h), smol_native.engine.head(h), atol=1e-4, rtol=1e-4)


def test_packed_cache_rejects_damaged_data_and_other_formats(tmp_path):
    """The packed-weights cache is used only when its checksum and format match; otherwise it is rebuilt."""
    import copy

    base = _tiny("llama")
    cache = tmp_path / "packed.safetensors"
    first = copy.deepcopy(base)
    assert not pack_model(first, "int8", cache_path=cache).cached
    again = copy.deepcopy(base)
    assert pack_model(again, "int8", cache_path=cache).cached
    ref = first.model.layers[0].laserlm_packed.qkv.weight
    assert torch.equal(again.model.layers[0].laserlm_packed.qkv.weight, ref)
    data = bytearray(cache.read_bytes())  # flip bytes well inside the tensor data, header intact
    data[-200:-100] = bytes(100)
    cache.write_bytes(bytes(data))
    broken = copy.deepcopy(base)
    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        assert not pack_model(broken, "int8", cache_path=cache).cached
    assert torch.equal(broken.model.layers[0].laserlm_packed.qkv.weight, ref)
    other = copy.deepcopy(base)
    with pytest.warns(RuntimeWarning, match="holds 'int8' weights, not 'int4'"):
        report = pack_model(other, "int4", cache_path=cache)
    assert report.weights == "int4" and not report.cached
