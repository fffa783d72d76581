"""Calibrated defaults (laserlm/defaults.py, issue 12): bare ``adaptive`` / ``speculative`` on a bundled model
resolve to a calibrated default built once into the cache and reused; on other models they are refused with a
message naming the ways out; specs that name their rule run as written."""

from __future__ import annotations

import json

import pytest
import torch

from laserlm import defaults
from laserlm.errors import InvalidArgumentError
from tests.helpers import run_cli


# -- the rule ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, kind", [
    ("adaptive", "adaptive"), ("adaptive:bridge=deferred", "adaptive"), ("adaptive:patience=0,score=decode", "adaptive"),
    ("adaptive:score=replay", "adaptive"),
    ("adaptive:threshold=0.9", None), ("adaptive:policy=saturation", None), ("adaptive:laser=a.st", None),
    ("adaptive:gate_threshold=0.5,laser=a.st", None), ("adaptive:ats_threshold=0.7", None),
    ("speculative", "speculative"), ("speculative:reuse=0", "speculative"),
    ("speculative:auto=1", None), ("speculative:k=1", None), ("speculative:draft_layers=20", None),
    ("speculative:threshold=0.8", None), ("speculative:laser=a.st", None),
    ("full", None), ("static:layers=26", None), ("early-exit:layer=24", None),
])
def test_which_specs_take_the_default(spec, kind):
    assert defaults.needs_default(spec) == kind


@pytest.mark.parametrize("spec", ["adaptive:groups=3", "adaptive:min_depth=4,bridge=deferred", "adaptive:measure=margin"])
def test_shaping_options_without_an_exit_rule_are_refused(spec):
    with pytest.raises(InvalidArgumentError, match="no exit rule.*laser=PATH.*threshold="):
        defaults.needs_default(spec)


def test_named_rules_pass_through_unchanged(smol):
    for config in ("full", "adaptive:policy=confidence,threshold=0.9", "speculative:k=1@sparse:threshold=0.5",
                   "static:layers=26"):
        assert smol.resolve_spec(config) == config


# -- non-bundled models are refused -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(smol, tmp_path_factory):
    """A tiny random Llama model directory (not bundled) with smollm2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(smol.tokenizer), max_position_embeddings=256,
                      tie_word_embeddings=True)
    d = tmp_path_factory.mktemp("tiny-model")
    LlamaForCausalLM(cfg).save_pretrained(d)
    smol.tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("mode, needles", [
    ("adaptive", ["laserlm calibrate --model", "--output", "adaptive:laser=", "threshold="]),
    ("adaptive:bridge=deferred", ["laserlm calibrate --model", "adaptive:laser=", "threshold="]),
    ("speculative", ["speculative:auto=1", "draft_layers=", "threshold="]),
])
def test_cli_refuses_bare_modes_on_a_non_bundled_model(tiny_dir, mode, needles, capsys):
    for argv in (["generate", "--model", str(tiny_dir), "--mode", mode, "hello"],
                 ["eval", "--model", str(tiny_dir), "--config", mode, "--tasks", "agreement"],
                 ["bench", "--model", str(tiny_dir), "--config", mode]):
        line = run_cli(capsys, argv, empty_stdout=True)
        assert str(tiny_dir) in line and "not a bundled model" in line
        for needle in needles:
            assert needle in line, (argv, line)


def test_api_refuses_bare_adaptive_on_a_non_bundled_model_and_runs_explicit_ones(tiny_dir):
    import laserlm
    from laserlm.evaluation.tasks import EvalSettings, Evaluator

    lm = laserlm.load(str(tiny_dir), max_seq_len=64)
    for mode in ("adaptive", "speculative", "adaptive:patience=0"):
        with pytest.raises(InvalidArgumentError, match="not a bundled model"):
            lm.generate("hello", mode=mode, max_new_tokens=2)
    with pytest.raises(InvalidArgumentError, match="laserlm calibrate"):
        Evaluator(lm, ["adaptive"], EvalSettings(progress=False))
    full = lm.generate("hello", max_new_tokens=3, ignore_eos=True).token_ids
    assert len(lm.generate("hello", mode="adaptive:groups=2,policy=confidence,threshold=0.9", max_new_tokens=3,
                           ignore_eos=True).token_ids) == 3
    assert lm.generate("hello", mode="speculative:draft_layers=2,k=2", max_new_tokens=3,
                       ignore_eos=True).token_ids == full


# -- bundled model: build once into the cache, then reuse -------------------------------------------------
def _small_calibration(data=None):
    """A real calibration at tiny sizes (deferred bridge: thresholds certified on the collected states, no
    decoding per candidate), so the test builds a real laser file in seconds."""
    from laserlm.training.gates import GateTrainConfig
    from laserlm.training.pipeline import CalibrateConfig
    from laserlm.training.train import HeadTrainConfig

    return CalibrateConfig(data=data, groups="10", seq_len=64, train_tokens=256, gate_tokens=128, calib_tokens=256,
                           eval_tokens=128, heads=HeadTrainConfig(steps=3, batch_tokens=64),
                           gates=GateTrainConfig(steps=3), router_prompts=0, target_agreement=0.5,
                           bridge="deferred").validate()


@pytest.fixture
def small_builder(tmp_path, monkeypatch):
    """An empty cache and a builder that calibrates at :func:`_small_calibration` sizes; yields the calls made to
    the calibration pipeline."""
    from laserlm.training import pipeline
    from laserlm.training.defaults import build_adaptive_default

    monkeypatch.setenv("LASERLM_CACHE", str(tmp_path))
    calls = []
    real = pipeline.calibrate

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "calibrate", counting)
    monkeypatch.setattr(defaults, "_ADAPTIVE_BUILDER",
                        lambda engine, progress=True: build_adaptive_default(engine, _small_calibration(), progress))
    return calls


def test_bundled_adaptive_builds_a_calibrated_artifact_once_and_reuses_it(smol, tmp_path, small_builder, capsys):
    import laserlm
    from laserlm.depth.laser_file import load_laser_file
    from laserlm.depth.adaptive import AdaptiveDepth

    calls = small_builder
    expect = defaults.adaptive_artifact_path(smol.engine, _small_calibration().to_dict())
    assert expect.parent.parent == tmp_path / defaults.DEFAULTS_DIR and not expect.exists()
    assert "smollm2-135m" in expect.parent.name and smol.weights in expect.parent.name
    assert expect != defaults.adaptive_artifact_path(smol.engine)  # other settings: another cache entry
    spec = smol.resolve_spec("adaptive")
    assert spec == f"adaptive:laser={expect}"
    err = capsys.readouterr().err
    assert "building the calibrated adaptive-depth artifact for smollm2-135m once" in err and "later runs reuse" in err
    assert len(calls) == 1 and calls[0]["resume"] is True and str(calls[0]["work_dir"]).endswith(".work")
    art = load_laser_file(expect, smol.engine)  # a real laser file for this model
    assert set(art.heads) == {10, 20} and "gate_threshold" in art.thresholds
    assert json.loads(expect.with_suffix(".json").read_text())["config"]["calibration"]["settings"]["groups"] == "10"
    assert not list(expect.parent.glob("building-*"))
    # later runs (a new LaserLM on the same model, pass-through options, an attention suffix) reuse it
    lm2 = laserlm.LaserLM(smol.loaded, max_seq_len=128)
    mode = lm2.mode("adaptive")
    assert isinstance(mode, AdaptiveDepth) and mode.heads and mode.patience == 0
    out = lm2.generate("The weather today is", mode="adaptive", max_new_tokens=4, ignore_eos=True)
    assert len(out.token_ids) == 4
    assert lm2.resolve_spec("adaptive:bridge=deferred@sparse") == f"adaptive:laser={expect},bridge=deferred@sparse"
    assert len(calls) == 1, "the cached artifact was rebuilt"
    assert "building" not in capsys.readouterr().err


def test_without_a_builder_a_missing_artifact_is_an_error_that_says_how_to_build_it(smol, tmp_path, monkeypatch):
    monkeypatch.setenv("LASERLM_CACHE", str(tmp_path))
    monkeypatch.setattr(defaults, "_ADAPTIVE_BUILDER", None)
    with pytest.raises(InvalidArgumentError, match="not built yet.*laserlm generate --model smollm2-135m --mode adaptive"):
        smol.resolve_spec("adaptive")


def test_the_laserlm_command_installs_the_builder(monkeypatch, capsys):
    from laserlm.cli import main
    from laserlm.training.defaults import build_adaptive_default

    monkeypatch.setattr(defaults, "_ADAPTIVE_BUILDER", None)
    assert main(["models"]) == 0
    assert defaults._ADAPTIVE_BUILDER is build_adaptive_default


def test_bundled_eval_and_bench_configs_use_the_calibrated_default(smol, small_builder):
    from laserlm.bench.measure import EngineTarget
    from laserlm.evaluation.tasks import EvalSettings, Evaluator

    ev = Evaluator(smol, ["adaptive"], EvalSettings(progress=False))
    assert ev.names == ["full", "adaptive"]  # the user's name is kept
    assert ev.scorers["adaptive"].mode.heads  # ... and runs the calibrated heads
    target = EngineTarget(smol, smol.resolve_spec("adaptive"))
    assert target.mode.heads and len(small_builder) == 1


def test_bundled_speculative_tunes_once_and_stays_lossless(smol, tmp_path, monkeypatch, capsys):
    from laserlm.speculative import calibration as sc

    monkeypatch.setenv("LASERLM_CACHE", str(tmp_path))
    calls = []
    real = sc.calibrate

    def small(engine, **kw):  # the real search on less text
        calls.append(1)
        return real(engine, **{**kw, "gen_tokens": 6, "n_text": 1})

    monkeypatch.setattr(sc, "calibrate", small)
    spec = smol.resolve_spec("speculative")
    s = json.loads(defaults.speculative_settings_path(smol.engine).read_text())["chosen"]
    assert spec == f"speculative:draft_layers={s['draft_layers']},k={s['k']},threshold={s['threshold']}"
    assert "tuning the speculative draft settings for smollm2-135m once" in capsys.readouterr().err
    assert smol.resolve_spec("speculative:reuse=0") == spec + ",reuse=0" and len(calls) == 1
    full = smol.generate("The capital of France is", max_new_tokens=6, ignore_eos=True).token_ids
    assert smol.generate("The capital of France is", mode="speculative", max_new_tokens=6,
                         ignore_eos=True).token_ids == full


# -- the default's calibration text: the model's own greedy answers to chat prompts ------------------------
def test_chat_questions_come_from_dev_files_and_keep_the_shipped_prompts_out(tmp_path):
    from laserlm.data import find_data_root
    from laserlm.evaluation.tasks import load_prompts
    from laserlm.training.chat_text import chat_questions

    root = find_data_root()
    shipped = load_prompts()
    qs = chat_questions(root)
    assert len(qs) > 1000 and len(set(qs)) > 0.9 * len(qs)
    assert qs == chat_questions(root)  # a fixed order
    arc_stem = json.loads((root / defaults.CHAT_PROMPT_SOURCES[0]).read_text().splitlines()[0])["question"]["stem"]
    assert arc_stem in qs
    assert not {q.lower() for q in qs} & {p.lower() for p in shipped}
    from laserlm.training.chat_text import shipped_prompts
    assert shipped_prompts() == shipped
    # a shipped prompt planted in a prompt file is dropped
    for rel in defaults.CHAT_PROMPT_SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((root / rel).read_text())
    arc = tmp_path / defaults.CHAT_PROMPT_SOURCES[0]
    arc.write_text(json.dumps({"question": {"stem": shipped[0]}}) + "\n" + arc.read_text())
    planted = chat_questions(tmp_path, held_out=shipped)
    assert shipped[0] not in planted and len(planted) == len(qs)


def test_chat_token_stream_is_prompt_plus_the_models_greedy_answer(smol):
    from laserlm.data import find_data_root
    from laserlm.runtime.generate import encode_prompt
    from laserlm.training.chat_text import chat_questions, chat_token_stream

    seq_len = 80  # prompts of at most 40 tokens (the SmolLM2 template's system prompt alone is ~30)
    tokens, counted, report = chat_token_stream(smol.engine, 3, seq_len, find_data_root(), batch=2, progress=False)
    assert tokens.shape == counted.shape == (3 * seq_len,) and report["records"] == 3
    assert report["counted_positions"] == int(counted.sum())
    firsts = {tuple(encode_prompt(smol.tokenizer, q, True, 2048).tolist()): q for q in chat_questions(find_data_root())}
    for r in range(3):
        rec, cnt = tokens[r * seq_len:(r + 1) * seq_len].tolist(), counted[r * seq_len:(r + 1) * seq_len].tolist()
        p = cnt.index(True) + 1  # the first counted position predicts the first answer token
        assert all(cnt[p - 1:seq_len - 1]) and not any(cnt[:p - 1]) and not cnt[-1]
        q = firsts[tuple(rec[:p])]  # the record opens with a chat-formatted dev question
        ref = smol.generate(q, chat=True, max_new_tokens=seq_len - p, ignore_eos=True).token_ids
        assert sum(a == b for a, b in zip(rec[p:], ref)) >= 0.9 * len(ref), (q, rec[p:], ref)


def test_a_chat_calibration_counts_only_the_answer_positions(smol, tmp_path):
    from laserlm.training.pipeline import calibrate

    cfg = _small_calibration()
    cfg.source, cfg.seq_len = "chat", 96
    cfg.train_tokens, cfg.gate_tokens, cfg.calib_tokens, cfg.eval_tokens = 192, 96, 192, 192
    summary = calibrate(smol, cfg.validate(), tmp_path / "chat.laser.safetensors", progress=False)
    text = summary["text"]
    assert text["source"] == "chat" and text["seq_len"] == 96 and text["records"] == 8  # ceil((7 chunks * 96 + 1) / 96)
    # the held-out split is 2 chunks = 2 conversations; only their answer positions are measured
    held = summary["held_out"]["positions"]
    assert 2 * 48 <= held < summary["splits_tokens"]["held_out"] == 192
    assert summary["calibration"]["n"] < summary["splits_tokens"]["calibration"]
    assert (tmp_path / "chat.laser.safetensors.work" / "chat_text.pt").is_file()


def test_the_default_recipe_is_chat_text_and_part_of_the_cache_key(smol):
    from laserlm.training.defaults import default_calibrate_config

    cfg = default_calibrate_config()
    assert cfg.source == "chat" and cfg.seq_len == 128 and cfg.target_agreement == 0.99 and cfg.bridge == "propagate"
    key = defaults.calibration_data_key()
    assert key.startswith("chat:") and all(rel.split("/")[-1] in key for rel in defaults.CHAT_PROMPT_SOURCES)
    assert defaults.calibration_data_key(source="text").startswith("file:valid.txt")
    # the WikiText-2 build of the same settings is another cache entry
    text_cfg = default_calibrate_config()
    text_cfg.source = "text"
    assert (defaults.adaptive_artifact_path(smol.engine)
            != defaults.adaptive_artifact_path(smol.engine, text_cfg.to_dict()))


def test_kept_k_quants_leave_the_key_of_a_file_without_k_quants(smol, monkeypatch):
    """``LASERLM_KQUANTS=native`` changes nothing for SmolLM2's Q4_1 file (it holds no Q4_K / Q6_K tensor), so its
    calibrated defaults are reused, native or float. (Gemma3's key changes: tests/test_gguf_native.py.)"""
    from types import SimpleNamespace

    engines = [SimpleNamespace(loaded=smol.engine.loaded, weights=w, dtype=smol.engine.dtype) for w in ("native", "fp32")]
    monkeypatch.delenv("LASERLM_KQUANTS", raising=False)
    before = [defaults._model_key(e) for e in engines]
    monkeypatch.setenv("LASERLM_KQUANTS", "native")
    assert [defaults._model_key(e) for e in engines] == before


# -- the real default (6 minutes on 2 cores) --------------------------------------------------------------
@pytest.mark.slow
def test_bare_adaptive_meets_its_target_on_the_shipped_prompts(tmp_path, monkeypatch):
    """On a bundled model, ``--mode adaptive`` with no other flag meets the calibrated artifact's agreement target
    (top-1 agreement with full-depth greedy output, per generated position) on the shipped prompt set, and it does
    so with fewer layers than full depth (xfail, with the figure, while nothing exits)."""
    import laserlm
    from laserlm.evaluation.tasks import load_prompts
    from laserlm.runtime.generate import encode_prompt

    from laserlm.training.defaults import build_adaptive_default

    monkeypatch.setenv("LASERLM_CACHE", str(tmp_path))
    monkeypatch.setattr(defaults, "_ADAPTIVE_BUILDER", build_adaptive_default)
    lm = laserlm.load("smollm2-135m")
    mode = lm.mode("adaptive")
    path = defaults.adaptive_artifact_path(lm.engine)
    target = json.loads(path.with_suffix(".json").read_text())["config"]["calibration"]["settings"]["target_agreement"]
    agree = total = 0
    layers = []
    for prompt in load_prompts():
        ref = lm.generate(prompt, chat=True, max_new_tokens=32, ignore_eos=True)
        prompt_ids = encode_prompt(lm.tokenizer, prompt, True, lm.engine.max_seq_len).tolist()
        ids = torch.tensor(prompt_ids + ref.token_ids)
        with torch.inference_mode():
            out = mode.score(lm.engine, ids)
        n = len(prompt_ids)
        pred = out.logits[n - 1:-1].argmax(-1)  # predictions of the generated positions, teacher-forced
        agree += int((pred == torch.tensor(ref.token_ids)).sum())
        total += len(ref.token_ids)
        layers.append(out.layers[n - 1:-1])
    assert agree / total >= target, (agree, total, target)
    # a certificate at threshold 1.0 meets any target by never exiting: that is not adaptive depth
    mean_layers = float(torch.cat(layers).float().mean())
    if mean_layers >= lm.engine.num_layers:
        pytest.xfail(f"the bare adaptive default never exits ({mean_layers:.2f} of {lm.engine.num_layers} layers per "
                     "token): the bundled model is not trained to exit (exit-trained backbone, issue 33)")
    assert mean_layers < lm.engine.num_layers
