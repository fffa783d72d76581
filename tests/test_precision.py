"""Reduced-precision safety (issue 16, seed 004 §5.3): a tiny model whose weights are scaled so that float16
overflows at one layer runs correctly under the float16 guard (float32 fallback for that layer) or is refused
naming the layer; raw float16 (plain transformers) on the same model gives NaN/inf; norms compute in float32; the
range monitor records what the layers output; the precision profile reports the overflowing layer."""

from __future__ import annotations

import copy

import pytest
import torch

from laserlm.errors import PrecisionError
from laserlm.runtime.engine import Engine
from laserlm.runtime.ranges import FP16_MAX, RangeMonitor, fp32_norms

from test_depth import tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HOT = 3  # the layer whose MLP output is scaled past float16's range


def hot_model():
    """A tiny Llama (float32) whose layer HOT writes values far above 65504 into the residual stream, with weights
    that still fit float16 (|w| < 100)."""
    m = tiny_llama(seed=4)
    mlp = m.model.layers[HOT].mlp
    with torch.no_grad():
        mlp.gate_proj.weight.mul_(30)
        mlp.up_proj.weight.mul_(1000)
        mlp.down_proj.weight.mul_(1000)
    assert max(float(p.detach().abs().max()) for p in m.parameters()) < 100
    return m


IDS = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))


def test_the_hot_model_overflows_in_plain_float16():
    m = hot_model()
    with torch.no_grad():
        h32 = m(IDS, output_hidden_states=True).hidden_states
        assert float(h32[HOT + 1].abs().max()) > 2 * FP16_MAX  # the float32 stream leaves float16's range
        logits16 = copy.deepcopy(m).half()(IDS).logits
    assert not bool(torch.isfinite(logits16).all())  # what float16 without the guard gives: garbage


def test_float16_guard_falls_back_to_float32_for_the_overflowing_layer():
    m = hot_model()
    ref = Engine(m, max_seq_len=64)
    eng = Engine(copy.deepcopy(m).half(), max_seq_len=64)
    assert eng.precision_guard is not None and eng.weights == "fp16"
    out16 = eng.forward(IDS, logits="all", use_cache=False).logits
    out32 = ref.forward(IDS, logits="all", use_cache=False).logits
    assert bool(torch.isfinite(out16).all())
    assert HOT in eng.precision_guard.fallback and min(eng.precision_guard.fallback) == HOT
    assert eng.precision_guard.events[0][0] == HOT
    assert float((out16 - out32).abs().max() / out32.abs().max()) < 2e-2
    assert torch.equal(out16.argmax(-1), out32.argmax(-1))
    # decoding through the KV cache (float16 cache, float32 layers) keeps the greedy tokens of float32
    toks = {}
    for name, e in (("16", eng), ("32", ref)):
        e.reset()
        t = int(e.prefill(IDS).logits[0, 0].argmax())
        seq = [t]
        for _ in range(8):
            t = int(e.decode_step(torch.tensor([t])).logits[0, 0].argmax())
            seq.append(t)
        toks[name] = seq
    assert toks["16"] == toks["32"]


def test_float16_guard_refuses_naming_the_layer():
    eng = Engine(hot_model().half(), max_seq_len=64)
    eng.precision_guard.mode = "refuse"
    with pytest.raises(PrecisionError, match=f"decoder layer {HOT} overflows float16"):
        eng.forward(IDS, use_cache=False)


def test_norms_multiply_their_weight_in_float32():
    m = tiny_llama(seed=5).half()
    norm = m.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    x = (torch.randn(2, 3, 64) * 300).half()
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    want = (norm.weight.float() * h).half()  # one rounding, at the output
    assert fp32_norms(m) == 2 * 8 + 1
    assert torch.equal(norm(x), want)


def test_range_monitor_records_each_layer_output():
    eng = Engine(tiny_llama(seed=6), max_seq_len=64)
    mon = RangeMonitor(eng)
    eng.forward(IDS, use_cache=False)
    mon.close()
    with torch.inference_mode():
        h, st = eng.begin(IDS, use_cache=False)
    for i in range(eng.num_layers):
        with torch.inference_mode():
            h = eng.run_layers(i, i + 1, h, st)
        assert mon.ranges[i].max_abs == pytest.approx(float(h.abs().max()), rel=1e-6)
        assert mon.ranges[i].nan == 0 and mon.ranges[i].inf == 0 and mon.ranges[i].calls == 1
    raw = Engine(hot_model().half(), max_seq_len=64)
    raw.precision_guard.mode = "off"
    mon = RangeMonitor(raw)
    raw.forward(IDS, use_cache=False)
    rows = mon.report()
    assert rows[HOT]["inf"] > 0 and all(r["inf"] == 0 and r["nan"] == 0 for r in rows[:HOT])


def test_precision_profile_names_the_overflowing_layer():
    from laserlm.profiling.precision import format_report, precision_profile

    eng = Engine(hot_model(), max_seq_len=64)
    rep = precision_profile(eng, IDS[0], top=3)
    raw = rep["float16"]["raw"]
    assert raw["first_nonfinite_layer"] == HOT and not raw["logits_finite"]
    assert raw["layers"][HOT]["inf"] > 0 and raw["layers"][0]["fraction_of_max"] < 1
    g = rep["float16"]["guarded"]
    assert g["fp32_layers"][0] == HOT and abs(g["ppl"] / rep["float32"]["ppl"] - 1) < 0.02
    b = rep["bfloat16"]["raw"]
    assert b["logits_finite"] and b["first_nonfinite_layer"] is None
    assert 0 < b["layers"][0]["rel_error"] < 0.05  # bfloat16 rounding: small but not zero
    assert len(b["most_sensitive_layers"]) == 3 and len(b["heads"]) == 8 * 4
    assert "layers falling back to float32: [3" in format_report(rep)


def test_precision_cli_errors(capsys):
    from helpers import run_cli

    assert "--dtypes takes" in run_cli(capsys, ["profile", "--precision", "--dtypes", "int8"])


def test_generate_monitor_ranges_json(smol, capsys):
    import json

    from laserlm.cli import main

    assert main(["generate", "--weights", "fp32", "--monitor-ranges", "--json", "-n", "3", "-t", "1", "Hello"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prefill_dtype"] is None  # float weights: no prefill dtype of their own
    assert len(out["ranges"]) == 30 and all(r["calls"] >= 3 and r["nan"] == 0 for r in out["ranges"])


def test_adaptive_propagate_under_the_float16_guard_matches_float32():
    """Exits after the overflowing layer hand a float32 hidden state to the propagate bridge and the exit head."""
    from laserlm.depth import ExitHead
    from laserlm.mode_table import make_mode

    m = hot_model()
    spec = "adaptive:groups=2,min_depth=4,threshold=0.0,patience=0,bridge=propagate"
    seqs = {}
    for name, e in (("32", Engine(m, max_seq_len=64)), ("16", Engine(copy.deepcopy(m).half(), max_seq_len=64))):
        mode = make_mode(spec, e)
        rs, cache = mode.new_state(e), e.new_cache()
        tok = int(mode.prefill_logits(e, rs, cache, IDS[0]).argmax())
        seq = []
        for _ in range(8):
            logits, info = mode.decode(e, rs, cache, tok)
            assert info["exit_layer"] == 4 and bool(torch.isfinite(logits).all())
            tok = int(logits.argmax())
            seq.append(tok)
        seqs[name] = seq
    assert seqs["16"] == seqs["32"]
    # a trained (affine) exit head in float16 adapts a float32 hidden state in float32
    e16 = Engine(copy.deepcopy(m).half(), max_seq_len=64)
    head = ExitHead(e16.adapter, "affine")
    with torch.no_grad():
        head.proj.weight.add_(torch.randn(64, 64).half() * 0.01)
    h = torch.randn(2, 64) * 1e5
    want = torch.nn.functional.linear(h, head.proj.weight.float(), head.proj.bias.float())
    assert torch.equal(head.adapt(h), want) and bool(torch.isfinite(head(h)).all())
