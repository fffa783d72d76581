"""The block kernels' multi-row contract (``laserlm/models/kernels/qgemm.h``): on real tensors of both bundled models,
in every block format they hold, a row's result is bit-identical whatever else shares the call (T = 2..16 rows, and
batches of 17-32 rows); every kernel variant this CPU runs (avx512, avx2, scalar) computes the same bits; the kernel
layout round-trips; and a decode step of any number of sequences runs the kernel, never the prefill GEMM."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from laserlm.errors import InvalidArgumentError
import torch

from laserlm.models import kernels, quant

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = ("avx512", "avx2", "scalar")


def _ops():
    ops = kernels.ops()
    if ops is None:
        pytest.skip(f"no compiled kernels: {kernels.unavailable_reason()}")
    return ops


def _runnable(ops) -> list[str]:
    best = ops.best_isa()
    return list(VARIANTS[VARIANTS.index(best):])


@functools.lru_cache(maxsize=None)
def _tensors(model: str) -> dict:
    from gguf import GGUFReader

    from laserlm.models.registry import BUNDLED

    return {t.name: t for t in GGUFReader(str(BUNDLED[model].locate())).tensors}


def _tensor(model: str, name: str, rows: int):
    """Rows ``[0, rows)`` of a real GGUF tensor converted as ``--weights native`` converts it."""
    t = _tensors(model)[name]
    raw = np.asarray(t.data)[:rows]
    n, k = raw.shape[0], int(t.shape[0])
    kind, blocks, fmt, how = quant.from_gguf(raw, int(t.tensor_type), n, k)
    assert kind == "blocks"
    return blocks, fmt, n, k, t.tensor_type.name


# SmolLM2: Q4_1 layers, Q8_0 embedding (the tied LM head); Gemma3: Q5_0 (as Q8_0), Q4_K (as Q4_1), Q6_K (re-quantized
# to Q8_0) and Q8_0. Row counts that are not a multiple of 16 exercise the padded last group.
REAL = [("smollm2-135m", "blk.0.attn_q.weight", 576), ("smollm2-135m", "blk.3.ffn_down.weight", 576),
        ("smollm2-135m", "token_embd.weight", 1000),
        ("gemma3-270m", "blk.0.attn_q.weight", 500), ("gemma3-270m", "blk.0.ffn_down.weight", 640),
        ("gemma3-270m", "blk.0.attn_v.weight", 256), ("gemma3-270m", "blk.1.ffn_up.weight", 1000)]


@pytest.fixture(scope="module", params=REAL, ids=lambda p: f"{p[0]}:{p[1]}")
def real_matrix(request):
    model, name, rows = request.param
    return _tensor(model, name, rows)


def test_rows_are_independent_of_the_call_on_real_tensors(real_matrix):
    """For T in {2, 3, 4, 8, 16} and batches of 17-32 rows, each row of one call equals that row multiplied alone,
    bit for bit, in every kernel variant; and the variants agree with each other bit for bit."""
    ops = _ops()
    blocks, fmt, n, k, gguf_type = real_matrix
    qweight = quant.kernel_layout(blocks, fmt)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, k, generator=g) * torch.linspace(0.1, 4.0, k)  # uneven channel scales, like hidden states
    x[:, 7] *= 40.0  # an outlier channel
    per_variant = {}
    try:
        for isa in _runnable(ops):
            ops.set_isa(isa)
            alone = torch.cat([ops.qmatmul(x[i:i + 1], qweight, fmt, k, n) for i in range(32)])
            for t in (2, 3, 4, 8, 16, 17, 24, 32):
                for start in (0, 32 - t):
                    got = ops.qmatmul(x[start:start + t], qweight, fmt, k, n)
                    assert torch.equal(got, alone[start:start + t]), f"{gguf_type} {isa}: T={t} from row {start}"
            per_variant[isa] = alone
    finally:
        ops.set_isa(ops.best_isa())
    first = next(iter(per_variant.values()))
    for isa, y in per_variant.items():
        assert torch.equal(y, first), f"{gguf_type}: {isa} differs from {next(iter(per_variant))}"
    # and the result is the product it claims to be: within the int16 activation rounding of a float64 matmul
    w = quant.dequantize_reference(blocks, fmt, k).double()
    ref = x.double() @ w.T
    step = x.double().abs().reshape(32, k // 32, 32).amax(-1) / 32767 / 2  # [T, nb] half a rounding step
    bound = step @ w.abs().reshape(n, k // 32, 32).sum(-1).T + 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    assert bool(((first.double() - ref).abs() <= bound).all())


def test_kernel_layout_round_trips_and_dequantizes_exactly():
    """Row layout -> kernel layout -> row layout is the identity (N not a multiple of 16 included), and the kernel
    dequantizes any subset of rows to the reference dequantization of the row layout."""
    ops = _ops()
    g = torch.Generator().manual_seed(1)
    for fmt, make in ((quant.Q4_1, quant.quantize_q4_1), (quant.Q8_0, quant.quantize_q8_0)):
        for n in (1, 15, 16, 17, 50):
            blocks = make(torch.randn(n, 96, generator=g))
            qweight = quant.kernel_layout(blocks, fmt)
            assert qweight.shape == (-(-n // 16), 3 * 16 * quant.BLOCK_BYTES[fmt])
            assert torch.equal(quant.row_layout(qweight, fmt, n), blocks)
            ref = quant.dequantize_reference(blocks, fmt, 96)
            rows = torch.tensor([n - 1, 0, n // 2])
            assert torch.equal(ops.dequantize(qweight, fmt, 96, n, rows, False), ref[rows])
            assert torch.equal(quant.dequantize(qweight, fmt, 96, n), ref)


def test_variant_choice_is_checked():
    ops = _ops()
    with pytest.raises(RuntimeError, match="unknown kernel variant"):
        ops.set_isa("sse2")
    if ops.best_isa() != "avx512":
        with pytest.raises(RuntimeError, match="cannot run the avx512 kernels"):
            ops.set_isa("avx512")
    assert ops.kernel_isa() == ops.best_isa()


def test_a_decode_step_of_many_sequences_runs_the_kernel():
    """A QuantLinear input ``[B, T, K]`` with ``T <= KERNEL_MAX_ROWS`` (a decode or verification step of B sequences,
    B > 16 here) runs the block kernel, so each sequence's output is the one it gets alone; a prompt chunk of more
    positions takes the prefill GEMM (whose bfloat16 result differs)."""
    _ops()
    blocks = quant.quantize_q4_1(torch.randn(64, 128, generator=torch.Generator().manual_seed(2)))
    lin = quant.QuantLinear(blocks, quant.Q4_1, 128)
    lin.prefill_dtype = torch.bfloat16
    x = torch.randn(24, 1, 128, generator=torch.Generator().manual_seed(3))
    batched = lin(x)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(24)])
    assert torch.equal(batched, alone)
    chunk = lin(x.reshape(1, 24, 128))
    assert not torch.equal(chunk.reshape(24, 1, 64), alone)


def _tiny(family: str, head_dim: int):
    import transformers as tf

    torch.manual_seed(0)
    heads = 4
    common = dict(hidden_size=heads * head_dim if head_dim > 16 else 64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=heads, num_key_value_heads=2, vocab_size=96, max_position_embeddings=128,
                  head_dim=head_dim)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=5))
    elif family == "qwen2":  # q/k/v biases
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif family == "qwen3":  # q/k norms
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common))
    else:
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **common, sliding_window=4, query_pre_attn_scalar=head_dim,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]))
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms and biases
            if p.dim() == 1:
                p.normal_(0.5 if family != "gemma3" else 0.0, 0.3)
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_a_prompt_chunk_is_computed_as_decoding_token_by_token(family, weights, head_dim):
    """Tiny random models of every family, packed: a 20-position forward (a prompt chunk, past the sliding windows)
    gives at every position exactly the logits of decoding the same tokens one by one, and a batch of two sequences
    gives each one's logits alone. Head dim 64 runs the grouped attention of the layer kernel on AVX-512 CPUs, 16 the
    per-row one."""
    from laserlm.models.packing import pack_model
    from laserlm.runtime.engine import Engine

    _ops()
    model = _tiny(family, head_dim)
    pack_model(model, weights)
    eng = Engine(model, max_seq_len=64)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        eng.reset()
        chunk = eng.forward(ids, logits="all").logits[0]
        eng.reset()
        stepped = torch.cat([eng.forward(ids[:, i:i + 1]).logits[0] for i in range(ids.shape[1])])
        other = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(5))
        both = eng.forward(torch.cat([ids, other]), logits="all", cache=eng.new_cache(64, batch_size=2)).logits
    assert torch.equal(chunk, stepped)
    assert torch.equal(both[0], chunk)


def test_two_threads_split_the_attention_queries_without_changing_them():
    """With two threads, a decode step of one sequence splits a KV head's query heads across the threads (too few
    tasks otherwise); each query's result is the same as in the unsplit 20-position forward."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        test_a_prompt_chunk_is_computed_as_decoding_token_by_token("llama", "int4", 64)
    finally:
        torch.set_num_threads(n)


def test_unknown_kernel_variant_env_is_a_clear_error():
    """The compiled module reads LASERLM_KERNEL_ISA at import, where a C++ error aborts the process: the value is
    checked first (case and blanks forgiven)."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = "import laserlm.models.kernels as k; k.ops(); print(k.ops().kernel_isa())"
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "LASERLM_KERNEL_ISA": "bogus"})
    assert bad.returncode == 1 and "InvalidArgumentError" in bad.stderr and "avx512, avx2, scalar" in bad.stderr
    assert "terminate called" not in bad.stderr
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                        env={**os.environ, "LASERLM_KERNEL_ISA": " Scalar "})
    assert ok.returncode == 0 and ok.stdout.strip() == "scalar", ok.stderr


@pytest.mark.parametrize("k", [48, 33, 16, 0])
def test_quantlinear_rejects_widths_that_are_not_whole_blocks(k):
    """A width that is not a multiple of the block size is refused when the layer is built, not at its first call."""
    from laserlm.models.quant import Q4_1, QuantLinear  # noqa: PLC0415

    blocks = torch.zeros(16, max(k // 32, 0) * 20, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="multiple of 32"):
        QuantLinear(blocks, Q4_1, k)
