"""Quality metrics for decoding modes, always next to the full-depth reference.

- ``wikitext``: perplexity = exp(mean token NLL) over WikiText-2 test, in non-overlapping windows
  (``stride == window``) or sliding windows (Hugging Face perplexity guide: each window of ``window``
  tokens scores only its last ``stride`` tokens, the rest is context). Which positions are scored is
  exact in :func:`text_windows` and in the report (``tokens_scored`` of ``text_tokens``, ``unscored``):
  without a BOS token (SmolLM2) non-overlapping windows leave each window's first token unscored, sliding
  windows only the text's first token. Also top-1 agreement with the full-depth model on the scored positions.
- ``lambada``: last-word accuracy (all target tokens are the greedy prediction, lm-eval ``is_greedy``)
  and target perplexity ``exp(-mean_item(log p(target)))`` (lm-eval ``lambada_openai``).
- ``hellaswag``, ``arc_easy``, ``piqa``: lm-eval multiple choice: ``acc`` = argmax of the summed
  log-likelihood of each continuation, ``acc_norm`` = argmax of log-likelihood / characters of the
  choice; standard errors ``sqrt(p(1-p)/(n-1))`` (lm-eval ``mean_stderr``).
- ``sst2``, ``rte``, ``mrpc``, ``qnli``: GLUE dev sets, zero-shot with lm-eval's ``glue`` prompts
  (:data:`~laserlm.evaluation.data.GLUE`): ``acc`` as above (one-word choices, so ``acc_norm`` adds nothing); ``mrpc``
  also ``f1`` of the ``yes`` class (lm-eval's metric list). Choice tasks also report ``seconds``: the wall time of
  scoring the items under that configuration.
- ``agreement``: greedy top-1 agreement per position with the full model on WikiText-2 windows, and
  exact match / longest common prefix (tokens) of greedy generations on a prompt set.
- ``longtext``: one long document (the Gutenberg novel, ``long_tokens`` tokens in one sequence): top-1
  agreement with full depth and NLL gap as a function of position, their decay per 1k tokens and the
  long-text consistency score (agreement past position 2048); see :mod:`laserlm.evaluation.longtext`.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import InvalidArgumentError, LaserLMError
from ..mode_table import make_mode
from .data import ChoiceItem, load_task
from .scoring import Scorer, encode_pair

TASKS = ("wikitext", "lambada", "hellaswag", "arc_easy", "piqa", "sst2", "rte", "mrpc", "qnli", "agreement", "longtext")
CHOICE_TASKS = ("hellaswag", "arc_easy", "piqa", "sst2", "rte", "mrpc", "qnli")  # scored by _run_choice_task
REFERENCE = "full"


def select(n: int, limit: int | None, seed: int) -> list[int]:
    """Indices of the items to evaluate: all of them, or ``limit`` drawn with ``random.Random(seed)`` (sorted).

    Raises:
        InvalidArgumentError: ``limit < 1``.
    """
    if limit is not None and limit < 1:
        raise InvalidArgumentError(f"--limit must be a positive number of items, got {limit}")
    if limit is None or limit >= n:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), limit))


def f1_score(preds: list[int], gold: list[int], positive: int = 1) -> float:
    """F1 of class ``positive`` (sklearn's ``f1_score`` for binary labels, which lm-eval's ``f1`` calls): ``2 tp /
    (2 tp + fp + fn)``; 0.0 when the class is neither predicted nor present."""
    tp = sum(p == positive and g == positive for p, g in zip(preds, gold))
    fp = sum(p == positive and g != positive for p, g in zip(preds, gold))
    fn = sum(p != positive and g == positive for p, g in zip(preds, gold))
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def stderr_of_mean(p: float, n: int) -> float:
    """Standard error of a proportion ``p`` over ``n`` items, ``sqrt(p(1-p)/(n-1))`` (lm-eval)."""
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")


def text_windows(n_tokens: int, window: int, stride: int, has_prefix: bool) -> list[tuple[int, int, int]]:
    """``(begin, end, score_from)`` windows over ``n_tokens`` text tokens (Hugging Face perplexity guide).

    Window ``k`` feeds the text tokens ``[begin, end)`` (``begin = k * stride``, at most ``window`` of them,
    after the BOS prefix when ``has_prefix``) and scores the positions ``[score_from, end)``: those no earlier
    window scored, except a window's first token when nothing precedes it in the window. Exactly:

    - with a BOS prefix, every text token is scored exactly once;
    - without one (SmolLM2), ``stride == window`` (non-overlapping windows, the guide's convention) leaves the
      first token of **every** window unscored: ``ceil(n_tokens / window)`` positions (e.g. 1637 of 1640
      tokens scored with ``window=512``), each window starting without context;
    - without one and ``stride < window`` (sliding windows, the documented way to score every token), only
      text token 0 is unscored, and every later token has at least ``window - stride`` tokens of context.

    Returns an empty list when no position can be scored (no tokens, or one token without a prefix).

    Raises:
        InvalidArgumentError: ``window < 2`` or ``stride`` outside ``1..window``.
    """
    if window < 2:
        raise InvalidArgumentError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise InvalidArgumentError(f"stride must be between 1 and the window ({window}), got {stride}")
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        score_from = max(prev_end, begin + (0 if has_prefix else 1))
        if score_from < end:
            out.append((begin, end, score_from))
        prev_end = end
        if end == n_tokens:
            break
    return out


def rolling_windows(n_tokens: int, max_len: int, context_len: int = 1) -> list[tuple[int, int, int]]:
    """lm-eval's rolling log-likelihood windows as ``(begin, end, score_from)`` index triples into
    ``seq = [prefix] + tokens`` (``n_tokens + 1`` entries; ``prefix`` is the BOS or EOS token).

    The same windows as ``lm_eval.utils.get_rolling_token_windows(tokens, prefix, max_len, context_len)``
    mapped through ``make_disjoint_window`` (what lm-eval's ``HFLM.loglikelihood_rolling`` scores, with
    ``context_len=1``): feed ``seq[begin:end - 1]`` (at most ``max_len`` tokens) and score ``seq[score_from:end]``.
    Every text token is scored exactly once; the first window is conditioned on the prefix, every later one
    on the text tokens just before it (at least ``context_len`` of them; the last, shorter window on up to
    ``max_len`` of them).

    Raises:
        InvalidArgumentError: ``max_len < 1`` or ``context_len`` outside ``1..max_len``.
    """
    if max_len < 1:
        raise InvalidArgumentError(f"the rolling window must hold at least 1 token, got {max_len}")
    if not 1 <= context_len <= max_len:
        raise InvalidArgumentError(f"context_len must be between 1 and {max_len}, got {context_len}")
    if n_tokens <= 0:
        return []
    first = min(max_len, n_tokens)
    out, predicted = [(0, first + 1, 1)], first
    pred_len = max_len - context_len + 1
    while predicted < n_tokens:
        end = predicted + min(n_tokens - predicted, pred_len)
        # lm-eval feeds tokens[end - max_len - 1 : end - 1]; after make_disjoint_window its context is
        # tokens[end - max_len - 1 : predicted] and its continuation tokens[predicted : end] (+1 for the prefix)
        out.append((end - max_len, end + 1, predicted + 1))
        predicted = end
    return out


def unscored_positions(has_prefix: bool, non_overlapping: bool) -> str:
    """Which text positions :func:`text_windows` leaves unscored, in words (for the report)."""
    if has_prefix:
        return "none (each window starts with BOS)"
    if non_overlapping:
        return "the first token of each window (no BOS; use --stride < --window to score every later token)"
    return "the first token of the text only (no BOS)"


@dataclass
class EvalSettings:
    """Options of one evaluation run (see ``laserlm eval --help``)."""

    data: str | None = None  # data directory, one task's file, or hf:NAME[:CONFIG[:SPLIT]] (laserlm.data)
    limit: int | None = None
    seed: int = 0
    window: int = 512
    stride: int | None = None  # None = window (non-overlapping)
    ppl_windows: int | None = None  # None = the whole file
    agreement_windows: int = 8
    gen_tokens: int = 32
    long_tokens: int = 4096  # tokens of the long document (longtext), capped at the context size + 1
    prompts: str | None = None  # path of a prompts jsonl; None = the bundled set
    chat: bool | None = None  # None = use the chat template when the tokenizer has one
    progress: bool = True
    data_dir: str | None = None  # older name of ``data`` (used when ``data`` is not given)

    def __post_init__(self):
        if self.data is None and self.data_dir is not None:
            self.data = str(self.data_dir)
        self.data_dir = None


class Evaluator:
    """Runs quality tasks for several decoding modes of one loaded model.

    Args:
        lm: a :class:`laserlm.LaserLM` (on laserlm's engine or on the onnxruntime engine of an export).
        specs: mode specs (or objects); the full-depth reference ``"full"`` is always added first.
        settings: :class:`EvalSettings`.

    Each configuration is scored by a :class:`~laserlm.evaluation.scoring.Scorer` on ``lm.engine`` and run on a few
    tokens first (:func:`check_runnable`).

    Raises:
        InvalidArgumentError: unknown mode or bad options.
        LaserLMError: a configuration that cannot run on this model (checked on a few tokens up front).
    """

    def __init__(self, lm, specs, settings: EvalSettings | None = None):
        self.lm = lm
        self.s = settings or EvalSettings()
        names = [REFERENCE] + [s for s in specs if s != REFERENCE]
        resolve = getattr(lm, "resolve_spec", None)  # bare adaptive/speculative -> the calibrated default (api)
        self.scorers = {n: Scorer(lm.engine, resolve(n) if resolve and isinstance(n, str) else n)
                        for n in dict.fromkeys(names)}
        self.max_seq_len = self.scorers[REFERENCE].max_seq_len
        self._argmax_cache: dict[tuple[str, int], torch.Tensor] = {}
        for name in self.scorers:
            if name != REFERENCE:
                self.scorers[name].activate()
                check_runnable(lm, name, self.scorers[name].mode)

    @property
    def names(self) -> list[str]:
        return list(self.scorers)

    def _bar(self, it, desc, total=None):
        return tqdm(it, desc=desc, total=total, disable=not self.s.progress, leave=False, dynamic_ncols=True)

    def run(self, task: str) -> dict:
        """Metrics of ``task`` for every configuration: ``{config: {metric: value}}``.

        Raises:
            InvalidArgumentError: unknown task.
            DataFileError: its data file is missing or malformed.
        """
        if task not in TASKS:
            raise InvalidArgumentError(f"unknown task '{task}'; available tasks: {', '.join(TASKS)}")
        if task in CHOICE_TASKS:
            return self._run_choice_task(task)
        return getattr(self, f"_run_{task}")()

    # -- perplexity ------------------------------------------------------------------------------
    def _wikitext_windows(self, max_windows: int | None):
        tok = self.lm.tokenizer
        text = load_task("wikitext", self.s.data)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        prefix = tok("")["input_ids"]  # the special tokens the tokenizer adds by default (Gemma: <bos>)
        window = min(self.s.window, self.max_seq_len - len(prefix) + 1)
        stride = self.s.stride or window
        wins = text_windows(len(ids), window, stride, bool(prefix))
        if not wins:
            from .data import DataFileError  # noqa: PLC0415

            raise DataFileError(
                f"wikitext: the text has {len(ids)} token(s) and this tokenizer adds no BOS, so no token can be "
                "scored; perplexity needs at least 2 tokens")
        if max_windows is not None:
            wins = wins[:max_windows]
        return ids, prefix, window, stride, wins

    def _score_windows(self, name, ids, prefix, wins, desc):
        sc = self.scorers[name]
        nll, n, layers, argmax = 0.0, 0, 0.0, []
        entries = [(w, [prefix + ids[b:e]], [len(prefix) + f - b]) for w, (b, e, f) in enumerate(wins)]
        for w, (r,) in self._bar(self._grouped_scores(sc, entries), desc, total=len(wins)):
            nll -= float(r.token_logprobs.sum())
            n += r.token_logprobs.numel()
            layers += float(r.layers.sum())
            argmax.append(r.argmax)
            self._argmax_cache[(name, w)] = r.argmax
        return nll, n, layers, argmax

    def _run_wikitext(self) -> dict:
        if self.s.ppl_windows is not None and self.s.ppl_windows < 1:
            raise InvalidArgumentError(f"--ppl-windows must be positive, got {self.s.ppl_windows}")
        ids, prefix, window, stride, wins = self._wikitext_windows(self.s.ppl_windows)
        results, ref_argmax = {}, None
        for name in self.names:
            nll, n, layers, argmax = self._score_windows(name, ids, prefix, wins, f"wikitext [{name}]")
            all_argmax = torch.cat(argmax)
            if ref_argmax is None:
                ref_argmax = all_argmax
            results[name] = {
                "perplexity": math.exp(nll / n), "nll_per_token": nll / n, "tokens_scored": n,
                "windows": len(wins), "window": window, "stride": stride,
                "method": "non-overlapping" if stride == window else "sliding",
                "bos_prefix": bool(prefix), "text_tokens": len(ids) if self.s.ppl_windows is None else wins[-1][1],
                "unscored": unscored_positions(bool(prefix), stride == window),
                "top1_agreement": float((all_argmax == ref_argmax).double().mean()),
                "mean_layers": layers / n,
            }
        return results

    # -- long text -------------------------------------------------------------------------------
    def _run_longtext(self) -> dict:
        from .longtext import LONG_FROM, long_text_metrics  # noqa: PLC0415

        if self.s.long_tokens < 3:
            raise InvalidArgumentError(f"--long-tokens must be >= 3, got {self.s.long_tokens}")
        tok = self.lm.tokenizer
        n = min(self.s.long_tokens, self.max_seq_len + 1)
        ids = tok(load_task("longtext", self.s.data))["input_ids"][:n]
        if len(ids) < 3:
            raise InvalidArgumentError(f"the long document has only {len(ids)} tokens")
        scores, results = {}, {}
        for name in self._bar(self.names, "longtext"):
            scores[name] = self.scorers[name].score([ids], [1])[0]
        ref = scores[REFERENCE]
        for name, r in scores.items():
            agree = (r.argmax == ref.argmax).double()
            gap = ref.token_logprobs - r.token_logprobs  # NLL_config - NLL_full
            m = long_text_metrics(agree, gap)
            m.update({"perplexity": math.exp(-float(r.token_logprobs.mean())), "tokens": len(ids),
                      "mean_layers": float(r.layers.mean()), "long_from": LONG_FROM})
            results[name] = m
        return results

    # -- multiple choice -------------------------------------------------------------------------
    def _run_choice_task(self, task: str) -> dict:
        items: list[ChoiceItem] = load_task(task, self.s.data)
        idx = select(len(items), self.s.limit, self.s.seed)
        encoded = []
        for i in idx:
            it = items[i]
            pairs = [encode_pair(self.lm.tokenizer, it.context, " " + c) for c in it.choices]
            encoded.append((it, [p[0] for p in pairs], [p[1] for p in pairs]))
        results, ref_pred = {}, None
        for name in self.names:
            sc = self.scorers[name]
            preds, preds_norm, correct, correct_norm, layers, ntok = [], [], 0, 0, 0.0, 0
            t0 = time.perf_counter()
            for it, scores in self._bar(self._grouped_scores(sc, encoded), f"{task} [{name}]", total=len(encoded)):
                ll = [s.logprob for s in scores]
                lln = [x / max(len(c), 1) for x, c in zip(ll, it.choices)]
                p, pn = max(range(len(ll)), key=ll.__getitem__), max(range(len(lln)), key=lln.__getitem__)
                preds.append(p)
                preds_norm.append(pn)
                correct += p == it.gold
                correct_norm += pn == it.gold
                layers += sum(float(s.layers.sum()) for s in scores)
                ntok += sum(s.layers.numel() for s in scores)
            n = len(encoded)
            if ref_pred is None:
                ref_pred = preds
            acc, acc_norm = correct / n, correct_norm / n
            results[name] = {"acc": acc, "acc_stderr": stderr_of_mean(acc, n), "acc_norm": acc_norm,
                             "acc_norm_stderr": stderr_of_mean(acc_norm, n),
                             "choice_agreement": sum(a == b for a, b in zip(preds, ref_pred)) / n,
                             "n": n, "of": len(items), "mean_layers": layers / max(ntok, 1),
                             "seconds": round(time.perf_counter() - t0, 3)}
            if task == "mrpc":
                results[name]["f1"] = f1_score(preds, [it.gold for it, _, _ in encoded], positive=1)
        return results

    @staticmethod
    def _grouped_scores(sc, encoded):
        """Yield ``(item, scores of its choices)``; the choices of several items go to the scorer in one call
        when it batches (``sc.batch_rows`` sequences)."""
        group: list = []
        for entry in encoded + [None]:
            if entry is not None:
                group.append(entry)
            rows = sum(len(seqs) for _, seqs, _ in group)
            if group and (entry is None or rows >= sc.batch_rows):
                scores = sc.score([q for _, seqs, _ in group for q in seqs], [x for _, _, st in group for x in st])
                for it, seqs, _ in group:
                    yield it, scores[:len(seqs)]
                    scores = scores[len(seqs):]
                group = []

    # -- lambada ---------------------------------------------------------------------------------
    def _run_lambada(self) -> dict:
        items = load_task("lambada", self.s.data)
        idx = select(len(items), self.s.limit, self.s.seed)
        encoded = [encode_pair(self.lm.tokenizer, items[i].context, items[i].target) for i in idx]
        results, ref_pred = {}, None
        for name in self.names:
            sc = self.scorers[name]
            lls, hits, preds, layers, ntok = [], 0, [], 0.0, 0
            grouped = self._grouped_scores(sc, [(None, [seq], [start]) for seq, start in encoded])
            for _, (r,) in self._bar(grouped, f"lambada [{name}]", total=len(encoded)):
                lls.append(r.logprob)
                hits += r.greedy
                preds.append(r.argmax)
                layers += float(r.layers.sum())
                ntok += r.layers.numel()
            n = len(encoded)
            if ref_pred is None:
                ref_pred = preds
            acc = hits / n
            results[name] = {"acc": acc, "acc_stderr": stderr_of_mean(acc, n),
                             "perplexity": math.exp(-sum(lls) / n),
                             "prediction_agreement": sum(bool(torch.equal(a, b)) for a, b in zip(preds, ref_pred)) / n,
                             "n": n, "of": len(items), "mean_layers": layers / max(ntok, 1)}
        return results

    # -- agreement -------------------------------------------------------------------------------
    def _run_agreement(self) -> dict:
        ids, prefix, window, stride, wins = self._wikitext_windows(self.s.agreement_windows)
        argmax = {}
        for name in self.names:
            cached = [self._argmax_cache.get((name, w)) for w in range(len(wins))]
            if all(c is not None for c in cached):
                argmax[name] = torch.cat(cached)
            else:
                argmax[name] = torch.cat(self._score_windows(name, ids, prefix, wins, f"agreement [{name}]")[3])
        prompts = load_prompts(self.s.prompts)
        if self.s.limit is not None:
            prompts = [prompts[i] for i in select(len(prompts), self.s.limit, self.s.seed)]
        chat = self.s.chat if self.s.chat is not None else bool(getattr(self.lm.tokenizer, "chat_template", None))
        gens = {}
        for name in self.names:
            mode = self.scorers[name].mode
            self.scorers[name].activate()
            gens[name] = [self.lm.generate(p, chat=chat, mode=mode, max_new_tokens=self.s.gen_tokens,
                                           temperature=0.0).token_ids
                          for p in self._bar(prompts, f"generate [{name}]")]
        ref, ref_gen = argmax[REFERENCE], gens[REFERENCE]
        results = {}
        for name in self.names:
            lcps = [common_prefix(a, b) for a, b in zip(gens[name], ref_gen)]
            results[name] = {
                "top1_agreement": float((argmax[name] == ref).double().mean()), "positions": int(ref.numel()),
                "gen_exact_match": sum(a == b for a, b in zip(gens[name], ref_gen)) / len(ref_gen),
                "gen_mean_lcp_tokens": sum(lcps) / len(lcps),
                "gen_mean_lcp_fraction": sum(c / max(len(b), 1) for c, b in zip(lcps, ref_gen)) / len(lcps),
                "prompts": len(prompts), "gen_tokens": self.s.gen_tokens, "chat": chat, "window": window,
            }
        return results


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def load_prompts(path: str | None = None) -> list[str]:
    """Prompts for generation agreement: a jsonl of ``{"prompt": ...}`` (default: the bundled 16 questions).

    Raises:
        DataFileError: missing or malformed file.
    """
    from .data import DataFileError  # noqa: PLC0415

    try:
        text = Path(path).read_text(encoding="utf-8") if path else \
            resources.files("laserlm.evaluation").joinpath("prompts.jsonl").read_text(encoding="utf-8")
    except OSError as exc:
        raise DataFileError(f"cannot read prompt file {path}: {exc}") from exc
    try:
        prompts = [json.loads(ln)["prompt"] for ln in text.splitlines() if ln.strip()]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataFileError(f"{path}: each line must be a JSON object with a 'prompt' string") from exc
    if not prompts:
        raise DataFileError(f"{path}: no prompts")
    return prompts


def check_runnable(lm, spec: str, mode=None) -> None:
    """Run ``spec`` on a few tokens (score and two generated tokens) so a configuration that cannot run
    on this model fails up front with one clear line.

    Raises:
        InvalidArgumentError: unknown mode / bad options (from :func:`make_mode`).
        LaserLMError: the configuration raised while running.
    """
    from ..runtime.loop import generate_tokens  # noqa: PLC0415
    from ..runtime.sampling import SamplingParams  # noqa: PLC0415

    mode = mode if mode is not None else make_mode(spec, lm.engine)
    ids = torch.tensor(lm.tokenizer("The quick brown fox jumps over")["input_ids"], dtype=torch.long)
    try:
        with torch.inference_mode():
            out = mode.score(lm.engine, ids)
            if tuple(out.logits.shape[:1]) != (ids.shape[0],):
                raise ValueError(f"score() returned logits of shape {tuple(out.logits.shape)} for {ids.shape[0]} tokens")
            for _ in generate_tokens(lm.engine, mode, ids, SamplingParams(max_new_tokens=2), 2):
                pass
    except LaserLMError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a plug-in mode becomes one clear line
        raise LaserLMError(f"configuration '{spec}' cannot run on this model: {type(exc).__name__}: {exc}") from exc
