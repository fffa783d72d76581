"""ONNX export per layer group and the onnxruntime engine: full depth equals the PyTorch engine (tiny Llama, tiny
Gemma3 with sliding-window layers, and the real SmolLM2), the same AdaptiveDepth mode driven over the onnxruntime
engine's primitives makes the same exit decisions and tokens as over the PyTorch engine with the same laser file,
the one decode loop and ``laserlm.load(export_dir)`` generate on it, declared shapes are enforced, bad export
directories and unsupported settings are clear errors, and the TensorRT profile matches the graphs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from laserlm.depth import ExitGate, ExitHead, LaserArtifact, make_adaptive, save_laser_file
from laserlm.errors import ContextLengthError, CorruptModelError, InvalidArgumentError, ModelNotFoundError
from laserlm.export.onnx import export_onnx
from laserlm.export.tensorrt import batch_bounds, write_profile
from laserlm.mode_table import config_kernel, make_mode
from laserlm.runtime.engine import Engine
from laserlm.runtime.ort_engine import OnnxEngine, OnnxModel, read_manifest

from test_depth import tiny_gemma3, tiny_llama

onnxruntime = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_LEN = 64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def onnx_engine(out, threads=None) -> OnnxEngine:
    return OnnxEngine(OnnxModel(out, threads=threads))


def full_depth_pair(engine, onnx, ids, steps):
    """Greedy decoding of ``steps`` tokens on the PyTorch engine and on the onnxruntime engine (the same
    ``prefill`` / ``decode_step`` calls over each one's primitives), each fed its own tokens; returns the token lists
    and the largest relative logit difference."""
    worst = 0.0
    engine.reset()
    onnx.reset()
    ref = engine.prefill(ids.unsqueeze(0)).logits[0, 0]
    got = onnx.prefill(ids.unsqueeze(0)).logits[0, 0]
    worst = max(worst, rel(got, ref))
    ref_tokens, got_tokens = [int(ref.argmax())], [int(got.argmax())]
    for _ in range(steps - 1):
        ref = engine.decode_step(torch.tensor([ref_tokens[-1]])).logits[0, 0]
        out = onnx.decode_step(torch.tensor([got_tokens[-1]]))
        got = out.logits[0, 0]
        assert out.stats.layers_run == [engine.num_layers]
        worst = max(worst, rel(got, ref))
        ref_tokens.append(int(ref.argmax()))
        got_tokens.append(int(got.argmax()))
    return ref_tokens, got_tokens, worst


@pytest.fixture(scope="module")
def tiny_llama_export(tmp_path_factory):
    eng = Engine(tiny_llama(), max_seq_len=MAX_LEN)
    out = tmp_path_factory.mktemp("onnx_llama")
    export_onnx(eng, out, groups="2", max_batch=2, progress=False)
    return eng, out


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_full_depth_equals_the_engine_on_tiny_models(family, tiny_llama_export, tmp_path):
    if family == "llama":
        eng, out = tiny_llama_export
    else:  # sliding window 4 < the 40 positions decoded: the window mask is exercised
        eng = Engine(tiny_gemma3(), max_seq_len=MAX_LEN)
        out = tmp_path / "g"
        export_onnx(eng, out, groups="2/4/6", progress=False)
        assert eng.config.sliding_window < 40
    ids = torch.randint(0, eng.config.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    ref, got, worst = full_depth_pair(eng, onnx_engine(out, threads=1), ids, 32)
    assert got == ref
    assert worst < 1e-4


def test_manifest_describes_graphs(tiny_llama_export):
    eng, out = tiny_llama_export
    man = read_manifest(out)
    assert man["opset"] == 13 and man["dtype"] == "float32"
    assert [(g["start"], g["stop"]) for g in man["groups"]] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert man["shapes"]["batch"] == [1, 2] and man["shapes"]["max_len"] == MAX_LEN
    g1 = man["graphs"]["group_1"]
    assert [s["name"] for s in g1["inputs"]] == ["hidden", "positions", "past_k_2", "past_v_2", "past_k_3",
                                                "past_v_3"]
    assert g1["inputs"][2]["shape"] == ["batch", 2, "past", 16]
    assert [s["name"] for s in g1["outputs"]] == ["hidden_out", "new_k_2", "new_v_2", "new_k_3", "new_v_3"]
    # the ONNX files declare the same names and symbolic axes
    sess = onnxruntime.InferenceSession(str(out / "group_1.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == [s["name"] for s in g1["inputs"]]
    assert sess.get_inputs()[2].shape == ["batch", 2, "past", 16]


def test_batch_of_two_rows_matches_the_engine(tiny_llama_export):
    """The batch axis is dynamic: two different prompts in one call give each row's own engine logits."""
    eng, out = tiny_llama_export
    onnx = onnx_engine(out)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    got = onnx.forward(ids, logits="all", use_cache=False).logits
    ref = eng.forward(ids, logits="all", use_cache=False).logits
    assert rel(got, ref) < 1e-4
    # and in a two-row cache, prompt then one step
    cache = onnx.new_cache(batch_size=2)
    onnx.prefill(ids[:, :4], cache=cache)
    got = onnx.decode_step(ids[:, 4], cache=cache).logits
    assert rel(got, ref[:, 4:5]) < 1e-4


# -- adaptive depth ---------------------------------------------------------------------------------
def tiny_laser_file(eng, path):
    """A laser file for a tiny Llama of :func:`tiny_llama` (8 layers, d=64): perturbed affine exit heads and random
    gates at exit points 2, 4, 6 (gate threshold 0.5, patience 3), so that some tokens exit and some do not."""
    torch.manual_seed(0)
    heads, gates = {}, {}
    for e in (2, 4, 6):
        heads[e] = ExitHead(eng.adapter, "affine")
        gates[e] = ExitGate(64)
        with torch.no_grad():
            heads[e].proj.weight.add_(torch.randn(64, 64) * 0.05)
            gates[e].linear.weight.normal_(0, 0.5)
            gates[e].linear.bias.zero_()
    return save_laser_file(path, eng, LaserArtifact(
        heads=heads, gates=gates, thresholds={"gate_threshold": 0.5},
        config={"groups": "2", "min_depth": 2, "policy": "gate", "patience": 3}))


@pytest.fixture(scope="module")
def tiny_laser_export(tmp_path_factory):
    """A tiny Llama exported with the laser file of :func:`tiny_laser_file`."""
    eng = Engine(tiny_llama(seed=1), max_seq_len=MAX_LEN)
    d = tmp_path_factory.mktemp("laser")
    path = tiny_laser_file(eng, d / "tiny.laser")
    out = d / "onnx"
    man = export_onnx(eng, out, laser=path, progress=False)
    assert [e["adapter"] for e in man["exits"]] == ["exit_2", "exit_4", "exit_6"]
    return eng, path, out


@pytest.mark.parametrize("spec", ["", ",patience=0"])
def test_adaptive_depth_same_exits_and_tokens_as_the_engine(tiny_laser_export, spec):
    eng, path, out = tiny_laser_export
    mode = make_adaptive(eng, laser=str(path), **({"patience": 0} if spec else {}))
    onnx = onnx_engine(out)
    omode = make_mode(f"adaptive:laser={path}{spec}", onnx)
    assert type(omode) is type(mode)  # the one AdaptiveDepth, driven over the other engine's primitives
    ids = torch.randint(0, 128, (6,), generator=torch.Generator().manual_seed(2))
    rs, cache = mode.new_state(eng), eng.new_cache()
    ref = mode.prefill_logits(eng, rs, cache, ids)
    ors, ocache = omode.new_state(onnx), onnx.new_cache()
    got = omode.prefill_logits(onnx, ors, ocache, ids)
    assert rel(got, ref) < 1e-4
    ref_tok = got_tok = int(ref.argmax())
    ref_exits, got_exits, ref_toks, got_toks = [], [], [], []
    for _ in range(40):
        ref, info = mode.decode(eng, rs, cache, ref_tok)
        got, ginfo = omode.decode(onnx, ors, ocache, got_tok)
        ref_exits.append(info["exit_layer"])
        got_exits.append(ginfo["exit_layer"])
        ref_tok, got_tok = int(ref.argmax()), int(got.argmax())
        ref_toks.append(ref_tok)
        got_toks.append(got_tok)
        assert rel(got, ref) < 1e-4
        assert ginfo["bridge_layers"] == eng.num_layers - ginfo["exit_layer"]
    assert got_exits == ref_exits
    assert got_toks == ref_toks
    assert len(set(ref_exits)) > 1 and min(ref_exits) < eng.num_layers  # some tokens exit, not all at one layer


def test_adaptive_threshold_override_changes_decisions_like_the_engine(tiny_laser_export):
    eng, path, out = tiny_laser_export
    onnx = onnx_engine(out)
    mode = make_mode(f"adaptive:laser={path},gate_threshold=1.0", onnx)
    assert mode.policy.threshold == 1.0
    rs, cache = mode.new_state(onnx), onnx.new_cache()
    tok = int(mode.prefill_logits(onnx, rs, cache, torch.tensor([1, 2, 3])).argmax())
    for _ in range(5):
        logits, info = mode.decode(onnx, rs, cache, tok)
        assert info["exit_layer"] == eng.num_layers  # a gate probability never exceeds 1
        tok = int(logits.argmax())


def test_adaptive_on_an_export_without_a_laser_file_equals_the_engine(tiny_llama_export):
    """Exits without a trained head (no adapter graph) use the model's head on both engines: same exits, same
    tokens (a confidence threshold below a tiny random model's top probabilities, so tokens exit)."""
    eng, out = tiny_llama_export
    spec = "adaptive:groups=2,min_depth=2,threshold=0.001,patience=0"
    onnx = onnx_engine(out)
    mode, omode = make_mode(spec, eng), make_mode(spec, onnx)
    ids = torch.randint(0, 128, (5,), generator=torch.Generator().manual_seed(5))
    rs, cache = mode.new_state(eng), eng.new_cache()
    ors, ocache = omode.new_state(onnx), onnx.new_cache()
    ref_tok = got_tok = int(mode.prefill_logits(eng, rs, cache, ids).argmax())
    assert int(omode.prefill_logits(onnx, ors, ocache, ids).argmax()) == ref_tok
    exits = []
    for _ in range(12):
        ref, info = mode.decode(eng, rs, cache, ref_tok)
        got, ginfo = omode.decode(onnx, ors, ocache, got_tok)
        assert ginfo["exit_layer"] == info["exit_layer"] and rel(got, ref) < 1e-4
        exits.append(info["exit_layer"])
        ref_tok, got_tok = int(ref.argmax()), int(got.argmax())
    assert min(exits) < eng.num_layers


def test_bare_adaptive_on_an_export_without_a_laser_file_is_refused(tiny_llama_export):
    """Bare ``adaptive`` means certified exits (the export's laser file), as on laserlm's engine: an export without
    one refuses it instead of running untrained exits; a named exit rule runs."""
    from laserlm.api import LaserLM

    _, out = tiny_llama_export
    lm = LaserLM.on_engine(onnx_engine(out), None, [])
    for spec in ("adaptive", "adaptive:patience=0", "adaptive@dense"):
        with pytest.raises(InvalidArgumentError, match="exported without one"):
            lm.mode(spec)
    assert lm.mode("adaptive:threshold=0.99,patience=0").name == "adaptive"


def test_an_export_is_refused_where_laserlm_s_engine_is_needed(tiny_llama_export, tmp_path, capsys):
    from helpers import run_cli

    _, out = tiny_llama_export
    assert "run it with --backend onnxruntime" in run_cli(capsys, ["generate", "--model", str(out), "hi"])
    assert "needs laserlm's own engine" in run_cli(capsys, ["profile", "--model", str(out)])
    with pytest.raises(InvalidArgumentError, match="dense attention only"):
        config_kernel(onnx_engine(out), "full@sparse")
    with pytest.raises(InvalidArgumentError, match="laser file not found"):
        make_mode(f"adaptive:laser={tmp_path / 'no.laser'}", onnx_engine(out))


@pytest.mark.parametrize("spec, match", [
    ("adaptive:bridge=deferred", "propagate bridge only"),
    ("adaptive:policy=confidence+ats", "attention transition"),
    ("speculative:draft_layers=4", "modes 'full' and 'adaptive'"),
    ("adaptive:groups=4", "differ from the exported layer groups"),
    ("routed:laser=x.st", "modes 'full' and 'adaptive'"),
    ("static:skip=2-3", "modes 'full' and 'adaptive'"),
])
def test_unsupported_settings_are_refused(tiny_laser_export, spec, match):
    _, _, out = tiny_laser_export
    with pytest.raises(InvalidArgumentError, match=match):
        make_mode(spec, onnx_engine(out))


def test_another_laser_file_is_refused(tiny_laser_export, tmp_path):
    eng, path, out = tiny_laser_export
    other = save_laser_file(tmp_path / "other.laser", eng, LaserArtifact(config={"groups": "2"}))
    with pytest.raises(InvalidArgumentError, match="not the one exported"):
        make_mode(f"adaptive:laser={other}", onnx_engine(out))


# -- declared shapes and bad directories ------------------------------------------------------------
def test_inputs_outside_the_declared_shapes_are_clear_errors(tiny_llama_export):
    import numpy as np

    eng, out = tiny_llama_export
    onnx = onnx_engine(out)
    with pytest.raises(ContextLengthError, match="exceed the cache's 64 positions"):
        onnx.prefill(torch.zeros(1, MAX_LEN + 1, dtype=torch.long))
    with pytest.raises(ContextLengthError, match="exceed the exported max length 64"):
        onnx.new_cache(MAX_LEN + 1)
    onnx.prefill(torch.zeros(1, MAX_LEN - 1, dtype=torch.long))
    onnx.decode_step(torch.tensor([1]))  # position 63: the last one
    with pytest.raises(ContextLengthError, match="exceed the cache's 64 positions"):
        onnx.decode_step(torch.tensor([1]))
    # the graphs' own checks, under the engine's
    with pytest.raises(ContextLengthError, match="past 64 \\+ new tokens 1 exceed"):
        onnx.onnx.run("group_0", {"hidden": np.zeros((1, 1, 64), dtype=np.float32), "positions": np.full((1, 1), 63),
                                  **{f"past_{kv}_{j}": np.zeros((1, 2, 64, 16), dtype=np.float32)
                                     for j in (0, 1) for kv in "kv"}})
    with pytest.raises(InvalidArgumentError, match="batch 3 is outside the exported range 1-2"):
        onnx.onnx.run("embed", {"input_ids": np.zeros((3, 1), dtype=np.int64)})
    with pytest.raises(InvalidArgumentError, match="must be int64"):
        onnx.onnx.run("embed", {"input_ids": np.zeros((1, 1), dtype=np.int32)})


def test_missing_or_corrupt_export_directory(tiny_llama_export, tmp_path):
    _, out = tiny_llama_export
    with pytest.raises(ModelNotFoundError, match="not found"):
        OnnxModel(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorruptModelError, match="no manifest.json"):
        OnnxModel(tmp_path / "empty")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptModelError, match="cannot read the manifest"):
        OnnxModel(bad)
    man = json.loads((out / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps(man))
    (bad / "group_2.onnx").unlink()
    with pytest.raises(CorruptModelError, match="group_2"):
        OnnxModel(bad)
    (bad / "group_2.onnx").write_bytes(b"garbage")
    m = OnnxModel(bad)
    with pytest.raises(CorruptModelError, match="onnxruntime cannot load it"):
        m.session("group_2")
    for edit, match in ((lambda d: d.update(model={}), "no integer 'num_layers'"),
                        (lambda d: d.update(groups="x"), "'groups' entry is a str, not a list"),
                        (lambda d: d["shapes"].update(max_len="big"), "integer 'max_len'"),
                        (lambda d: d.update(exits=[{"layer": "2"}]), "integer 'layer'"),
                        (lambda d: d.pop("min_depth"), "'min_depth' is not an integer")):
        broken = json.loads(json.dumps(man))
        edit(broken)
        (bad / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(CorruptModelError, match=match):
            OnnxModel(bad)


def test_cli_errors_are_one_line(tiny_llama_export, tmp_path, capsys):
    from helpers import run_cli

    _, out = tiny_llama_export
    line = run_cli(capsys, ["generate", "--backend", "onnxruntime", "--model", str(tmp_path / "x"), "hi"])
    assert "ONNX export directory not found" in line
    line = run_cli(capsys, ["generate", "--backend", "onnxruntime", "--model", str(out), "hi"])
    assert "no tokenizer" in line  # tiny random models have none
    line = run_cli(capsys, ["generate", "--backend", "onnxruntime", "--weights", "int4", "--model", str(out), "hi"])
    assert "drop --weights" in line
    line = run_cli(capsys, ["export", "onnx", "--out", str(tmp_path / "o"), "--laser", str(tmp_path / "no.laser")])
    assert "laser file not found" in line
    assert "give a format" in run_cli(capsys, ["export"])


# -- TensorRT profile -------------------------------------------------------------------------------
def test_tensorrt_profile_matches_the_graphs(tiny_llama_export, tmp_path):
    assert batch_bounds(5) == (1, 5, 6) and batch_bounds(10) == (1, 10, 12) and batch_bounds(1) == (1, 1, 2)
    _, out = tiny_llama_export
    d = tmp_path / "t"
    shutil.copytree(out, d)
    prof = write_profile(d, peak_concurrency=2)
    assert prof["built"] is False and prof["batch"] == [1, 2, 3]
    g = prof["graphs"]["group_0"]
    assert g["shapes"]["past_k_0"] == {"min": [1, 2, 0, 16], "opt": [2, 2, 32, 16], "max": [3, 2, 63, 16]}
    assert g["shapes"]["hidden"]["max"] == [3, 64, 64]
    assert "--minShapes=hidden:1x1x64,positions:1x1,past_k_0:1x2x0x16" in g["trtexec"]
    assert (d / "trtexec.sh").read_text().count("trtexec --onnx=") == len(prof["graphs"])
    man = json.loads((d / "manifest.json").read_text())
    man["graphs"]["group_0"]["inputs"][0]["name"] = "renamed"
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CorruptModelError, match="differ from the manifest"):
        write_profile(d)
    with pytest.raises(InvalidArgumentError, match="peak concurrency"):
        batch_bounds(0)


# -- the real model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_export(smol, tmp_path_factory):
    """SmolLM2 exported (max_len 128) with a laser file: random low-rank exit heads and random gates at the exit
    points 10/15/20/25 of groups of 5, so that tokens exit at several depths."""
    eng = smol.engine
    torch.manual_seed(0)
    heads, gates = {}, {}
    for e in (10, 15, 20, 25):
        heads[e] = ExitHead(eng.adapter, "lowrank", rank=8)
        gates[e] = ExitGate(576)
        with torch.no_grad():
            heads[e].up.weight.normal_(0, 0.01)
            gates[e].linear.weight.normal_(0, 0.3)
            gates[e].linear.bias.zero_()
    d = tmp_path_factory.mktemp("onnx_smol")
    path = save_laser_file(d / "smol.laser", eng, LaserArtifact(
        heads=heads, gates=gates, thresholds={"gate_threshold": 0.5},
        config={"groups": "5", "min_depth": 8, "policy": "gate"}))
    out = d / "onnx"
    export_onnx(eng, out, laser=path, max_len=128, progress=False, tokenizer=smol.tokenizer)
    return out, path


def test_smollm2_full_depth_equals_the_engine(smol, smol_export):
    ids = torch.tensor(smol.tokenizer("The capital of France is Paris. The capital of Germany is")["input_ids"])
    ref, got, worst = full_depth_pair(smol.engine, onnx_engine(smol_export[0], threads=1), ids, 32)
    assert got == ref
    assert worst < 1e-4


def test_smollm2_adaptive_same_exits_and_tokens(smol, smol_export):
    out, path = smol_export
    eng = smol.engine
    mode = make_adaptive(eng, laser=str(path), patience=0)
    onnx = onnx_engine(out, threads=1)
    omode = make_mode(f"adaptive:laser={path},patience=0", onnx)
    ids = torch.tensor(smol.tokenizer("Once upon a time, in a small village,")["input_ids"])
    rs, cache = mode.new_state(eng), eng.new_cache(128)
    ref = mode.prefill_logits(eng, rs, cache, ids)
    ors, ocache = omode.new_state(onnx), onnx.new_cache()
    got = omode.prefill_logits(onnx, ors, ocache, ids)
    ref_tok = got_tok = int(ref.argmax())
    ref_exits, got_exits, ref_toks, got_toks = [], [], [], []
    for _ in range(24):
        ref, info = mode.decode(eng, rs, cache, ref_tok)
        got, ginfo = omode.decode(onnx, ors, ocache, got_tok)
        ref_exits.append(info["exit_layer"])
        got_exits.append(ginfo["exit_layer"])
        ref_tok, got_tok = int(ref.argmax()), int(got.argmax())
        ref_toks.append(ref_tok)
        got_toks.append(got_tok)
    assert got_exits == ref_exits and got_toks == ref_toks
    assert len(set(ref_exits)) > 1


def test_smollm2_cli_generate_onnxruntime(smol, smol_export, capsys):
    from laserlm.cli import main

    assert main(["generate", "--backend", "onnxruntime", "--model", str(smol_export[0]), "--json", "-n", "12",
                 "--ignore-eos", "-t", "1", "The capital of France is"]) == 0
    got = json.loads(capsys.readouterr().out)
    ref = smol.generate("The capital of France is", max_new_tokens=12, ignore_eos=True)
    assert got["text"] == ref.text and got["backend"] == "onnxruntime"


def test_smollm2_load_of_an_export_runs_the_one_loop(smol, smol_export):
    """``laserlm.load(export_dir)`` is a LaserLM on the onnxruntime engine: generate (full and adaptive, with a
    repetition penalty that only the one loop's sampling gives) equals the PyTorch engine's; what the export fixes
    and continuous batching are clear errors."""
    import laserlm

    out, path = smol_export
    lm = laserlm.load(str(out), threads=1)
    assert isinstance(lm.engine, OnnxEngine) and "onnxruntime" in lm.describe() and lm.engine.onnx.threads == 1
    for mode in ("full", f"adaptive:laser={path},patience=0"):
        kw = dict(mode=mode, max_new_tokens=10, ignore_eos=True, repetition_penalty=1.3)
        ref = smol.generate("The capital of France is", **kw)
        got = lm.generate("The capital of France is", **kw)
        assert got.token_ids == ref.token_ids and got.layers_per_token == ref.layers_per_token, mode
    with pytest.raises(InvalidArgumentError, match="continuous batching"):
        lm.generate_batch(["a", "b"])
    with pytest.raises(InvalidArgumentError, match="ONNX export: its graphs fix weights"):
        laserlm.load(str(out), weights="int4")


@pytest.mark.slow
def test_cli_export_writes_graphs_manifest_and_tensorrt_profile(tmp_path, capsys):
    from laserlm.cli import main

    out = tmp_path / "smol"
    assert main(["export", "onnx", "--model", "smollm2-135m", "--out", str(out), "--max-len", "64", "--groups", "10",
                 "--peak-concurrency", "5", "--no-progress", "-t", "1"]) == 0
    text = capsys.readouterr().out
    assert "exported 7 graphs" in text and "NOT built" in text
    man = read_manifest(out)
    assert man["shapes"]["batch"] == [1, 6] and man["shapes"]["max_len"] == 64 and man["groups_spec"] == "0-9/10-19/20-29"
    prof = json.loads((out / "tensorrt_profile.json").read_text())
    assert prof["batch"] == [1, 5, 6] and set(prof["graphs"]) == set(man["graphs"])
    assert (out / "tokenizer").is_dir()


# -- the whole model with the seed's signature -----------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_whole_model_graph_padded_batch_equals_unpadded_rows(family, tmp_path):
    """``input_ids`` + ``attention_mask`` -> ``logits`` (seed 004 §3.1): a batch with a left-padded, a right-padded
    and a full row gives each row's own logits at its token positions within 1e-4, and an unpadded row equals
    the transformers model's logits (the independent reference). Gemma3's sliding window (4) is shorter than the
    rows, so the window mask runs on padded positions too."""
    from laserlm.export.onnx import export_whole_model

    import copy

    model = tiny_llama() if family == "llama" else tiny_gemma3()
    reference = copy.deepcopy(model)  # the unmodified transformers model (the engine installs its own attention)
    eng = Engine(model, max_seq_len=MAX_LEN)
    path = tmp_path / "model.onnx"
    info = export_whole_model(eng, path, max_len=32)
    assert info["bytes"] > 0
    sess = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask"]
    assert [o.name for o in sess.get_outputs()] == ["logits"]
    assert sess.get_inputs()[0].shape == ["batch", "seq_len"]
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(1, eng.config.vocab_size, (n,), generator=g) for n in (7, 4, 10)]
    T = 10
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    ids[0, T - 7:], mask[0, T - 7:] = rows[0], 1  # left padding
    ids[1, :4], mask[1, :4] = rows[1], 1  # right padding
    ids[2], mask[2] = rows[2], 1
    (batch,) = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    batch = torch.from_numpy(batch)
    for i, r in enumerate(rows):
        n = r.numel()
        ones = torch.ones(1, n, dtype=torch.long)
        (alone,) = sess.run(None, {"input_ids": r[None].numpy(), "attention_mask": ones.numpy()})
        alone = torch.from_numpy(alone)[0]
        got = batch[i][mask[i].bool()]
        assert float((got - alone).abs().max()) < 1e-4, i
        with torch.no_grad():
            ref = reference(r[None]).logits[0].float()
        assert rel(alone, ref) < 1e-4, i


def test_whole_model_export_refuses_a_directory_and_a_long_max_len(tmp_path):
    from laserlm.export.onnx import export_whole_model

    eng = Engine(tiny_llama(), max_seq_len=MAX_LEN)
    with pytest.raises(InvalidArgumentError, match="directory"):
        export_whole_model(eng, tmp_path)
    with pytest.raises(InvalidArgumentError, match="max-len"):
        export_whole_model(eng, tmp_path / "m.onnx", max_len=MAX_LEN + 1)
