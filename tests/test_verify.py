"""The verifier's acceptance rule alone (speculative/verify.accept), against the exact target distribution.

Reference: the first token a cycle emits must be distributed as the full model's ``p_0`` whatever the draft
distribution ``q`` (Leviathan et al. 2023, Theorem 1); computed here in float64 from the logits and compared with
the empirical frequencies of 15,000 cycles (a fixed seed) (drafts sampled from ``q``, or deterministic drafts)."""

from __future__ import annotations

import torch

from laserlm.runtime.sampling import SamplingParams
from laserlm.speculative.verify import accept

V = 6


def _first_token_freqs(q: torch.Tensor | None, fixed_draft: int | None, n: int = 15_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 0.3, 0.1, 2.0, 0.0, -0.5]])
    params = SamplingParams(temperature=1.0, seed=0).validate()
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g)) if q is not None else fixed_draft
        a, last = accept(logits, [d], [q] if q is not None else None, params, g)
        counts[d if a >= 1 else last] += 1
    return counts / n, torch.softmax(logits[0].double(), -1)


def test_sampled_drafts_keep_the_target_distribution():
    q = torch.tensor([0.05, 0.4, 0.05, 0.3, 0.1, 0.1])
    freq, p0 = _first_token_freqs(q, None)
    assert torch.allclose(freq, p0, atol=0.015), (freq, p0)


def test_deterministic_drafts_keep_the_target_distribution():
    for d in (0, 4):  # the likeliest token and an unlikely one
        freq, p0 = _first_token_freqs(None, d)
        assert torch.allclose(freq, p0, atol=0.015), (d, freq, p0)


def test_greedy_accepts_the_argmax_prefix_and_corrects_after_it():
    logits = torch.full((4, V), -5.0)
    for i, t in enumerate([3, 1, 2, 5]):
        logits[i, t] = 5.0
    params = SamplingParams().validate()
    assert accept(logits, [3, 1, 2], None, params, None) == (3, 5)  # all accepted, bonus token
    assert accept(logits, [3, 4, 2], None, params, None) == (1, 1)  # rejected at 2nd: the argmax there
    assert accept(logits, [0, 1, 2], None, params, None) == (0, 3)
