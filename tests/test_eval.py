"""laserlm eval: metrics against independent computations with the unmodified transformers model."""

from __future__ import annotations

import bz2
import json
import math
from pathlib import Path

import pytest
import torch

from helpers import FakeInstance
from laserlm.cli import main
from laserlm.data import find_data_root
from laserlm.errors import InvalidArgumentError, LaserLMError
from laserlm.evaluation import data as D
from laserlm.evaluation.scoring import Scorer, encode_pair
from laserlm.evaluation.tasks import EvalSettings, Evaluator, text_windows
from laserlm.mode_table import register_mode
from laserlm.runtime.modes import FullDepth, Mode, ScoreOutput
from laserlm.models.loader import reference_dir

REAL = find_data_root() or Path("no-shared-data")  # the shared data directory, if configured
TEXT = ("The tower is 324 metres tall , about the same height as an 81 @-@ storey building , and the tallest "
        "structure in Paris . Its base is square , measuring 125 metres on each side .\n")


# -- test modes: a copy of full depth through the generic path, a half-depth model, a broken one --------
class CopyMode(Mode):
    """Full depth, but not a FullDepth instance: exercises the generic mode.score path."""

    name = "test_copy"

    def __init__(self):
        self.inner = FullDepth()

    def new_state(self, engine, request):
        return self.inner.new_state(engine, request)

    def prefill(self, engine, request):
        return self.inner.prefill(engine, request)

    def step(self, engine, request):
        return self.inner.step(engine, request)

    def score(self, engine, input_ids):
        return self.inner.score(engine, input_ids)


class HalfMode(CopyMode):
    """Only the first half of the decoder layers (quality must drop)."""

    name = "test_half"

    def score(self, engine, input_ids):
        k = engine.num_layers // 2
        with torch.inference_mode():
            h, st = engine.begin(input_ids.unsqueeze(0), use_cache=False)
            logits = engine.head(engine.run_layers(0, k, h, st))[0]
        return ScoreOutput(logits, torch.full((input_ids.shape[0],), float(k)))


class BrokenMode(CopyMode):
    name = "test_broken"

    def score(self, engine, input_ids):
        raise RuntimeError("shape mismatch in a plug-in")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


register_mode("test_copy", lambda engine, **o: CopyMode())
register_mode("test_half", lambda engine, **o: HalfMode())
register_mode("test_broken", lambda engine, **o: BrokenMode())


@pytest.fixture
def wiki_dir(tmp_path):
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "test.txt").write_text(TEXT)
    return tmp_path


def _ref_nll(ref, ids: list[int]) -> tuple[float, int]:
    """Summed NLL of ids[1:] given the prefix, computed directly with the unmodified transformers model."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = ref(x).logits[0].double()
    nll = torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:], reduction="sum")
    return float(nll), len(ids) - 1


def test_perplexity_equals_exp_mean_nll_of_transformers(smol, smol_ref, wiki_dir):
    ev = Evaluator(smol, [], EvalSettings(data_dir=str(wiki_dir), window=16, progress=False))
    r = ev.run("wikitext")["full"]
    ids = smol.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    nll = n = 0
    for b in range(0, len(ids), 16):  # non-overlapping windows, first token of each unscored
        a, c = _ref_nll(smol_ref, ids[b:b + 16]) if len(ids[b:b + 16]) > 1 else (0.0, 0)
        nll, n = nll + a, n + c
    assert r["method"] == "non-overlapping" and r["tokens_scored"] == n
    assert r["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)

    # sliding window, HF perplexity-guide loop: labels -100 except the last trg_len tokens of each window
    ev.s.stride = 6
    r = ev.run("wikitext")["full"]
    x, nll, n, prev_end = torch.tensor([ids]), 0.0, 0, 0
    for begin in range(0, len(ids), 6):
        end = min(begin + 16, len(ids))
        trg = end - prev_end
        inp = x[:, begin:end]
        labels = inp.clone()
        labels[:, :-trg] = -100
        with torch.no_grad():
            lg = smol_ref(inp).logits[0, :-1].double()
        tgt = labels[0, 1:]
        nll += float(torch.nn.functional.cross_entropy(lg, tgt, ignore_index=-100, reduction="sum"))
        n += int((tgt != -100).sum())
        prev_end = end
        if end == len(ids):
            break
    assert r["method"] == "sliding" and r["tokens_scored"] == n
    assert r["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)


def test_text_windows_score_every_token_once():
    # without a BOS prefix, a token that starts a window with no overlap has no context (HF convention)
    cases = [(100, 32, 32, False, {0, 32, 64, 96}), (100, 32, 7, False, {0}), (33, 32, 16, True, set()),
             (5, 32, 32, False, {0}), (64, 32, 32, True, set())]
    for n, w, s, pre, unscored in cases:
        scored = [i for _, e, f in text_windows(n, w, s, pre) for i in range(f, e)]
        assert scored == [i for i in range(n) if i not in unscored]
        assert all(e - b <= w for b, e, _ in text_windows(n, w, s, pre))
    with pytest.raises(InvalidArgumentError, match="stride"):
        text_windows(10, 4, 5, False)


def test_scorer_matches_transformers_and_picks_obvious_answer(smol, smol_ref):
    ctx, choices = "The capital of France is", [" Paris", " zxqv blorp gnash"]
    pairs = [encode_pair(smol.tokenizer, ctx, c) for c in choices]
    fast = Scorer(smol.engine, "full").score([p[0] for p in pairs], [p[1] for p in pairs])
    slow = Scorer(smol.engine, "test_copy").score([p[0] for p in pairs], [p[1] for p in pairs])
    for (ids, start), f, s in zip(pairs, fast, slow):
        with torch.no_grad():
            lp = torch.log_softmax(smol_ref(torch.tensor([ids])).logits[0].double(), -1)
        ref = sum(float(lp[t - 1, ids[t]]) for t in range(start, len(ids)))
        assert f.logprob == pytest.approx(ref, abs=2e-3)
        assert s.logprob == pytest.approx(ref, abs=2e-3)
    assert fast[0].logprob > fast[1].logprob + 10
    assert fast[0].greedy  # " Paris" is the model's top prediction


def test_encode_pair_moves_trailing_space_like_lm_eval(smol):
    assert encode_pair(smol.tokenizer, "Answer: ", "yes") == encode_pair(smol.tokenizer, "Answer:", " yes")
    ids, start = encode_pair(smol.tokenizer, "Hello", " world")
    assert ids == smol.tokenizer("Hello world")["input_ids"] and start == len(smol.tokenizer("Hello")["input_ids"])


def test_choice_task_picks_known_answers(smol, tmp_path):
    (tmp_path / "arc").mkdir()
    rows = [("What is the capital of France?", ["zq vv", "Paris", "blorp ugh"], "B"),
            ("How many days are in a week?", ["seven", "qq xz", "nnnn rrr"], "A"),
            ("What color is the sky on a clear day?", ["fjord plink", "wub wub", "blue"], "C")]
    with open(tmp_path / "arc" / "ARC-Easy-Test.jsonl", "w") as f:
        for i, (q, ch, key) in enumerate(rows):
            f.write(json.dumps({"id": str(i), "question": {"stem": q, "choices": [
                {"text": t, "label": "ABC"[j]} for j, t in enumerate(ch)]}, "answerKey": key}) + "\n")
    res = Evaluator(smol, ["test_copy"], EvalSettings(data_dir=str(tmp_path), progress=False)).run("arc_easy")
    for name in ("full", "test_copy"):
        assert res[name]["acc"] == 1.0 and res[name]["acc_norm"] == 1.0 and res[name]["n"] == 3
    assert res["test_copy"]["choice_agreement"] == 1.0


def _exit_logits(ref, ids: list[int], layer: int | None) -> torch.Tensor:
    """Logits ``[T, V]`` of the unmodified transformers model, or of its final norm + LM head applied to the
    hidden state after ``layer`` decoder layers (an untrained early exit)."""
    with torch.no_grad():
        out = ref(torch.tensor([ids]), output_hidden_states=layer is not None)
        if layer is None:
            return out.logits[0].float()
        return ref.lm_head(ref.model.norm(out.hidden_states[layer]))[0].float()


def _greedy(ref, ids: list[int], n: int, eos: set[int], layer: int | None) -> list[int]:
    """Greedy tokens, full forwards without a cache (every position exits at ``layer``, so no KV is missing)."""
    ids, new = list(ids), []
    for _ in range(n):
        tok = int(_exit_logits(ref, ids, layer)[-1].argmax())
        if tok in eos:
            break
        new.append(tok)
        ids.append(tok)
    return new


def test_agreement_of_an_early_exit_equals_a_hand_computed_expectation(smol, smol_ref, wiki_dir, tmp_path):
    """``early-exit:layer=20`` disagrees with the full model: top-1 agreement over the scored positions, the
    generation exact-match rate and the mean common-prefix fraction equal those computed from the
    transformers model directly (full logits vs its hidden state after 20 layers through norm + LM head)."""
    layer, n_gen, tok = 20, 5, smol.tokenizer
    prompts = ["What is the capital of France?", "Name three colours of the rainbow."]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    s = EvalSettings(data_dir=str(wiki_dir), window=16, agreement_windows=2, gen_tokens=n_gen,
                     prompts=str(tmp_path / "prompts.jsonl"), chat=True, progress=False)
    cfg = f"early-exit:layer={layer}"
    res = Evaluator(smol, [cfg], s).run("agreement")[cfg]
    # windows of 16 tokens, no BOS: each window's first token is unscored, the rest predicted within the window
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    same = []
    for b in (0, 16):
        w = ids[b:b + 16]
        same += (_exit_logits(smol_ref, w, None)[:-1].argmax(-1) == _exit_logits(smol_ref, w, layer)[:-1].argmax(-1)).tolist()
    assert res["positions"] == len(same) == 30
    assert 0 < sum(same) < len(same)  # neither 0 nor 1: the metric is not decided by construction
    assert res["top1_agreement"] == pytest.approx(sum(same) / len(same))
    exact, frac = 0, 0.0
    for p in prompts:
        chat_ids = list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"])
        full = _greedy(smol_ref, chat_ids, n_gen, smol.eos_ids, None)
        early = _greedy(smol_ref, chat_ids, n_gen, smol.eos_ids, layer)
        lcp = next((i for i, (a, b) in enumerate(zip(early, full)) if a != b), min(len(early), len(full)))
        exact += early == full
        frac += lcp / max(len(full), 1)
    assert res["gen_exact_match"] == exact / len(prompts)
    assert res["gen_mean_lcp_fraction"] == pytest.approx(frac / len(prompts))
    assert res["gen_exact_match"] < 1.0


def test_half_depth_loses_agreement_and_perplexity(smol, wiki_dir):
    s = EvalSettings(data_dir=str(wiki_dir), window=16, agreement_windows=2, gen_tokens=5, progress=False)
    wt = Evaluator(smol, ["test_half"], s).run("wikitext")
    assert wt["test_half"]["top1_agreement"] < 0.9
    assert wt["test_half"]["perplexity"] > wt["full"]["perplexity"]
    assert wt["test_half"]["mean_layers"] == smol.engine.num_layers // 2


# -- data parsers on real lines ------------------------------------------------------------------------
def _head(path: Path, n: int) -> str:
    opener = bz2.open if path.suffix == ".bz2" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return "".join(next(f) for _ in range(n))


@pytest.mark.skipif(not REAL.is_dir(), reason="shared data directory not present")
def test_parsers_on_real_lines(tmp_path):
    (tmp_path / "h.txt").write_text(_head(REAL / "hellaswag/hellaswag_val_full.txt.bz2", 12))
    h = D.read_hellaswag(tmp_path / "h.txt")
    assert len(h) == 2 and h[0].gold == 3 and len(h[0].choices) == 4
    assert h[0].context == "Roof shingle removal: A man is sitting on a roof. He"  # ctx_b capitalised as lm-eval
    assert h[0].choices[3] == "starts pulling up roofing on a roof."
    (tmp_path / "l.jsonl").write_text(_head(REAL / "lambada/lambada_test.jsonl", 2))
    lam = D.read_lambada(tmp_path / "l.jsonl")
    assert lam[0].target == " signs" and lam[0].context.endswith("I don't care about")
    (tmp_path / "a.jsonl").write_text(_head(REAL / "arc/ARC-Easy-Test.jsonl", 2))
    arc = D.read_arc(tmp_path / "a.jsonl")
    assert arc[0].context.startswith("Question: Which statement") and arc[0].context.endswith("\nAnswer:")
    assert arc[0].gold == 0 and arc[1].gold == 1 and len(arc[0].choices) == 4
    (tmp_path / "p.jsonl").write_text(_head(REAL / "piqa/valid.jsonl", 3))
    (tmp_path / "p.lst").write_text(_head(REAL / "piqa/valid-labels.lst", 3))
    piqa = D.read_piqa(tmp_path / "p.jsonl", tmp_path / "p.lst")
    assert [p.gold for p in piqa] == [0, 1, 1] and piqa[1].context == "Question: dresser\nAnswer:"
    (tmp_path / "bad.lst").write_text("0\n")
    with pytest.raises(D.DataFileError, match="3 rows but"):
        D.read_piqa(tmp_path / "p.jsonl", tmp_path / "bad.lst")
    assert D.read_wikitext(REAL / "wikitext-2/test.txt").startswith(" \n = Robert <unk> = \n")


GLUE_ROWS = {"sst2": {"sentence": "it 's a charming and often affecting journey . ", "label": 1},
             "rte": {"sentence1": "The cat sat on the mat.", "sentence2": "A cat is sitting.", "label": 0},
             "mrpc": {"sentence1": "He left early.", "sentence2": "He departed ahead of time.", "label": 1},
             "qnli": {"question": "Where do cats sit?", "sentence": "Cats sit on mats.", "label": 1}}


@pytest.mark.parametrize("task", list(GLUE_ROWS))
def test_glue_prompts_equal_lm_evals_own_task_files(task):
    """Context, choices and gold of each GLUE item equal what lm-eval's own glue/<task>/default.yaml renders."""
    lm_eval = pytest.importorskip("lm_eval")
    import jinja2
    import yaml

    spec = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "glue" / task / "default.yaml").read_text())
    row = GLUE_ROWS[task]
    (item,) = D.read_glue(task, [row])
    assert item.context == jinja2.Template(spec["doc_to_text"], keep_trailing_newline=True).render(**row)
    assert item.choices == spec["doc_to_choice"] and item.gold == row[spec["doc_to_target"]]


def test_glue_tsv_files_as_glue_ships_them(tmp_path):
    """GLUE's dev TSV layouts (string labels for RTE/QNLI, MRPC's own header) read as the dataset rows do; hidden
    test labels and missing columns are one clear error."""
    (tmp_path / "rte.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\tA \"quoted\" line.\tB.\tnot_entailment\n"
                                      "1\tC.\tD.\tentailment\n")
    rte = D.read_glue("rte", tmp_path / "rte.tsv")
    assert [i.gold for i in rte] == [1, 0] and rte[0].context.startswith('A "quoted" line.\nQuestion: B. True')
    (tmp_path / "mrpc.tsv").write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t7\t8\tHe left.\tHe went.\n")
    (mrpc,) = D.read_glue("mrpc", tmp_path / "mrpc.tsv")
    assert mrpc.gold == 1 and mrpc.context.startswith("Sentence 1: He left.\nSentence 2: He went.\n")
    (tmp_path / "test.tsv").write_text("index\tquestion\tsentence\tlabel\n0\tq?\ts.\t-1\n")
    with pytest.raises(D.DataFileError, match="hidden: use the validation split"):
        D.read_glue("qnli", tmp_path / "test.tsv")
    with pytest.raises(D.DataFileError, match="row 1 has no sentence2"):
        D.read_glue("rte", [{"sentence1": "x", "label": 0}])
    if REAL.is_dir():
        sst = D.load_task("sst2", REAL)
        assert len(sst) == 872 and sum(i.gold for i in sst) == 444  # GLUE SST-2 dev: 444 positive of 872
        assert sst[1].context.startswith("unflinchingly bleak and desperate \nQuestion:") and sst[1].gold == 0


def test_glue_task_scores_obvious_items_and_mrpc_f1(smol, tmp_path):
    (tmp_path / "glue" / "SST-2").mkdir(parents=True)
    (tmp_path / "glue" / "SST-2" / "dev.tsv").write_text(
        "sentence\tlabel\nan absolutely wonderful , joyous and beautiful film . \t1\n"
        "a terrible , boring and awful mess . \t0\n")
    res = Evaluator(smol, ["test_copy"], EvalSettings(data_dir=str(tmp_path), progress=False)).run("sst2")
    assert res["full"]["acc"] == 1.0 and res["full"]["n"] == 2 and res["test_copy"]["choice_agreement"] == 1.0
    assert "f1" not in res["full"]
    (tmp_path / "glue" / "MRPC").mkdir()
    (tmp_path / "glue" / "MRPC" / "dev.tsv").write_text(  # gold "yes" twice: F1 is 1.0 iff both predicted "yes"
        "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tThe cat sat.\tThe cat sat.\n"
        "1\t3\t4\tIt rained today.\tIt rained today.\n")
    res = Evaluator(smol, [], EvalSettings(data_dir=str(tmp_path), progress=False)).run("mrpc")["full"]
    assert res["f1"] == pytest.approx({0.0: 0.0, 0.5: 2 / 3, 1.0: 1.0}[res["acc"]])
    from laserlm.evaluation.tasks import f1_score

    preds, gold = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]  # tp 2, fp 1, fn 1 -> 2*2 / (4 + 1 + 1)
    assert f1_score(preds, gold) == pytest.approx(4 / 6) and f1_score([0, 0], [0, 0]) == 0.0


# -- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--tasks", "piqa", "--data-dir", "/nonexistent/dir"], "data file for task 'piqa' not found: /nonexistent/dir"),
    (["--tasks", "squad"], "unknown task 'squad'"),
    (["--limit", "0"], "--limit must be a positive number"),
    (["--config", "nosuchmode:x=1"], "unknown mode 'nosuchmode'"),
    (["--stride", "600"], "--stride (600) cannot exceed --window (512)"),
    (["--config", "full@sparse:nosuch=1"], "unknown sparse attention option 'nosuch'"),
])
def test_cli_bad_input_one_line_exit_2(capsys, argv, message):
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("laserlm: error:") and message in err and "\n" not in err


def test_unrunnable_configuration_is_a_clear_error(smol):
    with pytest.raises(LaserLMError, match="configuration 'test_broken' cannot run on this model: RuntimeError"):
        Evaluator(smol, ["test_broken"])
    with pytest.raises(InvalidArgumentError, match="unknown mode"):
        Evaluator(smol, ["nosuchmode"])
    with pytest.raises(InvalidArgumentError, match="--limit"):
        Evaluator(smol, [], EvalSettings(limit=0)).run("piqa")


# -- lm-evaluation-harness adapter -------------------------------------------------------------------------
def test_lmeval_adapter_methods(smol, smol_ref):
    from laserlm.evaluation.lmeval_adapter import LaserLMHarness

    h = LaserLMHarness(smol, mode="test_copy")
    (lp_paris, greedy), (lp_bad, _) = h.loglikelihood([FakeInstance("The capital of France is", " Paris"),
                                                        FakeInstance("The capital of France is", " zxqv blorp")])
    assert greedy and lp_paris > lp_bad + 10
    text = "The quick brown fox jumps over the lazy dog."
    ids = [smol.tokenizer.eos_token_id] + smol.tokenizer(text)["input_ids"]  # SmolLM2 has a BOS-less tokenizer
    ids[0] = smol.tokenizer.bos_token_id if smol.tokenizer.bos_token_id is not None else ids[0]
    assert h.loglikelihood_rolling([FakeInstance(text)])[0] == pytest.approx(-_ref_nll(smol_ref, ids)[0], abs=2e-3)
    out = h.generate_until([FakeInstance("Count: one, two, three,", {"until": [","], "max_gen_toks": 10})])[0]
    assert "," not in out and out.strip()


def test_lmeval_harness_runs_a_local_task(smol, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from laserlm.evaluation.lmeval_adapter import LaserLMHarness

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    items = [{"question": "What is the capital of France?", "choices": ["Paris", "a purple refrigerator"], "label": 0},
             {"question": "How many legs does a dog have?", "choices": ["xq zvb wpl", "four"], "label": 1}]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (tmp_path / "task.yaml").write_text(
        "task: laserlm_local_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'items.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    res = lm_eval.simple_evaluate(model=LaserLMHarness(smol), tasks=["laserlm_local_mc"],
                                  task_manager=TaskManager(include_path=str(tmp_path)))
    assert res["results"]["laserlm_local_mc"]["acc,none"] == 1.0


def test_attention_part_of_a_configuration(smol, smol_ref):
    from laserlm.mode_table import split_config

    assert split_config("adaptive:a=1,b=2@sparse:threshold=0.5") == ("adaptive:a=1,b=2", "sparse:threshold=0.5")
    assert split_config("full") == ("full", None)
    eng = smol.engine
    before = eng.kernel
    ids = smol.tokenizer(TEXT * 3)["input_ids"]
    assert len(ids) >= 8 * 16  # 8+ key blocks of 16: above min_blocks (4), so the sparse paths run
    ref = _ref_logprob(smol_ref, ids, 1)  # dense attention, unmodified transformers model
    try:
        keep_all = Scorer(eng, "full@sparse:block_size=16,threshold=1e9,dense_layers=0")
        assert keep_all.kernel is not None and eng.kernel is before  # the engine is left as it was
        assert Scorer(eng, "full").kernel is None  # the reference is always dense
        r = keep_all.score([ids], [1])[0]
        assert all(keep_all.kernel.totals[layer]["prefill_calls"] == 1 for layer in range(eng.num_layers))
        assert keep_all.kernel.summary()["density"] == 1.0
        assert r.token_logprobs.numel() == len(ids) - 1
        assert r.logprob == pytest.approx(ref, abs=2e-3)  # every block kept: exact
        sc = Scorer(eng, "full@sparse:block_size=16")  # the default threshold rule skips blocks
        r = sc.score([ids], [1])[0]
        cfg = sc.kernel.config
        assert all(sc.kernel.totals[layer]["prefill_calls"] == 1 for layer in range(cfg.dense_layers, eng.num_layers))
        assert sc.kernel.summary()["density"] < 1.0
        assert torch.isfinite(r.token_logprobs).all() and abs(r.logprob - ref) > 1e-3  # skipped blocks do count
    finally:
        eng.kernel = before


# -- issue 18: log-likelihood at a merging join, rolling perplexity, short documents -----------------------
def _ref_logprob(ref, ids: list[int], start: int) -> float:
    """sum_t log p(ids[t] | ids[:t]) for t >= start, a hand-computed float64 log-softmax of the unmodified
    transformers model's logits."""
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].double(), -1)
    return sum(float(lp[t - 1, ids[t]]) for t in range(start, len(ids)))


@pytest.mark.parametrize("context, continuation", [("Ans", "wer"), ("hello wor", "ld")])
def test_loglikelihood_at_a_merging_join(smol, smol_ref, context, continuation):
    """SmolLM2 encodes "Answer" as one token: the joined encoding does not start with the context's, so the
    continuation is encoded on its own (lm-eval PR #4055) and scored after the context's tokens."""
    from laserlm.evaluation.lmeval_adapter import LaserLMHarness

    tok = smol.tokenizer
    ctx = tok(context)["input_ids"]
    assert tok(context + continuation)["input_ids"][:len(ctx)] != ctx or \
        len(tok(context + continuation)["input_ids"]) <= len(ctx), "not a merging join any more"
    want_ids = ctx + tok(continuation, add_special_tokens=False)["input_ids"]
    assert encode_pair(tok, context, continuation) == (want_ids, len(ctx))
    (lp, _), = LaserLMHarness(smol).loglikelihood([FakeInstance(context, continuation)])
    assert math.isfinite(lp)
    assert lp == pytest.approx(_ref_logprob(smol_ref, want_ids, len(ctx)), abs=2e-3)


class _SpacelessTokenizer:
    """SmolLM2's tokenizer on text with the spaces removed, as for a script written without spaces: the
    " " + choice continuation of a multiple-choice item then merges with the end of its context."""

    def __init__(self, tok):
        self._tok = tok

    def __call__(self, text, **kw):
        return self._tok(text.replace(" ", ""), **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_choice_task_scores_a_merging_join_like_the_harness(smol, smol_ref, tmp_path):
    """laserlm eval's multiple-choice scorer uses the same join rule: it runs (it raised "encodes to no
    tokens" before) and picks the choice a hand-computed log-softmax ranks first."""
    from types import SimpleNamespace

    tok = _SpacelessTokenizer(smol.tokenizer)
    items = [("The capital of France is Par", ["is", "rot", "ade"]), ("He gave the Ans", ["wer", "ible", "el"])]
    lines, expect_acc = [], []
    for ctx, endings in items:
        pairs = [(tok(ctx)["input_ids"], tok(" " + e, add_special_tokens=False)["input_ids"]) for e in endings]
        ll = [_ref_logprob(smol_ref, c + e, len(c)) for c, e in pairs]
        gold = max(range(3), key=ll.__getitem__)
        expect_acc.append(max(range(3), key=lambda i: ll[i] / len(endings[i])) == gold)  # acc_norm hit
        lines += [ctx, str(gold), *endings, endings[0]]  # HellaSwag format: 4 endings, a copy as the 4th
    (tmp_path / "hellaswag").mkdir()
    with bz2.open(tmp_path / "hellaswag" / "hellaswag_val_full.txt.bz2", "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    lm = SimpleNamespace(engine=smol.engine, tokenizer=tok)
    res = Evaluator(lm, [], EvalSettings(data_dir=str(tmp_path), progress=False)).run("hellaswag")["full"]
    assert res["n"] == 2 and res["acc"] == 1.0
    assert res["acc_norm"] == sum(expect_acc) / 2


def test_rolling_windows_equal_lm_eval_windows():
    """Against lm-eval's own functions: the same (context, continuation) pairs for every size."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from laserlm.evaluation.tasks import rolling_windows

    for n in range(0, 41):
        for max_len in range(1, 13):
            for context_len in range(1, max_len + 1):
                tokens = list(range(100, 100 + n))
                want = [tuple(map(list, make_disjoint_window(w)))
                        for w in get_rolling_token_windows(tokens, -1, max_len, context_len)]
                seq = [-1] + tokens
                got = [(seq[b:f], seq[f:e]) for b, e, f in rolling_windows(n, max_len, context_len)]
                assert got == want, (n, max_len, context_len)
                assert all(e - b - 1 <= max_len for b, e, _ in rolling_windows(n, max_len, context_len))
    with pytest.raises(InvalidArgumentError, match="context_len"):
        rolling_windows(10, 4, 5)


def test_loglikelihood_rolling_scores_every_token_once_with_context(smol, smol_ref):
    """A text of more than two context windows (64 tokens): the adapter's total equals lm-eval's rolling
    windows (from lm_eval.utils) scored with a hand-computed log-softmax of the transformers model."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from laserlm.api import LaserLM
    from laserlm.evaluation.lmeval_adapter import LaserLMHarness

    text = TEXT * 4
    tok = smol.tokenizer
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    assert len(tokens) > 2 * 64
    lm64 = LaserLM(smol.loaded, max_seq_len=64)
    got = LaserLMHarness(lm64).loglikelihood_rolling([FakeInstance(text)])[0]
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    want, scored = 0.0, 0
    for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(tokens, prefix, 64, 1)):
        want += _ref_logprob(smol_ref, ctx + cont, len(ctx))
        scored += len(cont)
    assert scored == len(tokens)
    assert got == pytest.approx(want, abs=5e-3)


def test_one_token_document_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "test.txt").write_text("Hello")
    assert main(["eval", "-t", "1", "--tasks", "wikitext", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("laserlm: error: wikitext: the text has 1 token(s)"), err


def test_wikitext_report_says_which_positions_are_scored(smol, wiki_dir):
    from laserlm.evaluation.report import markdown

    ids = smol.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    ev = Evaluator(smol, [], EvalSettings(data_dir=str(wiki_dir), window=16, progress=False))
    r = ev.run("wikitext")
    full = r["full"]
    assert full["text_tokens"] == len(ids) and full["tokens_scored"] == len(ids) - math.ceil(len(ids) / 16)
    assert "the first token of each window" in full["unscored"]
    assert f"{full['tokens_scored']} of {len(ids)} tokens scored; unscored: the first token of each window" \
        in markdown({"wikitext": r})
    ev.s.stride = 8  # sliding windows: every token but the text's first
    full = ev.run("wikitext")["full"]
    assert full["tokens_scored"] == len(ids) - 1 and full["unscored"] == "the first token of the text only (no BOS)"


@pytest.mark.slow
def test_gemma3_loglikelihood_at_a_merging_join():
    """Gemma3 encodes "foobar" as fo|obar: ("foo", "bar") must score "bar" after "foo", not "obar" after "fo"."""
    import laserlm
    from laserlm.evaluation.lmeval_adapter import LaserLMHarness

    lm = laserlm.load("gemma3-270m", dtype="float32")
    tok = lm.tokenizer
    ctx = tok("foo")["input_ids"]
    assert tok("foobar")["input_ids"][:len(ctx)] != ctx, "not a merging join any more"
    want_ids = ctx + tok("bar", add_special_tokens=False)["input_ids"]
    assert encode_pair(tok, "foo", "bar") == (want_ids, len(ctx))
    (lp, _), = LaserLMHarness(lm).loglikelihood([FakeInstance("foo", "bar")])
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(reference_dir(lm.loaded), dtype=torch.float32, attn_implementation="eager").eval()
    assert lp == pytest.approx(_ref_logprob(ref, want_ids, len(ctx)), abs=2e-3)
