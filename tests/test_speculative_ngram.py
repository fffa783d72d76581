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
from laserlm.modes import make_mode
from laserlm.runtime import Engine
from laserlm.runtime.loop import generate_tokens
from laserlm.runtime.sampling import SamplingParams, probabilities
from laserlm.speculative import SpeculativeDecoding
from laserlm.speculative.drafts import DraftPolicy, NgramIndex, SuffixCache, expected_tokens, verify_cost
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
    from laserlm.speculative.drafts import table_cost

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
])
def test_bad_draft_options(spec, message):
    engine = Engine(tiny_model(), max_seq_len=32)
    with pytest.raises(InvalidArgumentError) as err:
        make_mode(spec, engine)
    assert message in str(err.value)


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


@pytest.mark.parametrize("case", ["ngram", "always_wrong"])
def test_sampling_distribution_matches_full_model(one_thread, case):
    """Tokens 2-4 come from cycles with deterministic lookup drafts; their empirical distribution must match
    the full model's exact one (chi-square, ALPHA)."""
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
    mode = SpeculativeDecoding(4, draft="ngram", max_ngram=2, k=3, adaptive=False, ngram=ngram)
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
    assert len(mode.suffix_cache) <= mode.suffix_cache.max_tokens


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
