"""Lookup drafts in the speculative mode (issue #15): n-gram / prompt lookup, the bounded suffix cache, the
per-step source policy, the deterministic-draft sampling rule.

References are independent of the speculative code path (as in ``test_speculative``): greedy text is
``model.generate``-style greedy decoding of an unmodified transformers model; sampling is checked against
the full model's exact marginals of tokens 1..4 (enumerated over a 16-token vocabulary) with the chi-square
test at ALPHA = 1e-3; EOS / stop / ``max_tokens`` against ``mode="full"``.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from laserlm.errors import InvalidArgumentError
from laserlm.mode_table import make_mode
from laserlm.runtime import Engine
from laserlm.runtime.loop import generate_tokens
from laserlm.runtime.sampling import SamplingParams, probabilities
from laserlm.speculative import SpeculativeDecoding
from laserlm.speculative.policy import BUDGET_EPS, DraftPolicy, LossBudget, affordable, expected_tokens, verify_cost
from laserlm.speculative.proposers import NgramIndex, SuffixCache
from test_speculative import (ALPHA, _prompt_ids, _reference, chi2_pvalue, exact_marginals, hf_greedy,
                              one_thread, tiny_model)  # noqa: F401  (one_thread is a fixture)

PASSAGE = ("The Valkyria Chronicles III is a tactical role-playing video game developed by Sega and "
           "Media.Vision for the PlayStation Portable. Released in January 2011 in Japan, it is the third "
           "game in the Valkyria series.")
COPY_PROMPT = f"Text: {PASSAGE}\nRepeat the text exactly.\nText: The Valkyria Chronicles III is"


# -- units: index, cache, policy, options ----------------------------------------------------------
def test_ngram_index_finds_the_longest_most_recent_match():
    idx = NgramIndex(3, [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    assert idx.lookup(3) == (2, [7, 5, 2])  # "2 3" last seen before at 5..6 -> 7 5 2 ...
    assert idx.lookup(9) == (2, [7, 5, 2, 3, 7, 5, 2, 3, 7])  # ... repeated past the sequence end
    idx.extend([4])
    assert idx.lookup(4) == (0, [])  # 4 never seen
    idx = NgramIndex(3, [5, 6, 7, 1, 6, 7])
    assert idx.lookup(2) == (2, [1, 6])
    assert idx.lookup(2, min_match=3) == (0, [])
    idx = NgramIndex(2, [8, 8, 8])
    assert idx.lookup(5) == (2, [8] * 5)  # overlapping self-match: the period-1 pattern repeats


def test_suffix_cache_never_grows_past_its_bound():
    rng = random.Random(0)
    cache = SuffixCache(max_tokens=200, max_ngram=3)
    for r in range(60):
        rid = f"r{r}"
        for _ in range(rng.randint(1, 6)):
            cache.extend(rid, [rng.randrange(20) for _ in range(rng.randint(1, 40))])
            assert len(cache) <= 200
            assert cache.index_entries() <= 3 * 200
            assert len(cache) == sum(len(s) for s in cache._seqs.values())
            for m in cache._maps:  # every index entry points into a stored sequence
                for key, (sid, e) in m.items():
                    seq = cache._seqs[sid]
                    assert e + 1 < len(seq) and tuple(seq[e - len(key) + 1:e + 1]) == key
    big = SuffixCache(max_tokens=10, max_ngram=2)
    big.extend("a", range(25))
    assert len(big) == 10 and big.sequences() == 1
    big.extend("b", [1, 2, 3])
    assert len(big) == 3 and big.sequences() == 1  # "a" evicted


def test_suffix_cache_drafts_from_earlier_requests_only():
    cache = SuffixCache(100, 3)
    cache.extend("old", [1, 2, 3, 4, 5, 6])
    cache.extend("me", [9, 2, 3, 8])
    assert cache.lookup([7, 2, 3], 3) == (2, [8])  # the newest occurrence (own sequence) ...
    assert cache.lookup([7, 2, 3], 3, exclude="me") == (0, [])  # ... is excluded, and hides "old"'s entry
    assert cache.lookup([1, 2], 3, exclude="me") == (2, [3, 4, 5])


def test_table_cost_interpolates_and_extrapolates():
    from laserlm.speculative.policy import table_cost

    table = {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.5}
    assert [table_cost(w, table) for w in (1, 2, 3, 8, 12)] == [1.0, 1.5, 2.0, 4.5, 6.5]


def test_policy_drafts_longer_with_high_acceptance_and_not_at_all_with_low():
    pol = DraftPolicy()
    cost = lambda m: verify_cost(m + 1)  # noqa: E731
    for _ in range(10):
        pol.update("ngram/3", 8, 8)
    m_hi, gain_hi = pol.best_length("ngram/3", 16, cost)
    for _ in range(10):
        pol.update("ngram/1", 0, 4)
    m_lo, _ = pol.best_length("ngram/1", 16, cost)
    assert m_hi >= 8 and gain_hi > 2 and m_lo == 0
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    for _ in range(300):  # an unused estimate relaxes to the prior: the source is probed again
        pol.update(None, 0, 0)
    assert pol.best_length("ngram/1", 16, cost)[0] >= 1


def test_policy_pools_a_miss_into_the_longer_match_lengths():
    """A rejected draft from an n-token match is a failed trial of every longer match length of its source too, so
    a request pays one first probe, not one per match length; shorter lengths and other sources keep their
    estimate."""
    pol = DraftPolicy(max_ngram=3)
    prior = {n: pol.alpha(f"ngram/{n}") for n in (1, 2, 3)}
    pol.update("ngram/2", 0, 5)
    assert pol.alpha("ngram/1") == prior[1]
    assert pol.alpha("ngram/2") < prior[2] and pol.alpha("ngram/3") < prior[3]
    assert pol.alpha("suffix/3") == pol.prior_of("suffix/3")
    cost = lambda m: verify_cost(m + 1)  # noqa: E731
    assert pol.best_length("ngram/3", 16, cost)[0] < DraftPolicy(max_ngram=3).best_length("ngram/3", 16, cost)[0]
    before = pol.alpha("ngram/3")
    pol.update("ngram/1", 4, 4)  # all accepted: no miss to pool
    assert pol.alpha("ngram/3") >= before  # only idle relaxation towards the prior


def test_plain_steps_observe_the_lookup_proposals_for_free():
    """A plain step whose lookup proposed a draft counts one trial of that key (a success iff the emitted token is
    the proposal's first): misses observed this way stop the drafts without paying a probe, hits bring them back,
    and a key not observed still relaxes towards its prior."""
    from laserlm.speculative.policy import table_cost

    # a verify that costs 0.3 plain steps per extra row (the price is not what this tests)
    cost = lambda m: table_cost(m + 1, {1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9, 8: 3.1})  # noqa: E731
    pol = DraftPolicy(max_ngram=3)
    assert pol.best_length("ngram/1", 8, cost)[0] >= 1  # the prior alone drafts from a 1-token match
    pol.update("ngram/3", 3, 3)
    n3 = pol.counts["ngram/3"][:]
    for _ in range(4):
        pol.update(None, 0, 0, observed={"ngram/1": False})
    assert pol.alpha("ngram/1") < 0.3 and pol.best_length("ngram/1", 8, cost) == (0, 1.0)
    assert pol.counts["ngram/3"] == [pytest.approx(n3[0] * 0.98 ** 4), pytest.approx(n3[1] * 0.98 ** 4)]  # idle
    for _ in range(8):
        pol.update(None, 0, 0, observed={"ngram/1": True})
    assert pol.alpha("ngram/1") > pol.prior_of("ngram/1") and pol.best_length("ngram/1", 8, cost)[0] >= 2


def test_loss_budget_books_measured_costs_and_caps_the_bank():
    b = LossBudget(1.0, cap=3.0)
    assert b.settle(2, seconds=0.5, predicted=1.7, plain=False) == 1.7  # no plain step timed: the prediction
    assert b.bank == pytest.approx(1.0 + BUDGET_EPS + 2 - 1.7)
    assert b.settle(1, seconds=0.01, predicted=1.0, plain=True) == 1.0 and b.plain_s == 0.01
    assert b.settle(1, seconds=0.03, predicted=1.5, plain=False) == pytest.approx(3.0)  # measured: 0.03 / 0.01
    assert b.bank == pytest.approx(1.0 + 3 * BUDGET_EPS + 2 - 1.7 - 2.0)
    for _ in range(5):
        b.settle(17, seconds=0.02, predicted=2.8, plain=False)
    assert b.bank == 3.0  # capped
    cost = lambda m: verify_cost(m + 1)  # noqa: E731
    assert affordable(16, cost, 0.5) == 0 and affordable(16, cost, 0.75) == 1 and affordable(16, cost, 10) == 16
    assert affordable(16, cost, 1.0) == 2  # c(3) - 1 = 0.91, c(4) - 1 = 1.06


@pytest.mark.parametrize("spec, message", [
    ("speculative:draft=ngram,max_ngram=0", "max_ngram (longest n-gram matched) must be an integer in [1, 16], got 0"),
    ("speculative:draft=ngram,max_ngram=17", "max_ngram (longest n-gram matched) must be an integer in [1, 16]"),
    ("speculative:draft=ngram,max_ngram=two", "max_ngram must be an integer, got 'two'"),
    ("speculative:draft=ngram,max_ngram=2,min_match=3", "min_match (shortest n-gram match that drafts) must be"),
    ("speculative:draft=trie", "unknown draft source(s) trie in draft='trie'; known: ngram, suffix, layers"),
    ("speculative:draft=ngram+ngram", "names a source twice"),
    ("speculative:draft=ngram+", "draft must name draft sources joined by '+'"),
    ("speculative:draft=suffix,suffix_tokens=0", "suffix_tokens (suffix cache bound, tokens) must be an integer"),
    ("speculative:draft=ngram,suffix_tokens=64", "suffix_tokens bounds the suffix cache"),
    ("speculative:draft=ngram,draft_layers=2", "draft_layers set the shallow-path draft, which draft=ngram does not"),
    ("speculative:draft=ngram,k=auto", "k=auto set the shallow-path draft"),
    ("speculative:max_ngram=2", "max_ngram set the n-gram / suffix drafts; name them in draft="),
    ("speculative:draft=ngram,verify_cost=-1", "verify_cost (extra cost per doubling of the verify width)"),
    ("speculative:draft=ngram,verify_base=x", "verify_base must be a number, got 'x'"),
    ("speculative:draft=ngram,verify_base=20", "verify_base (extra cost of a multi-position verify) must be"),
    ("speculative:draft=ngram,loss_budget=-1",
     "loss_budget (plain steps a request may lose to drafts that do not pay; 0 or off disables the budget) must be "
     "a number in [0, 64] or off, got -1.0"),
    ("speculative:draft=ngram,loss_budget=65", "loss_budget (plain steps a request may lose"),
    ("speculative:draft=ngram,loss_budget=inf", "must be a number in [0, 64] or off, got inf"),
    ("speculative:draft=ngram,loss_budget=nan", "must be a number in [0, 64] or off, got nan"),
    ("speculative:draft=ngram,loss_budget=lots", "speculative option loss_budget must be a number of plain steps in "
                                                 "[0, 64] or off, got 'lots'"),
])
def test_bad_draft_options(spec, message):
    engine = Engine(tiny_model(), max_seq_len=32)
    with pytest.raises(InvalidArgumentError) as err:
        make_mode(spec, engine)
    assert message in str(err.value)


def test_loss_budget_defaults_and_off():
    engine = Engine(tiny_model(), max_seq_len=32)
    assert make_mode("speculative:draft=ngram", engine).loss_budget == 0.0  # off by default (RESULTS, issue 15)
    assert make_mode("speculative:draft=ngram,loss_budget=1", engine).loss_budget == 1.0
    assert make_mode("speculative:draft=ngram,adaptive=0", engine).loss_budget == 0.0  # off: drafts as given
    assert make_mode("speculative:draft_layers=2,k=2", engine).loss_budget == 0.0  # layers alone: as before #15
    assert make_mode("speculative:draft=ngram,loss_budget=OFF", engine).loss_budget == 0.0
    assert make_mode("speculative:draft=ngram,loss_budget=0", engine).config()["loss_budget"] == 0.0
    assert make_mode("speculative:draft=ngram,adaptive=0,loss_budget=2.5", engine).loss_budget == 2.5
    with pytest.raises(InvalidArgumentError, match="loss_budget"):
        SpeculativeDecoding(4, draft="ngram", loss_budget=True)


def test_draft_option_names_the_rule():
    from laserlm.defaults import needs_default

    assert needs_default("speculative:draft=ngram") is None
    assert needs_default("speculative") == "speculative"


# -- tiny model: greedy --------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [
    "speculative:draft=ngram",
    "speculative:draft=ngram,max_ngram=1,adaptive=0,k=8",
    "speculative:draft=ngram+suffix+layers,draft_layers=2,adaptive=0",
    "speculative:draft=layers+ngram,draft_layers=1,k=3",
    "speculative:draft=suffix,adaptive=0,min_match=1",
    "speculative:draft=ngram+layers,draft_layers=2,adaptive=0,k=6,loss_budget=0.8",
])
def test_tiny_greedy_matches_full(one_thread, spec):
    model = tiny_model(vocab=64)
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "sdpa"
    engine = Engine(model, max_seq_len=128)
    mode = make_mode(spec, engine)
    prompt, n = [3, 17, 42, 5, 3, 17, 42, 9, 3, 17], 40
    want = hf_greedy(ref, prompt, n)
    for _ in range(2):  # the second run can draft from the first one's suffix cache
        run = generate_tokens(engine, mode, torch.tensor(prompt), SamplingParams(max_new_tokens=n), n)
        assert [ev.token_id for ev in run] == want
        assert run.request.cache.length == len(prompt) + n - 1
    s = run.summary()["speculative"]
    assert s["drafted"] > 0 and s["emitted"] == n - 1
    assert sum(v["cycles"] for v in s["by_source"].values()) == s["cycles"]
    assert sum(v["emitted"] for v in s["by_source"].values()) == s["emitted"]


def test_packed_weights_keep_the_verify_on_the_kernel(one_thread):
    """On packed weights a verify of more than ``engine.fast_rows`` positions would leave the compiled kernel for the
    prefill GEMM (5-20x a kernel step), so lookup drafts are cut to ``fast_rows - 1`` tokens there, and only there:
    the float engine drafts the whole ``k``. Greedy output still equals the packed engine's own full depth."""
    from laserlm.models.packing import pack_model

    model = tiny_model(vocab=64)
    float_engine = Engine(copy.deepcopy(model), max_seq_len=128)
    pack_model(model, "int8")
    engine = Engine(model, max_seq_len=128)
    assert engine.fast_rows == 16 and float_engine.fast_rows is None
    prompt, n = [3, 17, 42, 5, 9, 11] * 6, 60
    spec = "speculative:draft=ngram,adaptive=0,k=24,loss_budget=off"
    want = [ev.token_id for ev in generate_tokens(engine, make_mode("full", engine), torch.tensor(prompt),
                                                  SamplingParams(max_new_tokens=n), n)]
    events = list(generate_tokens(engine, make_mode(spec, engine), torch.tensor(prompt),
                                  SamplingParams(max_new_tokens=n), n))
    assert [ev.token_id for ev in events] == want
    assert max(_cycle_widths(events)) == engine.fast_rows
    events_f = list(generate_tokens(float_engine, make_mode(spec, float_engine), torch.tensor(prompt),
                                    SamplingParams(max_new_tokens=n), n))
    assert max(_cycle_widths(events_f)) == 25


def test_packed_weights_price_the_verify_with_their_own_cost_table(one_thread, tmp_path, monkeypatch):
    """Packed weights multiply many rows at a cost per extra row that the float32 log-curve does not describe (about
    one weight read up to 6-8 rows, compute-bound beyond), so by default their lookup policy prices a verify with a
    table: this machine's, measured once and kept in the cache (a damaged cache file is measured again), or with
    ``verify_cost=prior`` the kernel variant's fixed one; it drafts shorter where a verify is dearer than the
    log-curve; an explicit ``verify_cost`` keeps the log model, and float weights are unchanged. Greedy output still
    equals full depth."""
    from laserlm.models import kernels
    from laserlm.models.packing import pack_model
    from laserlm.speculative.policy import PACKED_VERIFY_TABLES

    import json

    from laserlm.speculative.calibration import verify_table_key

    costs = tmp_path / "verify_costs.json"
    monkeypatch.setenv("LASERLM_VERIFY_COSTS", str(costs))
    model = tiny_model(vocab=64)
    float_engine = Engine(copy.deepcopy(model), max_seq_len=128)
    pack_model(model, "int8")
    engine = Engine(model, max_seq_len=128)
    measured = make_mode("speculative:draft=ngram", engine).verify_fit
    assert measured["source"] == "measured on this machine"
    got = measured["measured"]
    assert got[1] == 1.0 and max(got) == engine.fast_rows and sorted(got) == list(got)
    assert all(got[a] <= got[b] for a, b in zip(got, list(got)[1:]))  # a wider step never costs less
    assert costs.is_file()
    again = make_mode("speculative:draft=ngram+suffix", engine).verify_fit
    assert again == {"measured": got, "source": "measured on this machine (cached)"}
    key = verify_table_key(engine)
    for damaged in ("{not json", "[1, 2]", json.dumps({key: {"measured": {"1": 1.0}}}),
                    json.dumps({key: {"measured": {**{str(w): c for w, c in got.items()}, "2": 1e-300}}}),
                    json.dumps({key: {"measured": {**{str(w): c for w, c in got.items()}, "16": float("inf")}}}),
                    json.dumps({key: {"measured": {**{str(w): c for w, c in got.items()}, "0": 2.0}}})):
        costs.write_text(damaged)
        assert make_mode("speculative:draft=ngram", engine).verify_fit["source"] == "measured on this machine"
        assert json.loads(costs.read_text())[key]["measured"]["1"] == 1.0  # the entry was replaced
    with pytest.raises(InvalidArgumentError, match="verify_cost=prior"):
        make_mode("speculative:draft=ngram,verify_cost=prior", float_engine)
    mode = make_mode("speculative:draft=ngram,verify_cost=prior", engine)
    table = PACKED_VERIFY_TABLES["avx512" if kernels.ops().kernel_isa() == "avx512" else "avx2"]
    assert mode.verify_fit == {"measured": table, "source": "packed-weights prior"}
    assert mode._verify_cost(16) == table[16]
    assert mode._verify_cost(7) == pytest.approx((table[6] + table[8]) / 2)  # interpolated
    assert mode._verify_cost(16) > 1.5 * verify_cost(16)  # the float curve prices 16 rows at ~2.8 steps
    assert mode.config()["verify_cost"] is None and mode.config()["verify_base"] is None  # priced by the table
    assert make_mode("speculative:draft=ngram,verify_cost=0.36", engine).verify_fit is None
    assert make_mode("speculative:draft=ngram", float_engine).verify_fit is None
    assert make_mode("speculative:draft=layers,draft_layers=2,k=4", engine).verify_fit is None  # no lookup source
    auto = make_mode("speculative:draft=ngram,verify_cost=auto", engine)
    assert max(auto.verify_fit["measured"]) == engine.fast_rows  # only widths the kernel takes
    # the policy's best draft length for a source accepted 80 % of the time: shorter under the packed table
    pol = DraftPolicy(max_ngram=3)
    m_packed, _ = pol.best_length("ngram/3", 15, lambda m: mode._verify_cost(m + 1))
    m_float, _ = pol.best_length("ngram/3", 15, lambda m: verify_cost(m + 1))
    assert 1 <= m_packed < m_float
    prompt, n = [3, 17, 42, 5, 9, 11] * 6, 40
    want = [ev.token_id for ev in generate_tokens(engine, make_mode("full", engine), torch.tensor(prompt),
                                                  SamplingParams(max_new_tokens=n), n)]
    run = generate_tokens(engine, mode, torch.tensor(prompt), SamplingParams(max_new_tokens=n), n)
    assert [ev.token_id for ev in run] == want
    assert run.summary()["speculative"]["verify_fit"]["source"] == "packed-weights prior"


def test_event_kinds_null_rates_and_the_packed_bank_cap(one_thread):
    """Cycles that draft nothing are labelled ``plain`` (not ``bonus``); a run that never drafts reports its rates as
    ``None`` (valid JSON, where NaN is not); on packed weights the loss budget's bank cap is sized for the draft
    length ``step`` can use (``fast_rows - 1``), not the uncapped ``k``."""
    import json

    from laserlm.models.packing import pack_model

    model = tiny_model(vocab=64)
    engine = Engine(copy.deepcopy(model), max_seq_len=128)
    prompt, n = list(range(1, 13)), 6  # no repeated n-gram in the prompt: nothing to draft at first
    run = generate_tokens(engine, make_mode("speculative:draft=ngram,min_match=3,adaptive=0", engine),
                          torch.tensor(prompt), SamplingParams(max_new_tokens=n), n)
    events = list(run)
    s = run.summary()["speculative"]
    kinds = {ev.info["kind"] for ev in events if "cycle" in ev.info}
    if s["drafted"] == 0:
        assert kinds == {"plain"} and s["acceptance_rate"] is None
    assert "bonus" not in {ev.info["kind"] for ev in events if ev.info.get("drafted") == 0}
    json.loads(json.dumps(s, allow_nan=False))  # no NaN anywhere
    pack_model(model, "int8")
    packed = Engine(model, max_seq_len=128)
    spec = "speculative:draft=ngram,adaptive=0,k=40,loss_budget=1"
    mode_p, mode_f = make_mode(spec, packed), make_mode(spec, engine)
    st_p, st_f = mode_p.new_state(packed), mode_f.new_state(engine)
    start = st_p.budget.start
    assert st_p.budget.cap == pytest.approx(start + 2 * (mode_p._cost(st_p, "ngram", packed.fast_rows - 1) - 1))
    assert st_f.budget.cap == pytest.approx(start + 2 * (mode_f._cost(st_f, "ngram", 40) - 1))
    assert st_p.budget.cap < start + 2 * (mode_p._cost(st_p, "ngram", 40) - 1)  # not sized for the uncapped k


# -- the loss budget: deterministic with a fake clock -------------------------------------------------
class FakeClock:
    """Seconds = the modelled cost of the full-depth forwards run so far: a forward over ``w`` positions through
    all layers costs ``cost(w)`` (``cost(1) = 1``), so the budget's measured cycle costs are exact and
    deterministic (lookup and bookkeeping take no time)."""

    def __init__(self, engine, cost):
        self.t, self.cost = 0.0, cost
        run_layers = engine.run_layers

        def timed(start, stop, hidden, state):
            self.t += self.cost(hidden.shape[1]) * (stop - start) / engine.num_layers
            return run_layers(start, stop, hidden, state)

        engine.run_layers = timed

    def __call__(self) -> float:
        return self.t


class WrongDraft:
    """A lookup draft that is always wrong under greedy decoding: the reference greedy token + 1 (mod vocab) at
    every position, as long as the lookup offers (``k``)."""

    def __init__(self, reference: list[int], vocab: int):
        self.ref, self.vocab = reference, vocab

    def lookup(self, index, k, min_match):
        t = len(index.tokens)
        return 1, [(self.ref[t + i] + 1) % self.vocab if t + i < len(self.ref) else 0 for i in range(k)]


def _cycle_widths(events) -> list[int]:
    """The verify width (drafted + 1) of every cycle, from the events' per-cycle info."""
    widths = {}
    for ev in events:
        if "cycle" in ev.info:
            widths[ev.info["cycle"]] = ev.info["drafted"] + 1
    return [widths[c] for c in sorted(widths)]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("extra", [1.0, 1.5], ids=["costs_as_modelled", "costs_above_model"])
def test_loss_budget_bounds_the_loss_of_always_wrong_drafts(one_thread, adaptive, extra):
    """Every draft is wrong, so every cycle emits one token and a ``w``-position verify wastes ``c(w) - 1`` plain
    steps. Counted from the verify widths (the fake clock charges the cost model's ``c(w)``, or ``extra`` times its
    overhead ``c(w) - 1``), the time spent beyond plain decoding stays within the budget's bound: ``B0 + EPS``
    per cycle, plus (``extra > 1``) the largest amount by which one cycle exceeded its predicted cost. Without the
    budget, ``adaptive=0`` would waste ``c(9) - 1 = 1.5`` steps on every cycle."""
    model = tiny_model(vocab=64)
    engine = Engine(model, max_seq_len=128)
    prompt, n, k, budget = [3, 17, 42, 5, 3, 17, 42, 9, 3, 17], 100, 8, 1.0
    want = hf_greedy(copy.deepcopy(model), prompt, n)
    true_cost = lambda w: 1.0 + extra * (verify_cost(w) - 1.0)  # noqa: E731
    clock = FakeClock(engine, true_cost)
    mode = SpeculativeDecoding(4, draft="ngram", k=k, adaptive=adaptive, loss_budget=budget,
                               ngram=WrongDraft(prompt + want, 64), clock=clock)
    run = generate_tokens(engine, mode, torch.tensor(prompt), SamplingParams(max_new_tokens=n), n)
    events = list(run)
    assert [ev.token_id for ev in events] == want
    st = run.request.state
    widths = _cycle_widths(events)
    assert len(widths) == st.cycles == st.emitted == n - 1 and st.accepted == 0
    spent = sum(true_cost(w) for w in widths)
    assert st.cost_steps == pytest.approx(spent)  # the budget's measured cost is the widths' cost
    overshoot = max(true_cost(w) - verify_cost(w) for w in widths)
    loss = spent - st.emitted
    bound = budget + BUDGET_EPS * st.cycles + overshoot
    assert loss <= bound + 1e-9, f"lost {loss:.2f} plain steps, bound {bound:.2f}"
    assert st.drafted > 0, "the budget should still allow probes"
    if not adaptive:
        assert st.budget_refused + st.budget_shortened > 0


def test_loss_budget_lets_long_drafts_through_on_a_repetitive_prompt(one_thread):
    """A model whose greedy output is constant (final norm zeroed: every logit is 0, the argmax is token 0) on a
    prompt of that token: every n-gram draft is right, so the bank grows and the budget lets k-token drafts
    through (tokens per verify far above 1; the cost model's costs on the fake clock)."""
    model = tiny_model(vocab=64)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    prompt, n = [0] * 12, 100
    want = hf_greedy(copy.deepcopy(model), prompt, n)
    assert want == [0] * n
    engine = Engine(model, max_seq_len=128)
    clock = FakeClock(engine, verify_cost)
    mode = SpeculativeDecoding(4, draft="ngram", k=16, clock=clock, loss_budget=1.0)
    run = generate_tokens(engine, mode, torch.tensor(prompt), SamplingParams(max_new_tokens=n), n)
    assert [ev.token_id for ev in run] == want
    s = run.summary()["speculative"]
    assert s["mean_accepted_length"] > 8, s
    assert s["drafted"] >= 80 and s["acceptance_rate"] == 1.0
    assert s["loss_budget_left"] > 1.0 and s["cost_steps"] < 0.25 * s["emitted"]


# -- sampling: the exact distribution --------------------------------------------------------------
class AlwaysWrong:
    """A lookup draft that proposes the full model's least likely token (probability 0 after top-k) at every
    position: every draft is rejected, so every emitted token comes from the rejection residual."""

    def __init__(self, engine, params):
        self.engine, self.params = engine, params

    def lookup(self, index, k, min_match):
        seq, out = list(index.tokens), []
        for _ in range(min(k, 3)):
            with torch.inference_mode():
                logits = self.engine.forward(torch.tensor([seq]), logits="last", use_cache=False).logits[0, -1]
            tok = int(probabilities(logits, self.params).argmin())
            out.append(tok)
            seq.append(tok)
        return 1, out


@pytest.mark.parametrize("case", ["ngram", "always_wrong", "ngram_budget"])
def test_sampling_distribution_matches_full_model(one_thread, case):
    """Tokens 2-4 come from cycles with deterministic lookup drafts; their empirical distribution must match
    the full model's exact one (chi-square, ALPHA). ``ngram_budget``: with the loss budget on (real clock), the
    first decode step is the plain timing step and the drafts after it are limited to what the bank affords."""
    engine = Engine(tiny_model(vocab=16), max_seq_len=32)
    sampling = dict(temperature=1.0, top_k=6)
    depth, samples = 4, 1200
    # prompt = a + greedy(a) + a: the n-gram draft after it proposes the model's greedy path, so lookup drafts
    # are accepted often (and rejected often: sampling at temperature 1)
    a = [1, 5, 7]
    with torch.inference_mode():
        g = hf_greedy(engine.model, a, 6)
    prompt = a + g + a
    ngram = AlwaysWrong(engine, SamplingParams(**sampling)) if case == "always_wrong" else None
    budget = 1.0 if case == "ngram_budget" else 0
    mode = SpeculativeDecoding(4, draft="ngram", max_ngram=2, k=3, adaptive=False, ngram=ngram, loss_budget=budget)
    counts = torch.zeros(depth, 16)
    drafted = accepted = 0
    for seed in range(samples):
        params = SamplingParams(max_new_tokens=depth, seed=seed, **sampling)
        run = generate_tokens(engine, mode, torch.tensor(prompt), params, depth)
        for pos, ev in enumerate(run):
            counts[pos, ev.token_id] += 1
        drafted += run.request.state.drafted
        accepted += run.request.state.accepted
    assert drafted > samples // 4
    if case == "always_wrong":
        assert accepted == 0
    else:
        assert 0.1 < accepted / drafted < 0.9, f"acceptance {accepted / drafted:.2f}: drafts should be right and wrong"
    exact = exact_marginals(engine, prompt, SamplingParams(**sampling), depth, engine.num_layers)
    for pos in range(depth):
        pval, df = chi2_pvalue(counts[pos], exact[pos])
        assert pval > ALPHA, f"token {pos + 1}: chi-square p={pval:.2g} (df={df}) rejects the full model's distribution"


# -- real SmolLM2-135M ---------------------------------------------------------------------------
REAL_PROMPTS = [COPY_PROMPT, "The capital of France is", "<chat>",
                "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"]


@pytest.mark.parametrize("prompt", REAL_PROMPTS, ids=["copy", "france", "chat", "code"])
def test_smollm2_greedy_identical_with_long_wrong_ngram_drafts(smol, smol_ref, prompt):
    """Unigram matches, no policy, k=12: long drafts on every step with any earlier occurrence of the last
    token; most are wrong. The output is the full model's greedy output all the same."""
    engine, n = smol.engine, 40
    mode = SpeculativeDecoding(engine.num_layers, draft="ngram", max_ngram=1, k=12, adaptive=False)
    ids = _prompt_ids(smol, prompt)
    run = generate_tokens(engine, mode, torch.tensor(ids), SamplingParams(max_new_tokens=n, ignore_eos=True), n)
    got = [ev.token_id for ev in run]
    want = _reference(smol, smol_ref, prompt, n)
    mismatch = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want, f"first mismatch at token {mismatch}"
    st = run.request.state
    assert st.drafted > st.accepted, "some drafts must be rejected"
    assert st.drafted >= 4 * st.by_source["ngram"]["cycles"], "drafts should be long"


def test_smollm2_adaptive_combined_sources_greedy_identical(smol, smol_ref):
    engine, n = smol.engine, 40
    mode = make_mode("speculative:draft=ngram+suffix+layers,draft_layers=20", engine)
    want = _reference(smol, smol_ref, COPY_PROMPT, n)
    ids = torch.tensor(_prompt_ids(smol, COPY_PROMPT))
    for _ in range(2):
        run = generate_tokens(engine, mode, ids, SamplingParams(max_new_tokens=n, ignore_eos=True), n)
        assert [ev.token_id for ev in run] == want
    s = run.summary()["speculative"]
    assert s["mean_accepted_length"] > 2, "the copy prompt should accept long drafts"
    cache = mode.suffix_cache(engine)
    assert 0 < len(cache) <= cache.max_tokens
    # the cache lives on the engine, not in the mode: a second mode object of the same settings shares it
    assert make_mode("speculative:draft=ngram+suffix+layers,draft_layers=20", engine).suffix_cache(engine) is cache


def _accepted_token_index(run_events, ids):
    """An output index whose token was accepted inside a draft block (not the block's last token) and occurs
    there for the first time."""
    for i, ev in enumerate(run_events):
        if ev.info.get("kind") == "accepted" and i > 2 and ids[i] not in ids[:i]:
            return i
    return None


def test_smollm2_eos_stop_and_max_tokens_inside_accepted_block(smol):
    """An EOS token or a stop string inside an accepted draft block ends the output exactly where full
    depth ends it; ``max_tokens`` is never overshot."""
    spec = "speculative:draft=ngram,k=12"
    mode = smol.mode(spec)
    ids = torch.tensor(_prompt_ids(smol, COPY_PROMPT))
    run = generate_tokens(smol.engine, mode, ids, SamplingParams(max_new_tokens=40, ignore_eos=True), 40)
    events = list(run)
    toks = [ev.token_id for ev in events]
    j = _accepted_token_index(events, toks)
    assert j is not None, "no accepted draft token to test with"
    saved = smol.eos_ids
    try:
        smol.eos_ids = {toks[j]}
        full = smol.generate(COPY_PROMPT, mode="full", max_new_tokens=40)
        spec_res = smol.generate(COPY_PROMPT, mode=spec, max_new_tokens=40)
    finally:
        smol.eos_ids = saved
    assert full.finish_reason == spec_res.finish_reason == "eos"
    assert spec_res.token_ids == full.token_ids == toks[:j] and spec_res.text == full.text
    stop = smol.tokenizer.decode(toks[j:j + 1]).strip() or smol.tokenizer.decode(toks[j:j + 2])
    full = smol.generate(COPY_PROMPT, mode="full", max_new_tokens=40, stop=[stop], ignore_eos=True)
    spec_res = smol.generate(COPY_PROMPT, mode=spec, max_new_tokens=40, stop=[stop], ignore_eos=True)
    assert full.finish_reason == spec_res.finish_reason == "stop"
    assert spec_res.text == full.text and spec_res.token_ids == full.token_ids
    for n in (1, 2, 3, 5, 9):
        res = smol.generate(COPY_PROMPT, mode=spec, max_new_tokens=n, ignore_eos=True)
        assert res.token_ids == toks[:n] and res.finish_reason == "length"
        r = generate_tokens(smol.engine, mode, ids, SamplingParams(max_new_tokens=n, ignore_eos=True), n)
        assert len(list(r)) == n and r.request.cache.length <= ids.shape[0] + n


def test_verify_cost_auto_fits_the_measured_curve(one_thread):
    engine = Engine(tiny_model(vocab=64), max_seq_len=128)
    mode = make_mode("speculative:draft=ngram,verify_cost=auto", engine)
    fit = mode.verify_fit
    assert set(fit) == {"verify_cost", "verify_base", "measured"} and fit["measured"][1] == 1.0
    assert 0 <= mode.verify_cost == fit["verify_cost"] <= 16 and 0 <= mode.verify_base == fit["verify_base"] <= 16
    run = generate_tokens(engine, mode, torch.tensor([3, 17, 42, 3, 17]), SamplingParams(max_new_tokens=6), 6)
    list(run)
    assert run.summary()["speculative"]["verify_fit"] == fit
    assert mode._verify_cost(1) == 1.0 and mode._verify_cost(2) == fit["measured"][2]
    with pytest.raises(InvalidArgumentError, match="verify_cost=auto fits verify_base too"):
        make_mode("speculative:draft=ngram,verify_cost=auto,verify_base=0.3", engine)
