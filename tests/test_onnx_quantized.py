"""``laserlm export onnx --weights native|int4|int8``: the engine's Q4_1 / Q8_0 blocks as onnxruntime MatMulNBits.

References: a float32 PyTorch engine whose matrices are the blocks dequantized by
:func:`laserlm.models.quant.dequantize_reference` (tiny models), and for SmolLM2's own GGUF blocks the float32
engine whose weights transformers dequantized with ``gguf`` (an independent dequantization of the same file).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from laserlm.errors import InvalidArgumentError
from laserlm.export.onnx import export_onnx
from laserlm.export.quantize import nbits_arrays, quantize_graph
from laserlm.models import quant
from laserlm.models.packing import pack_model
from laserlm.runtime.engine import Engine

from test_depth import tiny_llama
from test_onnx_export import full_depth_pair, onnx_engine, rel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_LEN = 64


def dequantized_copy(packed_model, seed):
    """A float tiny Llama (same seed) whose projections and head hold ``packed_model``'s blocks, dequantized."""
    from laserlm.export.quantize import _blocks_of, _projections  # noqa: PLC0415

    ref = tiny_llama(seed=seed)
    with torch.no_grad():
        for (name, mod), (_, pmod) in zip(_projections(ref), _projections(packed_model)):
            blocks, fmt = _blocks_of(pmod)
            mod.weight.copy_(quant.dequantize_reference(blocks, fmt, mod.in_features))
    return ref


@pytest.fixture(scope="module", params=["int4", "int8"])
def tiny_packed_export(request, tmp_path_factory):
    """A tiny Llama packed with ``int4`` / ``int8``, exported with MatMulNBits at accuracy level 0 and 4."""
    fmt = request.param
    packed = tiny_llama(seed=3)
    pack_model(packed, fmt)
    eng_p = Engine(packed, max_seq_len=MAX_LEN)
    eng = Engine(tiny_llama(seed=3), max_seq_len=MAX_LEN)
    outs = {}
    for level in (0, 4):
        outs[level] = tmp_path_factory.mktemp(f"onnx_{fmt}_{level}")
        export_onnx(eng, outs[level], groups="2", progress=False, packed=eng_p, accuracy_level=level)
    return fmt, Engine(dequantized_copy(packed, 3), max_seq_len=MAX_LEN), outs


def test_nbits_arrays_dequantize_to_the_blocks():
    """MatMulNBits' semantics written out in numpy ((q - zero point) * scale per block, weight 2i in the low
    nibble; + the per-block offset C for Q4_1) against laserlm's reference dequantization."""
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.rand(48, 1)
    w[3, :32] = 0.5  # a constant block: d = 0, the value is m
    for fmt, quantize in ((quant.Q4_1, quant.quantize_q4_1), (quant.Q8_0, quant.quantize_q8_0)):
        blocks = quantize(w)
        want = quant.dequantize_reference(blocks, fmt, 96).double().numpy()
        a = nbits_arrays(blocks, fmt, 96)
        scales = a["scales"].reshape(48, 3, 1).astype(np.float64)
        if a["bits"] == 4:
            q = np.stack([a["B"] & 0x0F, a["B"] >> 4], axis=-1).reshape(48, 3, 32).astype(np.float64)
            got = (q - 8) * scales + a["C"].T.reshape(48, 3, 1)
        else:
            got = (a["B"].astype(np.float64) - 128) * scales
        np.testing.assert_allclose(got.reshape(48, 96), want, rtol=0, atol=1e-6)


def test_full_depth_equals_the_dequantized_engine_at_accuracy_level_0(tiny_packed_export):
    fmt, ref_eng, outs = tiny_packed_export
    dec = onnx_engine(outs[0], threads=1)
    ids = torch.tensor([5, 17, 99, 3, 42, 8, 77, 1, 64])
    ref, got, worst = full_depth_pair(ref_eng, dec, ids, 12)
    assert got == ref
    assert worst < 1e-4
    man = json.loads((outs[0] / "manifest.json").read_text())
    assert man["weights"] == "packed" and man["quantized"]["accuracy_level"] == 0
    want = {"int4": {"Q4_1": 8 * 7 + 1}, "int8": {"Q8_0": 8 * 7 + 1}}[fmt]  # 8 layers x 7 projections + head
    bridges = sum(1 for g in man["graphs"] if g.startswith("bridge_"))
    assert bridges >= 1
    got_counts = dict(man["quantized"]["matrices"])
    name = next(iter(want))
    assert got_counts[name] == want[name] + bridges * 2 * 2  # each bridge graph: k and v of its 2 layers
    assert man["quantized"]["float_matmuls"] == 0


def test_no_float_projection_is_left_in_the_graphs(tiny_packed_export):
    _, _, outs = tiny_packed_export
    for f in outs[4].glob("group_*.onnx"):
        g = onnx.load(str(f)).graph
        consts = {t.name for t in g.initializer}
        float_mm = [n.name for n in g.node if n.op_type == "MatMul" and n.input[1] in consts
                    and "_offset" not in n.name]
        assert not float_mm, f"{f.name}: {float_mm}"
        assert sum(n.op_type == "MatMulNBits" for n in g.node) == 2 * 7


def test_accuracy_level_4_is_close_to_the_dequantized_engine(tiny_packed_export):
    """int8 activations: each product within a few 1e-3; logits within 5 % and greedy tokens mostly equal."""
    _, ref_eng, outs = tiny_packed_export
    dec = onnx_engine(outs[4], threads=1)
    ids = torch.tensor([5, 17, 99, 3, 42, 8, 77, 1, 64])
    ref_eng.reset()
    ref = ref_eng.prefill(ids.unsqueeze(0)).logits[0, 0]
    got = dec.prefill(ids.unsqueeze(0)).logits[0, 0]
    assert 0 < rel(got, ref) < 5e-2


def test_bad_settings_are_refused(tmp_path):
    eng = Engine(tiny_llama(seed=3), max_seq_len=MAX_LEN)
    other = tiny_llama(seed=4)
    pack_model(other, "int4")
    with pytest.raises(InvalidArgumentError, match="not the exported one"):
        export_onnx(eng, tmp_path / "a", groups="2", progress=False, packed=Engine(other, max_seq_len=MAX_LEN))
    with pytest.raises(InvalidArgumentError, match="must be native, int4 or int8"):
        export_onnx(eng, tmp_path / "b", groups="2", progress=False, packed=eng)
    with pytest.raises(InvalidArgumentError, match="accuracy-level"):
        quantize_graph(tmp_path / "none.onnx", {}, {}, accuracy_level=3)


@pytest.fixture(scope="module")
def smol_native_export(smol, tmp_path_factory):
    """SmolLM2 exported with its own GGUF blocks, accuracy level 0 (max_len 128)."""
    import laserlm

    native = laserlm.load("smollm2-135m", weights="native", max_seq_len=128)
    out = tmp_path_factory.mktemp("onnx_smol_native")
    man = export_onnx(smol.engine, out, max_len=128, progress=False, tokenizer=smol.tokenizer,
                      packed=native.engine, accuracy_level=0)
    return out, man


def test_smollm2_native_blocks_equal_the_gguf_dequantized_engine(smol, smol_native_export):
    """SmolLM2's own Q4_1 / Q8_0 blocks in MatMulNBits (accuracy level 0) give the float32 engine's logits, whose
    weights transformers dequantized from the same GGUF file with ``gguf``; greedy tokens identical for 16 steps."""
    out, man = smol_native_export
    assert man["weights"] == "native" and man["quantized"]["matrices"]["Q4_1"] >= 210
    dec = onnx_engine(out, threads=1)
    ids = torch.tensor(smol.tokenizer("The capital of France is Paris. The capital of Germany is")["input_ids"])
    ref, got, worst = full_depth_pair(smol.engine, dec, ids, 16)
    assert got == ref
    assert worst < 1e-4


def test_bench_measures_the_export_alone_and_beside_the_engine(smol_native_export, tmp_path, capsys):
    from laserlm.cli import main

    out, _ = smol_native_export
    common = ["--tests", "pp,tg", "-p", "8", "-n", "3", "--reps", "1", "--warmup", "0", "--no-progress", "-t", "1"]
    js = tmp_path / "ort.json"
    assert main(["bench", "--backend", "onnxruntime", "--model", str(out), "--json", str(js), *common]) == 0
    rows = json.loads(js.read_text())["rows"]
    assert [r["config"] for r in rows] == ["full [onnxruntime native]"]
    assert rows[0]["tg_tokens_per_s"] > 0 and rows[0]["layers_per_token"] == 30
    js2 = tmp_path / "both.json"
    assert main(["bench", "--weights", "fp32", "--onnx", str(out), "--no-hf", "--no-llamacpp", "--json", str(js2),
                 *common]) == 0
    assert [r["config"] for r in json.loads(js2.read_text())["rows"]] == ["full", "full [onnxruntime native]"]
    capsys.readouterr()
    assert main(["bench", "--backend", "onnxruntime", "--model", str(out), "--weights", "int4", *common]) == 2
    assert "--backend onnxruntime" in capsys.readouterr().err
