"""Sampling and generation control (issue #2, item 5).

Filters are checked against an independent float64 NumPy implementation; the sampler's empirical
distribution against softmax(logits / T) with a chi-square test (survival function through
``torch.special.gammaincc``, so SciPy is not needed); stop / streaming / EOS / length / context logic
of :class:`~laserlm.runtime.generate.Generation` on the real SmolLM2 and on scripted token sources.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import chi2_sf
from laserlm.api import LaserLM
from laserlm.runtime.generate import Generation, TokenEvent
from laserlm.runtime.sampling import SamplingParams, filter_logits, probabilities, sample

PROMPT = "The three laws of thermodynamics state that"


# -- independent reference -----------------------------------------------------------------------
def np_filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 reference: temperature, then top-k, then top-p (smallest prefix of the sorted
    distribution whose mass reaches top_p), renormalised."""
    out = np.zeros_like(logits, dtype=np.float64)
    for r, row in enumerate(logits.astype(np.float64) / temperature):
        order = np.argsort(-row, kind="stable")
        keep = np.zeros(row.shape[0], dtype=bool)
        k = top_k if 0 < top_k < row.shape[0] else row.shape[0]
        keep[order[:k]] = True
        if top_p < 1.0:
            kept = order[:k]
            p = np.exp(row[kept] - row[kept].max())
            p /= p.sum()
            cum = np.cumsum(p)
            n = int(np.searchsorted(cum, top_p, side="left")) + 1  # first index where cum >= top_p
            keep[:] = False
            keep[kept[:n]] = True
        e = np.where(keep, np.exp(row - row[keep].max()), 0.0)
        out[r] = e / e.sum()
    return out


def test_chi2_sf_reference_values():
    # textbook critical values: P(chi2_5 > 11.070) = 0.05, P(chi2_1 > 3.841) = 0.05
    assert chi2_sf(11.0705, 5) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(3.8415, 1) == pytest.approx(0.05, abs=1e-4)


# -- filters --------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.9), (0.8, 10, 0.5), (1.0, 1, 1.0), (2.0, 0, 0.3),
    (1.0, 3, 0.999),
])
def test_filter_matches_float64_reference(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 64, generator=g) * 3
    got = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1).double().numpy()
    want = np_filtered_probs(logits.numpy(), temperature, top_k, top_p)
    assert np.array_equal(got > 0, want > 0), "kept token sets differ"
    np.testing.assert_allclose(got, want, atol=1e-6)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p).validate()
    np.testing.assert_allclose(probabilities(logits, params).double().numpy(), want, atol=1e-6)
    if top_k:
        assert ((got > 0).sum(-1) <= top_k).all()


def test_top_p_keeps_smallest_covering_set():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: (filter_logits(logits, 1.0, 0, p) > float("-inf"))[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.9) == [True, True, True, False]
    assert kept(1.0) == [True, True, True, True]


def _kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > float("-inf")).flatten().tolist() for row in logits]


def test_top_p_rounding_case_matches_transformers_warper():
    """Issue 18 item 4 (vLLM #1623 family): 0.5 + 0.3 = 0.80000001 in float32 must not round below top_p."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.tensor([[0.3, 0.1, 0.1, 0.5]]).log()
    want = _kept(TopPLogitsWarper(0.8)(None, logits.clone()))
    assert want == [[0, 3]]
    assert _kept(filter_logits(logits, 1.0, 0, 0.8)) == want


def _kept_values(logits: torch.Tensor, filtered: torch.Tensor) -> list[list[float]]:
    """Per row, the sorted original logits of the kept tokens: equal for two filters that keep the same
    set up to which of several exactly tied tokens they keep (tie order is arbitrary in both)."""
    return [sorted(row[f > float("-inf")].tolist()) for row, f in zip(logits, filtered)]


def test_top_p_randomized_matches_transformers_warpers():
    """Kept sets equal transformers' TopK -> TopP warpers on random rows, including coarse probabilities
    (multiples of 1/n) whose cumulative sums land on top_p up to float32 rounding."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(18)
    smooth = torch.randn(200, 50, generator=g) * 2.5
    coarse = torch.randint(1, 5, (400, 12), generator=g).float()  # few distinct values: many exact boundaries
    for logits in (smooth, (coarse / coarse.sum(-1, keepdim=True)).log()):
        for top_p in (0.1, 0.25, 0.3, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9, 0.95):
            for top_k in (0, 5):
                ref = TopKLogitsWarper(top_k)(None, logits.clone()) if top_k else logits.clone()
                want = _kept_values(logits, TopPLogitsWarper(top_p)(None, ref))
                got = _kept_values(logits, filter_logits(logits, 1.0, top_k, top_p))
                bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
                assert not bad, f"top_p={top_p} top_k={top_k}: {len(bad)} rows differ, e.g. row {bad[0]}"


def test_underflowing_temperature_is_greedy():
    """Issue 18 item 3 (transformers #24111): a temperature whose 1/T overflows float32 gives the T -> 0 limit
    of softmax(logits / T): one-hot at the argmax (split evenly over exact ties), never NaN."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 3.0, -2.0, 0.0]])
    for t in (1e-38, 1e-45, 1e-300):
        params = SamplingParams(temperature=t, top_p=0.9).validate()
        p = probabilities(logits, params)
        assert torch.isfinite(p).all()
        assert p.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]
        drawn = sample(logits.expand(64, -1, -1).reshape(-1, 4), SamplingParams(temperature=t),
                       torch.Generator().manual_seed(0)).view(64, 2)
        assert (drawn[:, 0] == 1).all() and set(drawn[:, 1].tolist()) == {0, 1}


def test_underflowing_temperature_generates_greedy_text(smol, capsys):
    from laserlm.cli import main

    prompt = "The capital of France is"
    greedy = smol.generate(prompt, max_new_tokens=5)
    tiny = smol.generate(prompt, max_new_tokens=5, temperature=1e-38, seed=0)
    assert tiny.token_ids == greedy.token_ids
    assert main(["generate", "-t", "1", "--temperature", "1e-38", "-n", "5", "--json", prompt]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == greedy.text


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_a_clear_error(bad):
    """Issue 18 item 6: NaN / inf logits (float16 overflow) must not turn into token 0 forever."""
    from laserlm.errors import LaserLMError, NonFiniteLogitsError

    logits = torch.tensor([[0.1, bad, -1.0]])
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.7)):
        with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
            sample(logits, params)
    assert issubclass(NonFiniteLogitsError, LaserLMError)
    masked = torch.tensor([[0.1, float("-inf"), -1.0]])  # -inf alone is a masked token, not an error
    assert sample(masked, SamplingParams(temperature=0)).tolist() == [0]


def test_one_bad_value_in_a_large_vocabulary_is_found():
    """The check's passing path is one max per row (vectorized): a single NaN / +inf anywhere in a row of a real
    vocabulary size, in float32 and bfloat16, or one all--inf row among good ones, must still be caught."""
    from laserlm.errors import NonFiniteLogitsError
    from laserlm.runtime.sampling import check_finite

    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 262144):
        for dtype in (torch.float32, torch.bfloat16):
            good = torch.randn(3, vocab, generator=g).to(dtype)
            good[0, 5] = float("-inf")
            assert check_finite(good) is good
            for bad, where in ((float("nan"), 0), (float("nan"), vocab - 1), (float("inf"), vocab // 2 + 3)):
                x = good.clone()
                x[1, where] = bad
                with pytest.raises(NonFiniteLogitsError):
                    check_finite(x)
            x = good.clone()
            x[2] = float("-inf")
            with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
                check_finite(x)


def test_generation_loop_stops_on_nan_logits(smol, monkeypatch, capsys):
    """The full-depth loop raises (instead of emitting token id 0 with finish_reason="length") when the
    engine's logits turn NaN mid-generation; the CLI prints one line and exits 2."""
    from laserlm.cli import main
    from laserlm.errors import NonFiniteLogitsError
    from laserlm.runtime.engine import Engine

    real = Engine.decode_step

    def poisoned(self, token, cache=None):
        out = real(self, token, cache=cache)
        out.logits = torch.full_like(out.logits, float("nan"))
        return out

    monkeypatch.setattr(Engine, "decode_step", poisoned)
    with pytest.raises(NonFiniteLogitsError):
        smol.generate(PROMPT, max_new_tokens=4)
    assert main(["generate", "-t", "1", "-n", "4", PROMPT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("laserlm: error: the model produced non-finite logits"), err


def test_greedy_probabilities_are_one_hot():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    p = probabilities(logits, SamplingParams(temperature=0))
    assert p.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert sample(logits, SamplingParams(temperature=0)).tolist() == [1, 0]


# -- the sampler's distribution -------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.6, 0), (1.5, 3)])
def test_empirical_distribution_matches_softmax(temperature, top_k):
    logits = torch.tensor([2.0, 1.5, 0.3, 0.0, -0.5, -1.0])
    n = 40_000
    params = SamplingParams(temperature=temperature, top_k=top_k, seed=0).validate()
    draws = sample(logits.expand(n, -1), params, torch.Generator().manual_seed(1234))
    counts = torch.bincount(draws, minlength=logits.shape[0]).double().numpy()
    expected = np_filtered_probs(logits[None].numpy(), temperature, top_k, 1.0)[0] * n
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a filtered-out token"
    stat = float((((counts - expected) ** 2)[support] / expected[support]).sum())
    assert chi2_sf(stat, int(support.sum()) - 1) > 1e-3, f"chi2 = {stat:.1f}"


def test_sampler_is_not_degenerate():
    """The chi-square test can fail: a wrong temperature is rejected."""
    logits = torch.tensor([2.0, 1.5, 0.3, 0.0, -0.5, -1.0])
    n = 40_000
    draws = sample(logits.expand(n, -1), SamplingParams(temperature=1.0), torch.Generator().manual_seed(1))
    counts = torch.bincount(draws, minlength=6).double().numpy()
    wrong = np_filtered_probs(logits[None].numpy(), 0.6, 0, 1.0)[0] * n
    stat = float(((counts - wrong) ** 2 / wrong).sum())
    assert chi2_sf(stat, 5) < 1e-6


def test_seeded_sampler_reproducible():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_p=0.95)
    a = [sample(logits, p, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(a[0], a[1])


# -- generation on the real model ----------------------------------------------------------------
def test_seeded_generation_reproducible(smol):
    kw = dict(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    a, b = smol.generate(PROMPT, **kw), smol.generate(PROMPT, **kw)
    assert a.token_ids == b.token_ids and a.text == b.text
    others = {tuple(smol.generate(PROMPT, **{**kw, "seed": s}).token_ids) for s in (1, 2)}
    assert len(others | {tuple(a.token_ids)}) > 1, "different seeds never change the output"


def test_top_k_1_equals_greedy(smol):
    greedy = smol.generate(PROMPT, max_new_tokens=12)
    topk1 = smol.generate(PROMPT, max_new_tokens=12, temperature=1.5, top_k=1, seed=3)
    assert topk1.token_ids == greedy.token_ids


def test_stop_string_cuts_text(smol):
    full = smol.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
    words = full.text.split()
    assert len(words) > 6
    stop = words[4]  # a word from the middle of the greedy output
    cut = full.text.find(stop)
    pieces = []
    gen = smol.stream(PROMPT, max_new_tokens=20, ignore_eos=True, stop=[stop, "@@never@@"])
    for piece in gen:
        pieces.append(piece)
    r = gen.result
    assert r.finish_reason == "stop"
    assert r.text == full.text[:cut]
    assert stop not in r.text
    assert "".join(pieces) == r.text
    assert r.token_ids == full.token_ids[:len(r.token_ids)]
    assert len(r.token_ids) < len(full.token_ids)


def test_streaming_and_callback(smol):
    seen = []
    gen = smol.stream(PROMPT, max_new_tokens=16, ignore_eos=True, on_token=lambda piece, ev: seen.append((piece, ev)))
    pieces = list(gen)
    r = gen.result
    assert len(pieces) > 3
    assert "".join(pieces) == r.text == smol.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    assert "".join(p for p, _ in seen) == r.text
    assert all(isinstance(ev, TokenEvent) for _, ev in seen)
    assert r.finish_reason == "length" and r.generated_tokens == 16
    assert r.layers_per_token == [smol.engine.num_layers] * 16
    assert len(r.itl_s) == 15 and r.ttft_s > 0


def test_max_tokens(smol):
    r = smol.generate(PROMPT, max_new_tokens=5, ignore_eos=True)
    assert r.generated_tokens == 5 and r.finish_reason == "length"


def test_eos_stops(smol):
    """Greedy decoding of this prompt reaches EOS; the text stops there and EOS is not in the ids."""
    free = smol.generate("The capital of France is", max_new_tokens=36, ignore_eos=True)
    eos_at = [i for i, t in enumerate(free.token_ids) if t in smol.eos_ids]
    assert eos_at, "prompt no longer reaches EOS within 36 tokens; pick another"
    r = smol.generate("The capital of France is", max_new_tokens=36)
    assert r.finish_reason == "eos"
    assert r.token_ids == free.token_ids[:eos_at[0]]


def test_context_limit(smol):
    small = LaserLM(smol.loaded, max_seq_len=20)  # a second engine on the same weights
    ids_len = len(smol.tokenizer(PROMPT)["input_ids"])
    r = small.generate(PROMPT, max_new_tokens=50, ignore_eos=True)
    assert r.finish_reason == "context"
    assert r.generated_tokens == 20 - ids_len
    ref = smol.generate(PROMPT, max_new_tokens=20 - ids_len, ignore_eos=True)
    assert r.token_ids == ref.token_ids


# -- Generation logic on scripted token sources (no model) ----------------------------------------
class _Tok:
    """A character tokenizer: id i decodes to chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _scripted(text_ids):
    def source(prompt_ids, params, max_tokens):
        for t in text_ids[:max_tokens]:
            yield TokenEvent(t, 1, 0.001)
    return source


def _run(ids, eos=(), max_seq_len=1000, on_token=None, **kw):
    params = SamplingParams(**kw).validate()
    gen = Generation(_Tok(), torch.tensor([1, 2, 3]), _scripted(ids), params, set(eos), max_seq_len, on_token)
    pieces = list(gen)
    return pieces, gen.result


def test_scripted_eos_and_ignore_eos():
    ids = [ord(c) for c in "hello"] + [0] + [ord(c) for c in "world"]
    pieces, r = _run(ids, eos={0}, max_new_tokens=50)
    assert r.text == "hello" and r.finish_reason == "eos" and "".join(pieces) == "hello"
    _, r = _run(ids, eos={0}, max_new_tokens=50, ignore_eos=True)
    assert r.text == "hello\x00world" and r.finish_reason == "length"


def test_scripted_stop_held_back_and_callback():
    """A partial stop string is held back while it may still complete; a callback sees every piece."""
    text = "abc<e" + "nd>tail"
    seen = []
    pieces, r = _run([ord(c) for c in text], max_new_tokens=50, stop=["<end>"],
                     on_token=lambda p, ev: seen.append(p))
    assert r.text == "abc" and r.finish_reason == "stop"
    assert "".join(pieces) == "abc" == "".join(seen)
    # a held-back prefix that never completes is flushed at the end, also to the callback
    seen.clear()
    pieces, r = _run([ord(c) for c in "abc<en"], max_new_tokens=50, stop=["<end>"],
                     on_token=lambda p, ev: seen.append(p))
    assert r.text == "abc<en" == "".join(pieces) == "".join(seen)
    assert r.finish_reason == "length"


def test_scripted_context_limit():
    _, r = _run([ord("x")] * 50, max_new_tokens=40, max_seq_len=10)
    assert r.finish_reason == "context" and r.generated_tokens == 7
    _, r = _run([ord("x")] * 50, max_new_tokens=7, max_seq_len=10)
    assert r.finish_reason == "length" and r.generated_tokens == 7


# -- penalties ---------------------------------------------------------------------------------------------------
def test_penalties_equal_a_hand_computation_on_a_fixed_vector():
    """vLLM's definitions, computed by hand: repetition on prompt + output tokens (divide a positive logit, multiply a
    negative one), frequency per occurrence in the output, presence once per output token."""
    from laserlm.runtime.sampling import apply_penalties

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0])
    prompt, output = torch.tensor([0, 1]), [3, 3, 4]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0).validate()
    got = apply_penalties(logits, p, prompt, output)
    # token: rep (prompt or output) -> frequency (count) -> presence
    want = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.25 * 2 - 0.5, -2.0 * 2 - 0.25 * 1 - 0.5, 0.0]
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert apply_penalties(logits, SamplingParams(), prompt, output).tolist() == logits.tolist()
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                {"repetition_penalty": float("inf")}):
        with pytest.raises(Exception, match="penalty"):
            SamplingParams(**bad).validate()


def test_repetition_penalty_greedy_equals_transformers_generate(smol, smol_ref):
    """Greedy decoding with ``repetition_penalty`` equals transformers' own ``generate`` with its
    RepetitionPenaltyLogitsProcessor (the same CTRL rule over prompt + generated tokens) on the same float weights;
    frequency/presence penalties change the output of a prompt the model otherwise loops on."""
    prompt = "I am a wolf, I am a wolf, I am a wolf,"
    ids = smol.tokenizer(prompt, return_tensors="pt")["input_ids"]
    ref = smol_ref.generate(ids, max_new_tokens=16, do_sample=False, repetition_penalty=1.3,
                            pad_token_id=smol.tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
    got = smol.generate(prompt, max_new_tokens=16, repetition_penalty=1.3, ignore_eos=True)
    assert got.token_ids[:len(ref)] == ref
    plain = smol.generate(prompt, max_new_tokens=16, ignore_eos=True)
    pen = smol.generate(prompt, max_new_tokens=16, frequency_penalty=1.0, presence_penalty=1.0, ignore_eos=True)
    assert plain.token_ids != pen.token_ids
    with pytest.raises(Exception, match="penalt"):
        smol.generate(prompt, max_new_tokens=4, mode="speculative:draft=ngram", presence_penalty=0.5)
