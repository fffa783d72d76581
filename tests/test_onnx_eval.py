"""``laserlm eval --backend onnxruntime``: the exported graphs evaluated by the one Evaluator give the PyTorch engine's
numbers on the same tiny model (float32): perplexities within 1e-4 (relative), the same argmax tokens, the same
exit layers at adaptive depth (same laser file), the same greedy generations; unsupported options and
configurations are one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import run_cli
from laserlm.cli import main

from test_depth import tiny_llama
from test_onnx_export import tiny_laser_file

pytest.importorskip("onnxruntime")
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),  # the tiny BPE tokenizer drops a leading space:
              pytest.mark.filterwarnings("ignore::laserlm.models.tokenizer_probe.TokenizerRoundTripWarning")]

MAX_LEN = 64
TEXT = ("The tower is 324 metres tall , about the same height as an 81 @-@ storey building , and the tallest "
        "structure in Paris . Its base is square , measuring 125 metres on each side .\n") * 2
LAMBADA = ["The tower is as tall as a building", "Its base is square , measuring metres on each side"]
ARC = [("Which structure is in Paris ?", ["the tower", "a square", "the side"], "A"),
       ("How tall is the tower ?", ["81 metres", "324 metres", "125 metres"], "B")]
PROMPTS = ["The tower is", "Its base"]


def tiny_tokenizer(texts):
    """A BPE tokenizer of at most 128 tokens (the tiny Llama's vocabulary) trained on ``texts``; no BOS added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=128, special_tokens=["<unk>", "<s>", "</s>"],
                                                       show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama saved as a model directory with a tokenizer, its laser file (the one of
    test_onnx_export), its ONNX export (max batch 2, max len 64) and a data directory."""
    import laserlm
    from laserlm.export.onnx import export_onnx

    d = tmp_path_factory.mktemp("onnx_eval")
    arc_text = [f"Question: {q}\nAnswer: " + " ".join(c) for q, c, _ in ARC]
    tok = tiny_tokenizer([TEXT, *LAMBADA, *arc_text, *PROMPTS])
    assert len(tok) <= 128
    tiny_llama(seed=1).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    lm = laserlm.load(str(d / "model"), dtype="float32")
    laser = tiny_laser_file(lm.engine, d / "tiny.laser")
    export_onnx(lm.engine, d / "onnx", laser=laser, max_batch=2, max_len=MAX_LEN, progress=False, tokenizer=tok)
    data = d / "data"
    (data / "wikitext-2").mkdir(parents=True)
    (data / "wikitext-2" / "test.txt").write_text(TEXT)
    (data / "lambada").mkdir()
    (data / "lambada" / "lambada_test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    (data / "arc").mkdir()
    (data / "arc" / "ARC-Easy-Test.jsonl").write_text("".join(json.dumps(
        {"id": str(i), "answerKey": key, "question": {"stem": q, "choices": [
            {"label": lab, "text": c} for lab, c in zip("ABC", choices)]}}) + "\n"
        for i, (q, choices, key) in enumerate(ARC)))
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return {"lm": lm, "model": d / "model", "laser": laser, "onnx": d / "onnx", "data": data,
            "prompts": d / "prompts.jsonl"}


def eval_json(capsys, tiny, backend, configs, tasks="wikitext,lambada,arc_easy,agreement", data=None):
    model = tiny["onnx"] if backend == "onnxruntime" else tiny["model"]
    argv = ["eval", "--backend", backend, "--model", str(model), "--tasks", tasks,
            "--data", str(data or tiny["data"]), "--window", "16", "--agreement-windows", "3", "--gen-tokens", "8", "--prompts", str(tiny["prompts"]),
            "--no-progress", "--json", "-"]
    if backend == "torch":  # the export's context
        argv += ["--ctx-size", str(MAX_LEN)]
    for c in configs:
        argv += ["--config", c]
    assert main(argv) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def assert_same_metrics(got, want, where=()):
    """``got == want`` through nested dicts and lists, except that numbers under a key naming a perplexity or an
    NLL (computed from log-probs: float32 rounding) need only agree to 1e-4 relative (1e-5 absolute), and wall times
    (``seconds``) need only be present."""
    if where and where[-1] == "seconds":
        assert isinstance(got, float) and got >= 0, where
        return
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            assert_same_metrics(got[k], want[k], (*where, k))
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_metrics(g, w, (*where, i))
    elif isinstance(want, float) and any("perplexity" in str(k) or "nll" in str(k) for k in where[-1:]):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), where
    else:
        assert got == want, where


def test_eval_equals_the_pytorch_engine_full_and_adaptive(tiny, capsys):
    """Every metric of every task and configuration equals the engine's: perplexities to 1e-4, and the counts that
    follow argmax tokens (top-1 agreement, accuracies, generation agreement) and exit layers (layers/token) exactly."""
    laser = tiny["laser"]
    configs = [f"adaptive:laser={laser}", f"adaptive:laser={laser},patience=0"]
    ref, _ = eval_json(capsys, tiny, "torch", configs)
    got, table = eval_json(capsys, tiny, "onnxruntime", configs)
    assert got["backend"] == "onnxruntime" and ref["backend"] == "torch" and got["weights"] == "fp32"
    assert "(onnxruntime, fp32 graphs" in table and "onnxruntime, onnxruntime" not in table and "### wikitext" in table
    assert got["configs"] == ref["configs"] == ["full", *configs]
    doc = tiny["data"] / "doc.txt"  # longtext: one document, capped at the context + 1 tokens
    doc.write_text(TEXT * 4)
    for res, backend in ((ref, "torch"), (got, "onnxruntime")):
        res["results"]["longtext"] = eval_json(capsys, tiny, backend, configs[:1], "longtext", doc)[0]["results"][
            "longtext"]
    assert got["results"]["longtext"]["full"]["tokens"] == MAX_LEN + 1
    assert_same_metrics(got["results"], ref["results"])
    wt = got["results"]["wikitext"]
    assert wt["full"]["windows"] > 2 and wt["full"]["mean_layers"] == 8
    adaptive = wt[configs[0]]
    assert adaptive["mean_layers"] < 8 and adaptive["top1_agreement"] < 1  # some tokens exit early, and it shows
    assert wt[configs[1]]["mean_layers"] != adaptive["mean_layers"]  # patience 0 vs 3: other exits
    assert got["results"]["arc_easy"]["full"]["n"] == 2


def test_scorer_matches_the_engine_token_by_token(tiny):
    """The Scorer on the onnxruntime engine vs on the PyTorch engine, sequences scored in one batch from different
    starts (padding, batch of 2): the same argmax and layers at every position, log-probs within 1e-4; and the same
    greedy generations through the one decode loop (``laserlm.api.load_onnx``)."""
    from laserlm.api import load_onnx
    from laserlm.evaluation.scoring import Scorer

    lm, olm = tiny["lm"], load_onnx(tiny["onnx"], threads=1)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (20, 9, 33)]
    starts = [1, 5, 12]
    for spec in ("full", f"adaptive:laser={tiny['laser']}", f"adaptive:laser={tiny['laser']},patience=0"):
        ref, got = Scorer(lm.engine, spec), Scorer(olm.engine, spec)
        assert got.batch_rows == (2 if spec == "full" else 1)
        for r, o in zip(ref.score(seqs, starts), got.score(seqs, starts)):
            assert torch.equal(o.argmax, r.argmax) and torch.equal(o.layers, r.layers), spec
            assert float((o.token_logprobs - r.token_logprobs).abs().max()) < 1e-4
        for p in PROMPTS:
            want = lm.generate(p, mode=ref.mode, max_new_tokens=12, temperature=0.0, ignore_eos=True).token_ids
            assert olm.generate(p, mode=got.mode, max_new_tokens=12, temperature=0.0, ignore_eos=True).token_ids == want


def test_longer_than_the_export_is_a_context_error(tiny):
    from laserlm.api import load_onnx
    from laserlm.errors import ContextLengthError
    from laserlm.evaluation.scoring import Scorer

    with pytest.raises(ContextLengthError, match="exceeds the context size 64"):
        Scorer(load_onnx(tiny["onnx"]).engine, "full").score([list(range(3, 3 + MAX_LEN + 2))], [1])


@pytest.mark.parametrize("extra, message", [
    (["--weights", "int4"], "drop --weights/--dtype"),
    (["--dtype", "bfloat16"], "drop --weights/--dtype"),
    (["--prefill-dtype", "float32"], "drop --prefill-dtype"),
    (["--ctx-size", "32"], "drop --ctx-size"),
    (["--attention", "sparse"], "dense attention only"),
    (["--config", "full@sparse:threshold=0.5"], "dense attention only: drop '@sparse:threshold=0.5'"),
    (["--config", "speculative:draft_layers=2"], "runs modes 'full' and 'adaptive', not 'speculative'"),
    (["--config", "adaptive:bridge=deferred"], "propagate bridge only"),
])
def test_cli_refuses_what_the_graphs_do_not_have(tiny, capsys, extra, message):
    line = run_cli(capsys, ["eval", "--backend", "onnxruntime", "--model", str(tiny["onnx"]), "--tasks", "wikitext",
                            "--data", str(tiny["data"]), "--no-progress", *extra])
    assert message in line


def test_cli_refusals_shared_with_generate(tiny, tmp_path, capsys):
    line = run_cli(capsys, ["eval", "--backend", "onnxruntime", "--model", str(tmp_path / "nope"), "--tasks",
                            "wikitext", "--data", str(tiny["data"])])
    assert "ONNX export directory not found" in line
    line = run_cli(capsys, ["generate", "--backend", "onnxruntime", "--prefill-dtype", "bfloat16", "--model",
                            str(tiny["onnx"]), "hi"])
    assert "drop --prefill-dtype" in line
