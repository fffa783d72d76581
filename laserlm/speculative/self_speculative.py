"""Self-speculative decoding: the shallow path drafts, the full model verifies (the lossless mode).

Sources: LayerSkip (Elhoushi et al. 2024, self-speculation with an early-exit draft and reuse of the
draft's computation), Draft & Verify (Zhang et al. 2023, layer-skipping drafts, adaptive draft length
by confidence), SWIFT (Xia et al. 2024); the acceptance rule is the standard one of speculative
sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"). Loop structure after
gpt-fast's ``speculative_decode``.

One *cycle*, with ``L`` decoder layers, draft depth ``N`` and at most ``K`` drafted tokens, starting
with ``cur`` (the last emitted token, not yet in the KV cache) at position ``P``:

1. **Draft.** Feed ``cur`` through layers ``0..N-1`` (writing their K/V at ``P`` in the engine's one
   :class:`~laserlm.runtime.kv_cache.KVCache`), apply the exit head (final norm + LM head by default,
   or any callable ``hidden [B, T, d] -> logits [B, T, V]``, e.g. a calibrated exit head) and draw
   ``d1 ~ q0``; feed ``d1`` at ``P+1`` ... until ``K`` tokens are drafted or the draft's confidence
   (max softmax probability of the exit head) falls below ``threshold`` (adaptive draft length).
   The draft attends to the verified K/V of its own layers: no second cache.
2. **Verify.** Roll the cache back to ``P`` and run ``[cur, d1..dm]`` (``m <= K``) through the full
   model in one forward of ``m+1`` positions; this rewrites the K/V of the drafted positions. With
   ``reuse`` (default, LayerSkip's "exit query cache") the verify starts from the draft's layer-``N``
   hidden states and runs only layers ``N..L-1``; the draft's K/V for layers ``< N`` are exactly what
   the full model computes for those tokens, so they stay. (The draft then also feeds ``dm`` through
   layers ``< N``, which the verify would otherwise do.)
3. **Accept.** Greedy: keep the longest prefix of drafts equal to the full model's argmax, then the
   full model's correction (or bonus) token. Sampling: accept ``d_i`` with probability
   ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection draw from ``norm(max(0, p_i - q_i))``;
   if all are accepted draw the bonus token from ``p_m``. ``p`` and ``q`` are both processed by
   :func:`~laserlm.runtime.sampling.filter_logits` (temperature, top-k, top-p), so the emitted
   tokens are distributed exactly as full-depth sampling with the same settings.
4. **Roll back** the cache to ``P + accepted + 1`` (:meth:`Engine.truncate`).

Greedy output is token-for-token the full model's greedy output (up to float rounding of a
batched vs single-token forward, which never flipped a token in our tests); scoring is teacher-forced
full depth (the mode is lossless, so its logits *are* the full model's).

Spec: ``speculative:draft_layers=12,k=4,threshold=0.5[,reuse=1]``; ``draft_layers``, ``k`` and
``threshold`` also take ``auto`` (``auto=1`` sets every option not given to ``auto``): a short
calibration on local validation text picks them (see :mod:`laserlm.speculative.calibration`).

``laser=PATH`` drafts with the calibrated exit head (tuned-lens adapter + final norm + LM
head, :class:`laserlm.depth.heads.ExitHead`) stored in a laser file (``laserlm calibrate --output``)
at exactly the draft depth. Without ``draft_layers`` the draft depth is the file's exit point closest
to the default depth ``L // 2`` (the shallower one on a tie); a ``draft_layers`` for which the file
has no head is an error listing the file's exit layers (a head trained for another depth is not
used: its adapter maps another layer's hidden states). ``draft_layers=auto`` is not supported with
``laser=`` (the file fixes the candidate depths); ``k`` and ``threshold`` may still be ``auto``.

**Draft sources.** ``draft=`` names the sources joined by ``+`` in priority order (default
``layers``, the shallow path above): ``ngram`` (prompt lookup, Saxena 2023: the last ``n <= max_ngram``
tokens matched in the request's prompt and generated text), ``suffix`` (a bounded n-gram cache over earlier
requests of this mode object, after SuffixDecoding, Oliaro et al. 2024; ``suffix_tokens`` bounds it) and
``layers``. Lookup drafts are verified from layer 0 (there is no draft computation to reuse) and, when
sampling, accepted with the rule for deterministic drafts (``q = one-hot(d)``: accept with probability
``p(d)``, else sample from ``p`` without ``d``; :mod:`laserlm.speculative.proposers`). With ``adaptive`` (the
default when a lookup source is named) a per-step policy picks the source and the draft length that
maximise the expected tokens per unit of cost from the request's recent acceptance, and drafts nothing
(a plain full-depth step) when no draft is expected to pay; ``adaptive=0`` always drafts as much as the
first available source gives (``k`` tokens from the shallow path, the whole continuation up to ``k`` from a
lookup). Stats report cycles, drafted, accepted, emitted, tokens per verify and acceptance per source
(``by_source``; source ``none`` = plain steps). Example: ``speculative:draft=ngram+layers,max_ngram=3,k=16``.

**Draft head** (:mod:`laserlm.speculative.draft_head`). ``draft=head`` drafts with a trained EAGLE-style
head: one decoder layer that reads the target's last-layer feature of the last verified position and the embedding of
the token after it, and predicts the next feature; its logits cover only the ``k`` most frequent tokens (FR-Spec).
Drafts are a chain (no tree); the per-step policy prices ``m`` head drafts at ``m * head_cost + verify(m + 1)`` plain
steps and picks ``m`` from the request's acceptance; ``head_threshold`` stops a chain when the head's confidence falls
below it. Sampled drafts carry the head's distribution ``q`` (zero outside its vocabulary), so the usual acceptance
rule keeps the output distributed as the target's. ``head=PATH`` names a head file (``laserlm train-draft-head``);
without it a bundled model's shipped head is used. The head needs the last-layer features of every position, which
plain batched steps (more than ``batch_above`` speculating requests) do not give: after one, a request drafts from
lookup sources until a cycle of its own has run. Example: ``speculative:draft=head+ngram``.

**Loss budget.** ``loss_budget=B`` (plain steps; off by default: it refuses more gains than it saves; ``0`` or
``off`` disables it) bounds what drafts that do not pay can cost a request: a cycle may only draft lengths whose
predicted waste fits the request's bank, and the bank is settled with the *measured* cycle time over the
request's own plain-cycle time (:class:`~.policy.LossBudget`; the first decode step is a plain step that times
the reference). A request then runs at most ``B`` plain steps + 2 % slower than plain decoding (plus at most one
cycle's misprediction of the cost model). Stats: ``cost_steps`` (measured cost of the cycles, plain steps),
``predicted_steps`` (the cost model's), ``budget_refused`` / ``budget_shortened`` (cycles whose draft the budget
turned into a plain step / shortened) and ``loss_budget_left``. The budget is timing, so two runs may take
different drafts: greedy output is the same; seeded sampling then draws other, equally distributed, tokens
(``loss_budget=off`` for draft decisions that depend on the tokens only).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..errors import InvalidArgumentError
from ..runtime.modes import FullDepth, Mode, ScoreOutput
from ..runtime.options import is_int, is_number
from ..runtime.runner import Emitted
from .policy import (DEFAULT_LOSS_BUDGET, DEFAULT_VERIFY_BASE, DEFAULT_VERIFY_COST, DraftPolicy, LossBudget,
                     affordable, check_loss_budget, table_cost, verify_cost)
from .proposers import (DEFAULT_MAX_NGRAM, DEFAULT_MIN_MATCH, DEFAULT_SUFFIX_TOKENS, NgramIndex, SuffixCache,
                        check_ngram, check_suffix_tokens, parse_draft, propose_head, propose_shallow)
from .verify import accept

ExitHead = Callable[[torch.Tensor], torch.Tensor]  # hidden [B, T, d] -> logits [B, T, V]

MAX_K = 64
DEFAULT_K = 4
DEFAULT_LOOKUP_K = 16  # default k when a lookup source (ngram, suffix) drafts: copied spans are long
DEFAULT_THRESHOLD = 0.0
DEFAULT_HEAD_THRESHOLD = 0.0  # draft head: stop drafting below this confidence (0: the policy's length)
DEFAULT_HEAD_COST = 0.11  # one token drafted by the shipped SmolLM2 head (Q8_0), in plain native steps
DEFAULT_BATCH_ABOVE = 2  # more speculative requests than this decoding together take plain batched steps
LOOKUP = ("ngram", "suffix")


@dataclass
class SpeculativeStats:
    """Counters of one speculative generation (all cycles after the prefill).

    Attributes:
        cycles: draft-then-verify cycles (= full-depth verify forwards, plain steps included).
        drafted: drafted tokens sent to verification.
        accepted: drafted tokens accepted.
        emitted: tokens emitted by the cycles (accepted + one correction/bonus per cycle).
        draft_steps: single-token forwards through the draft layers.
        draft_s, verify_s: wall-clock seconds spent drafting (draft layers + exit head + sampling, or the
            n-gram / suffix lookup) and verifying (full-depth forward of the ``m+1`` positions + acceptance).
        prefill_s: seconds of the full-depth prompt forward (and first token).
        by_source: per draft source (``layers``, ``ngram``, ``suffix``; ``none`` = a plain full-depth step)
            ``{"cycles", "drafted", "accepted", "emitted"}``.
        cost_steps: with a loss budget, the cycles' measured cost in plain full-depth steps (cycle seconds over
            the request's plain-cycle time; ``emitted`` steps = par); 0 without.
        predicted_steps: the cost model's cost of the same cycles (plain steps); 0 without a loss budget.
        budget_refused: cycles the policy would have drafted but the loss budget left a plain step.
        budget_shortened: cycles whose draft the loss budget shortened.
    """

    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_steps: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    by_source: dict = field(default_factory=dict)
    cost_steps: float = 0.0
    predicted_steps: float = 0.0
    budget_refused: int = 0
    budget_shortened: int = 0

    def record(self, source: str, drafted: int, accepted: int) -> None:
        """Count one cycle of ``source`` (``none``: a plain step) in the totals and in ``by_source``."""
        self.cycles += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        c = self.by_source.setdefault(source, {"cycles": 0, "drafted": 0, "accepted": 0, "emitted": 0})
        c["cycles"] += 1
        c["drafted"] += drafted
        c["accepted"] += accepted
        c["emitted"] += accepted + 1

    def summary(self) -> dict:
        """Rates: ``acceptance_rate`` = accepted / drafted; ``mean_accepted_length`` = tokens emitted
        per verify forward including the correction/bonus token (EAGLE's tau; 1.0 = no gain); per source in
        ``by_source``: ``tokens_per_verify`` and ``acceptance_rate``. A rate with nothing to divide by (no draft,
        no cycle) is ``None`` (JSON ``null``; a bare NaN is not valid JSON)."""
        c, d = max(self.cycles, 1), max(self.drafted, 1)
        by_source = {}
        for name, s in self.by_source.items():
            by_source[name] = {**s,
                               "tokens_per_verify": round(s["emitted"] / max(s["cycles"], 1), 4),
                               "acceptance_rate": (round(s["accepted"] / s["drafted"], 4) if s["drafted"]
                                                   else None)}
        return {
            **asdict(self),
            "by_source": by_source,
            "acceptance_rate": round(self.accepted / d, 4) if self.drafted else None,
            "mean_accepted_length": round(self.emitted / c, 4) if self.cycles else None,
            "mean_drafted": round(self.drafted / c, 4) if self.cycles else None,
            "draft_fraction": round(self.draft_s / max(self.draft_s + self.verify_s, 1e-12), 4),
        }


class SpeculativeState(SpeculativeStats):
    """A request's state: its :class:`SpeculativeStats` (the dataclass fields, all that ``asdict`` and the
    summary see) plus the draft machinery: ``index`` (:class:`~.policy.NgramIndex` of prompt + output, or
    ``None`` without a lookup source), ``policy`` (:class:`~.policy.DraftPolicy`), ``head_fraction`` (the
    LM head's share of a full-depth step, from parameter counts, for the shallow draft's cost) and ``budget``
    (:class:`~.policy.LossBudget`, or ``None`` without a loss budget)."""

    def __init__(self, index: NgramIndex | None = None, policy: DraftPolicy | None = None,
                 head_fraction: float = 0.2, budget: LossBudget | None = None):
        super().__init__()
        self.index = index
        self.policy = policy or DraftPolicy()
        self.head_fraction = head_fraction
        self.budget = budget
        self.proposals: dict = {}  # the last choice's lookup proposals {policy key: first drafted token}
        self.head = None  # the draft head's HeadState (draft=head)


def head_fraction(engine) -> float:
    """The LM head's share of the weights one decoded token reads: ``V*d / (V*d + L * layer params)``, from
    the model config (0.2 when the config lacks the sizes)."""
    cfg = engine.config
    try:
        d, ffn, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        hd = getattr(cfg, "head_dim", None) or d // heads
        layer = 2 * d * heads * hd + 2 * d * kv * hd + 3 * d * ffn
        return float(v * d / (v * d + engine.num_layers * layer))
    except (AttributeError, TypeError, ZeroDivisionError):
        return 0.2


class SpeculativeDecoding(Mode):
    """The ``speculative`` decoding mode (see the module docstring for the algorithm).

    Sampling penalties and grammar constraints are refused (``samples_each_token``): drafts are accepted against
    the unchanged target distribution.

    Args:
        num_layers: decoder layers ``L`` of the engine's model (for validation).
        draft_layers: draft depth ``N``, in ``[1, L-1]``.
        k: maximum drafted tokens per cycle, in ``[1, 64]`` (default 4 for ``draft=layers``, else 16).
        threshold: adaptive draft length: stop drafting when the exit head's max probability is
            below it; in ``[0, 1]`` (0 = always draft ``k``).
        reuse: verify from the draft's layer-``N`` hidden states (runs layers ``N..L-1`` only).
        exit_head: ``hidden [B, T, d] -> logits [B, T, V]`` applied after layer ``N``; ``None`` = the
            model's final norm + LM head (:meth:`Engine.head`). A calibrated exit head (tuned lens)
            plugs in here.
        exit_head_name: label for stats.
        draft: draft sources in priority order, ``"ngram+suffix+layers"`` or a tuple of names (default
            ``"layers"``).
        max_ngram: longest n-gram matched by the lookup sources, in ``[1, 16]`` (default 3).
        min_match: shortest match that drafts, in ``[1, max_ngram]`` (default 1).
        adaptive: per-step policy for the source and draft length (default: on when a lookup source is
            named, off for ``draft=layers`` alone, which then always drafts ``k`` tokens).
        suffix_tokens: bound of the suffix cache in tokens, in ``[1, 2**26]`` (default 65536); the cache
            (:meth:`suffix_cache`, kept in ``engine.shared``) is shared by every request the engine runs with the
            same ``suffix_tokens`` and ``max_ngram``.
        verify_cost, verify_base: ``a`` and ``b`` of the verify cost model ``c(w) = 1 + b + a log2(w)``
            (``w >= 2``; the relative cost of a ``w``-position full-depth forward, :func:`~.policy.verify_cost`),
            numbers in ``[0, 16]`` (defaults 0.36 and 0.34, fitted on smollm2-135m on 1 CPU thread).
        ngram: a custom lookup-draft object with ``lookup(index, k, min_match) -> (n, tokens)`` (tests and
            experiments; default: the request's :class:`~.policy.NgramIndex` lookup).
        batch_above: under continuous batching (:mod:`laserlm.runtime.scheduler`), when more than this many
            requests of the mode decode at once, they take one plain batched full-depth step together instead of
            a draft + verify cycle each, in ``[1, 4096]`` (default 2). Each cycle is a forward of its own, so
            many speculating requests serialise; vLLM disables speculation above a batch size for the same
            reason (``speculative_disable_by_batch_size``). Output stays lossless: a plain step samples the full
            model's distribution.
        loss_budget: plain full-depth steps a request may lose to drafts that do not pay (module docstring,
            :class:`~.policy.LossBudget`), a number in ``[0, 64]`` or ``"off"`` (= 0, no budget); default ``None``:
            off (a first probe that misses overdraws the bank and ends drafting for the request, which costs more gains
            on grounded prompts than it saves).
        draft_head: a :class:`~.draft_head.DraftModel` (required when ``draft`` names ``head``); ``head_name`` labels
            it in the stats.
        head_threshold: stop a head draft when its max probability falls below this, in ``[0, 1]`` (default 0).
        head_cost: one head-drafted token in plain full-depth steps, in ``[0, 4]`` (default 0.11, measured with
            benchmarks/bench_draft_head.py on the shipped SmolLM2 head).
        clock: the seconds clock the loss budget times cycles with (default :func:`time.perf_counter`; tests
            pass a fake clock to make the budget deterministic).

    Raises:
        InvalidArgumentError: any option out of range or an unknown draft source.
    """

    name = "speculative"
    samples_each_token = False  # drafts are accepted, not sampled: no penalties, no grammar constraints
    rolls_back = True  # a verify writes every drafted position and keeps only the accepted ones

    def __init__(self, num_layers: int, draft_layers: int | None = None, k: int | None = None,
                 threshold: float = DEFAULT_THRESHOLD, reuse: bool = True, exit_head: ExitHead | None = None,
                 exit_head_name: str | None = None, draft="layers", max_ngram: int = DEFAULT_MAX_NGRAM,
                 min_match: int = DEFAULT_MIN_MATCH, adaptive: bool | None = None,
                 suffix_tokens: int = DEFAULT_SUFFIX_TOKENS, verify_cost: float = DEFAULT_VERIFY_COST,
                 verify_base: float = DEFAULT_VERIFY_BASE, ngram=None, batch_above: int = DEFAULT_BATCH_ABOVE,
                 loss_budget: float | str | None = None, clock: Callable[[], float] | None = None,
                 draft_head=None, head_name: str | None = None, head_threshold: float = DEFAULT_HEAD_THRESHOLD,
                 head_cost: float = DEFAULT_HEAD_COST):
        sources = parse_draft(draft)
        if "head" in sources and draft_head is None:
            raise InvalidArgumentError("draft=head needs a draft head (head=PATH, or a model that ships one; train "
                                       "one with `laserlm train-draft-head`)")
        if not isinstance(head_threshold, (int, float)) or not 0.0 <= head_threshold <= 1.0:
            raise InvalidArgumentError(f"head_threshold (draft head confidence) must be in [0, 1], got "
                                       f"{head_threshold!r}")
        if (not is_number(head_cost) or not 0.0 <= head_cost <= 4.0):
            raise InvalidArgumentError(f"head_cost (one drafted token of the head, in plain steps) must be a number "
                                       f"in [0, 4], got {head_cost!r}")
        self.draft_head = draft_head
        self.head_name = head_name
        self.head_threshold = float(head_threshold)
        self.head_cost = float(head_cost)
        if not is_int(batch_above) or not 1 <= batch_above <= 4096:
            raise InvalidArgumentError(f"batch_above (speculating requests in a batch before they take plain "
                                       f"batched steps) must be an integer in [1, 4096], got {batch_above!r}")
        self.batch_above = batch_above
        if k is None:
            k = DEFAULT_K if sources == ("layers",) else DEFAULT_LOOKUP_K
        if draft_layers is None:
            draft_layers = max(1, num_layers // 2)
        if not is_int(draft_layers) or not 1 <= draft_layers < num_layers:
            raise InvalidArgumentError(
                f"draft_layers must be an integer in [1, {num_layers - 1}] for this {num_layers}-layer model "
                f"(the draft must be shallower than the full model), got {draft_layers!r}")
        if not is_int(k) or not 1 <= k <= MAX_K:
            raise InvalidArgumentError(f"k (drafted tokens per cycle) must be an integer in [1, {MAX_K}], got {k!r}")
        if not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise InvalidArgumentError(f"threshold (draft confidence) must be in [0, 1], got {threshold!r}")
        if exit_head is not None and not callable(exit_head):
            raise InvalidArgumentError("exit_head must be a callable hidden [B, T, d] -> logits [B, T, V]")
        check_ngram(max_ngram, min_match)
        if loss_budget is not None:
            check_loss_budget(loss_budget)
        if (not is_number(verify_cost)
                or not 0.0 <= verify_cost <= 16.0):
            raise InvalidArgumentError(f"verify_cost (extra cost per doubling of the verify width) must be a "
                                       f"number in [0, 16], got {verify_cost!r}")
        if (not is_number(verify_base)
                or not 0.0 <= verify_base <= 16.0):
            raise InvalidArgumentError(f"verify_base (extra cost of a multi-position verify) must be a number in "
                                       f"[0, 16], got {verify_base!r}")
        if ngram is not None and not callable(getattr(ngram, "lookup", None)):
            raise InvalidArgumentError("ngram must have a lookup(index, k, min_match) -> (n, tokens) method")
        self.num_layers = num_layers
        self.draft_layers = draft_layers
        self.k = k
        self.threshold = float(threshold)
        self.reuse = bool(reuse)
        self.exit_head = exit_head
        self.exit_head_name = exit_head_name or ("lm_head" if exit_head is None else type(exit_head).__name__)
        self.draft = sources
        self.max_ngram = max_ngram
        self.min_match = min_match
        self.adaptive = any(s in (*LOOKUP, "head") for s in sources) if adaptive is None else bool(adaptive)
        self.loss_budget = DEFAULT_LOSS_BUDGET if loss_budget is None else check_loss_budget(loss_budget)
        self.clock = clock or time.perf_counter
        self.verify_cost = float(verify_cost)
        self.verify_base = float(verify_base)
        self.ngram = ngram
        self.suffix_tokens = check_suffix_tokens(suffix_tokens) if "suffix" in sources else None
        self.calibration: dict | None = None  # filled by the auto calibration
        self.verify_fit: dict | None = None  # verify_cost=auto's measurement, this machine's table, or the prior

    def suffix_cache(self, engine) -> SuffixCache | None:
        """The suffix cache of this mode's settings on ``engine`` (``None`` without the ``suffix`` source): one
        per engine, shared by every request it runs with these settings; it lives in ``engine.shared``, so the
        mode holds no request data."""
        if self.suffix_tokens is None:
            return None
        key = ("suffix_cache", self.suffix_tokens, self.max_ngram)
        if key not in engine.shared:
            engine.shared[key] = SuffixCache(self.suffix_tokens, self.max_ngram)
        return engine.shared[key]

    def config(self) -> dict:
        out = {"draft_layers": self.draft_layers, "k": self.k, "threshold": self.threshold,
               "reuse": self.reuse, "exit_head": self.exit_head_name, "batch_above": self.batch_above,
               "loss_budget": self.loss_budget}
        if self.draft != ("layers",):
            table = self.verify_fit is not None and "source" in self.verify_fit  # a table, not verify_cost=auto's fit
            out.update(draft="+".join(self.draft), max_ngram=self.max_ngram, min_match=self.min_match,
                       adaptive=self.adaptive, verify_cost=None if table else self.verify_cost,
                       verify_base=None if table else self.verify_base)  # None: priced by verify_fit's table
            if self.suffix_tokens is not None:
                out.update(suffix_tokens=self.suffix_tokens)
            if self.draft_head is not None:
                out.update(head=self.head_name, head_threshold=self.head_threshold, head_cost=self.head_cost)
        return out

    def _check_engine(self, engine) -> None:
        if engine.num_layers != self.num_layers:
            raise InvalidArgumentError(f"this speculative mode was built for a {self.num_layers}-layer model, "
                                       f"the engine has {engine.num_layers} layers")

    # -- the mode interface: per-request state is the request's SpeculativeState -----------------
    def new_state(self, engine, request=None) -> SpeculativeState:
        """Raises InvalidArgumentError: the engine's model has another number of layers than the mode's."""
        self._check_engine(engine)
        lookup = any(s in LOOKUP for s in self.draft)
        st = SpeculativeState(NgramIndex(self.max_ngram) if lookup else None, DraftPolicy(max_ngram=self.max_ngram),
                              head_fraction(engine))
        if self.draft_head is not None:
            from .draft_head import HeadState  # noqa: PLC0415

            st.head = HeadState()
        if self.loss_budget > 0:
            k = self.k if engine.fast_rows is None else min(self.k, engine.fast_rows - 1)  # what step() can draft
            longest = max(self._cost(st, src, k) for src in self.draft) - 1.0
            st.budget = LossBudget(self.loss_budget, self.loss_budget + 2 * longest)
        return st

    @torch.inference_mode()
    def prefill(self, engine, request) -> list[Emitted]:
        t0 = time.perf_counter()
        st = request.state
        if st.head is None:
            out = engine.prefill(request.prompt_ids.unsqueeze(0), cache=request.cache)
            cur = request.sample(out.logits[0, -1])
        else:  # the draft head needs the prompt's last-layer features
            p = request.prefilled
            ids = request.prompt_ids[p:]
            request.cache.crop(p)
            h, state = engine.begin(ids.unsqueeze(0), start=p, cache=request.cache)
            h = engine.run_layers(0, engine.num_layers, h, state)
            engine.commit(state)
            cur = request.sample(engine.head(h[:, -1:])[0, -1])
            st.head.add(h[0].float(), ids[1:].tolist() + [cur], p)
        request.state.prefill_s = time.perf_counter() - t0
        self._record_tokens(engine, request, request.prompt_ids.tolist() + [cur])
        return [Emitted(cur, engine.num_layers, {"kind": "prefill"})]

    def _record_tokens(self, engine, request, tokens: list[int]) -> None:
        st = request.state
        if st.index is not None:
            st.index.extend(tokens)
        suffix = self.suffix_cache(engine)
        if suffix is not None:
            suffix.extend(request.request_id, tokens)

    @torch.inference_mode()
    def step(self, engine, request) -> list[Emitted]:
        """One draft + verify cycle from ``request.last_token``. ``Emitted.layers`` is the cycle's sequential
        decoder-layer passes (draft steps x N + verify depth) divided by the tokens it emitted."""
        st = request.state
        cache = request.cache
        room = cache.max_len - cache.length - 1  # positions left after cur's
        k = max(min(self.k, request.remaining - 1, room), 0)
        if engine.fast_rows is not None:  # packed weights: a verify of more rows leaves the kernel (5-20x dearer)
            k = min(k, engine.fast_rows - 1)
        c0 = self.clock()
        t0 = time.perf_counter()
        if st.budget is not None and st.budget.plain_s is None:
            source, key, m, lookup = "none", None, 0, None  # the first decode step times the plain reference
        else:
            source, key, m, lookup = self._choose(engine, request, k)
        st.draft_s += time.perf_counter() - t0
        emitted, drafted, layers = self._cycle(engine, request, request.last_token, source, m, lookup)
        accepted = len(emitted) - 1
        st.record(source, drafted, accepted)
        if self.adaptive:
            observed = ({key_: tok == emitted[0] for key_, tok in st.proposals.items()} if drafted == 0 else None)
            st.policy.update(key, accepted, drafted, observed)
        st.proposals = {}
        self._record_tokens(engine, request, emitted)
        if st.budget is not None:
            predicted = self._cost(st, source, drafted)
            st.predicted_steps += predicted
            st.cost_steps += st.budget.settle(len(emitted), self.clock() - c0, predicted, plain=source == "none")
        out = []
        for i, tok in enumerate(emitted):
            kind = ("plain" if drafted == 0 else "accepted" if i < accepted
                    else "bonus" if accepted == drafted else "correction")
            out.append(Emitted(tok, layers / len(emitted),
                               {"cycle": st.cycles - 1, "drafted": drafted, "accepted": accepted, "kind": kind,
                                "source": source}))
        return out

    # -- continuous batching -----------------------------------------------------------------
    def batchable(self, engine) -> bool:
        """Whether :meth:`step_batch` applies (dense attention, as :class:`FullDepth`)."""
        return FullDepth().batchable(engine)

    @torch.inference_mode()
    def step_batch(self, engine, requests) -> list[list[Emitted]]:
        """One step of several requests of this mode (paged caches): a draft + verify cycle each while there are
        at most ``batch_above`` of them, else one plain batched full-depth forward (a ``none`` cycle each: no
        draft, the full model's token)."""
        if len(requests) <= self.batch_above:
            return [self.step(engine, r) for r in requests]
        rows = FullDepth().step_batch(engine, requests)
        for r, emitted in zip(requests, rows):
            st = r.state
            if st.head is not None:
                st.head.lost()  # no last-layer features from the batched step
            st.record("none", 0, 0)
            self._record_tokens(engine, r, [e.token_id for e in emitted])
            for e in emitted:
                e.info = {"cycle": st.cycles - 1, "drafted": 0, "accepted": 0, "kind": "plain", "source": "none"}
        return rows

    def _verify_cost(self, width: int) -> float:
        """Relative cost of a ``width``-position verify: the table of ``verify_fit`` when there is one
        (``verify_cost=auto``'s measurement, this machine's cached table, or the packed-weights prior;
        interpolated), else
        ``1 + verify_base + verify_cost * log2(width)``."""
        if self.verify_fit is not None:
            return table_cost(width, self.verify_fit["measured"])
        return verify_cost(width, self.verify_cost, self.verify_base)

    def _layers_cost(self, st, m: int) -> float:
        """Relative cost (a plain full-depth step = 1) of drafting ``m`` tokens with the shallow path and
        verifying ``m + 1`` positions."""
        h, f = st.head_fraction, self.draft_layers / self.num_layers
        steps = m + 1 if self.reuse else m
        c = self._verify_cost(m + 1)
        return steps * f * (1 - h) + m * h + ((1 - f) if self.reuse else 1.0) * (1 - h) * c + h * c

    def _cost(self, st, source: str, m: int) -> float:
        """Predicted relative cost (a plain step = 1) of a cycle drafting ``m`` tokens from ``source``."""
        if source == "none" or m < 1:
            return 1.0
        if source == "head":
            return m * self.head_cost + self._verify_cost(m + 1)
        return self._layers_cost(st, m) if source == "layers" else self._verify_cost(m + 1)

    def _choose(self, engine, request, k: int) -> tuple[str, str | None, int, list[int] | None]:
        """The cycle's ``(source, policy key, draft length, lookup tokens or None)``; ``("none", None, 0,
        None)``: a plain full-depth step. With a loss budget only lengths whose predicted waste ``C(m) - 1``
        fits the request's bank are drafted; the cycles where that changed the choice are counted in
        ``budget_refused`` / ``budget_shortened``."""
        if k < 1:
            return "none", None, 0, None
        st = request.state
        bank = st.budget.bank if st.budget is not None else float("inf")
        best = ("none", None, 0, None)
        best_gain, free_gain, free_m = 1.0, 1.0, 0  # free_*: the choice without the budget
        for src in self.draft:
            cost = lambda m, src=src: self._cost(st, src, m)  # noqa: E731
            if src == "layers":
                key, toks, max_m = "layers", None, k
            elif src == "head":
                if st.head.pending_feats is None:
                    continue
                key, toks, max_m = "head", None, k
            else:
                if src == "ngram":
                    finder = self.ngram.lookup if self.ngram is not None else (
                        lambda index, kk, mm: index.lookup(kk, mm))
                    n, toks = finder(st.index, k, self.min_match)
                else:
                    n, toks = self.suffix_cache(engine).lookup(st.index.tokens, k, self.min_match,
                                                       exclude=request.request_id)
                toks = [int(t) for t in toks[:k]]
                if n < 1 or not toks:
                    continue
                key, max_m = f"{src}/{n}", len(toks)
                st.proposals[key] = toks[0]  # observed for free if this cycle drafts nothing
            if not self.adaptive:  # the first source with a draft, as long as the budget allows
                m = affordable(max_m, cost, bank)
                self._count_budget(st, max_m, m)
                return (src, key, m, toks) if m >= 1 else ("none", None, 0, None)
            m, gain = st.policy.best_length(key, max_m, cost)
            if m >= 1 and gain > free_gain:
                free_gain, free_m = gain, m
            if m >= 1 and cost(m) - 1.0 > bank:
                m, gain = st.policy.best_length(key, max_m, cost, max_waste=bank)
            if m >= 1 and gain > best_gain:
                best, best_gain = (src, key, m, toks), gain
        self._count_budget(st, free_m, best[2])
        return best

    @staticmethod
    def _count_budget(st, wanted: int, allowed: int) -> None:
        if allowed < wanted:
            if allowed == 0:
                st.budget_refused += 1
            else:
                st.budget_shortened += 1

    def summary(self, request) -> dict:
        """``{"speculative": {config..., counters..., rates...}}`` (merged into ``GenerationResult.extra``)."""
        st = request.state
        out = {**self.config(), **st.summary()}
        out["loss_budget_left"] = round(st.budget.bank, 4) if st.budget is not None else None
        if self.calibration is not None:
            out["calibration"] = self.calibration
        if self.verify_fit is not None:
            out["verify_fit"] = self.verify_fit
        return {"speculative": out}

    @torch.inference_mode()
    def score(self, engine, input_ids: torch.Tensor) -> ScoreOutput:
        """Teacher-forced logits ``[T, V]``: speculative decoding is lossless, so these are the full
        model's (computed at full depth; ``layers`` = L for every position)."""
        return FullDepth().score(engine, input_ids)

    def _cycle(self, engine, request, cur: int, source: str, k: int,
               lookup: list[int] | None) -> tuple[list[int], int, float]:
        """One draft + verify cycle from ``cur``; returns (emitted tokens, drafted count, layer passes).

        ``source`` ``layers``: draft up to ``k`` tokens with the shallow path; ``ngram`` / ``suffix``: the
        first ``k`` of ``lookup`` (deterministic drafts); ``none``: no draft (a plain full-depth step)."""
        params, st, cache, gen = request.params, request.state, request.cache, request.generator
        n_draft, n_layers = self.draft_layers, engine.num_layers
        start = cache.length
        # 1. draft: step j feeds x_j (x_0 = cur) at start + j through layers < N
        t0 = time.perf_counter()
        steps = 0
        reuse = False
        q_probs: list[torch.Tensor] | None = None  # None: deterministic drafts (q = one-hot)
        if source == "layers" and k > 0:
            drafts, q_probs, hiddens, steps = propose_shallow(engine, request, cur, k, self.draft_layers,
                                                              self.exit_head or engine.head, self.reuse,
                                                              self.threshold)
            reuse = self.reuse
        elif source == "head" and k > 0:
            drafts, q_probs = propose_head(engine, request, k, self.draft_head, self.head_threshold)
        else:
            drafts = list(lookup[:k]) if lookup is not None else []
        m = len(drafts)
        t1 = time.perf_counter()
        # 2. verify [cur, d1..dm] at full depth (positions start .. start+m), rewriting the drafted positions
        h_in, state = engine.begin(torch.tensor([[cur] + drafts]), start=start, cache=cache)
        if reuse:
            h = engine.run_layers(n_draft, n_layers, torch.cat(hiddens[: m + 1], dim=1), state)
        else:
            h = engine.run_layers(0, n_layers, h_in, state)
        engine.commit(state)
        p_logits = engine.head(h)[0]  # [m+1, V]
        # 3. accept (the lossless rule, :func:`.verify.accept`)
        a, last = accept(p_logits, drafts, q_probs, params, gen)
        # 4. roll back rejected positions: keep cur and the accepted drafts
        engine.truncate(start + a + 1, cache=cache)
        if st.head is not None:  # true features of the kept positions, with the tokens that followed them
            st.head.add(h[0, :a + 1].float(), drafts[:a] + [last], start)
        t2 = time.perf_counter()
        st.draft_steps += steps
        st.draft_s += t1 - t0
        st.verify_s += t2 - t1
        layers = steps * n_draft + (n_layers - n_draft if reuse else n_layers)
        return drafts[:a] + [last], m, float(layers)

__all__ = ["SpeculativeDecoding", "SpeculativeState", "SpeculativeStats", "head_fraction", "ExitHead"]
