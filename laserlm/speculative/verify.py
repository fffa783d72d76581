"""The verifier's acceptance rule: which drafted tokens the full model keeps, and the token that follows them.

Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): draft ``d_i`` with draft
probability ``q_i(d_i)`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the
next token is drawn from ``norm(max(0, p_i - q_i))``, and when every draft is accepted a bonus token is drawn from
``p_m``. The output is then distributed exactly as the full model's. A deterministic draft (lookup sources) has
``q = one-hot(d)``: it is accepted with probability ``p(d)`` and the residual is ``p`` without ``d``. Greedy
decoding accepts a draft iff it is the full model's argmax.
"""

from __future__ import annotations

import torch

from ..runtime.sampling import SamplingParams, check_finite, probabilities


def accept(p_logits: torch.Tensor, drafts: list[int], q_probs: list[torch.Tensor] | None, params: SamplingParams,
           generator: torch.Generator | None) -> tuple[int, int]:
    """Verify ``m = len(drafts)`` drafted tokens against the full model.

    Args:
        p_logits: ``[m + 1, V]`` the full model's logits at the verified positions (row ``i`` predicts the token
            after ``drafts[:i]``).
        drafts: the drafted token ids.
        q_probs: per draft the draft distribution ``[V]`` it was sampled from, or ``None`` for deterministic
            drafts (``q = one-hot``).
        params: the request's sampling parameters (greedy or not, temperature, top-k/p).
        generator: the request's RNG (sampling only).

    Returns:
        ``(a, last)``: the number of accepted drafts and the token that follows them (the correction at the first
        rejection, or the bonus token after all ``m``).

    Raises:
        NonFiniteLogitsError: NaN/inf in ``p_logits``.
    """
    m = len(drafts)
    if params.greedy:
        target = check_finite(p_logits).argmax(-1).tolist()
        a = 0
        while a < m and drafts[a] == target[a]:
            a += 1
        return a, target[a]
    p = probabilities(p_logits, params)
    for a, d in enumerate(drafts):
        q_d = float(q_probs[a][d]) if q_probs is not None else 1.0
        ratio = float(p[a, d]) / q_d
        if ratio >= 1.0 or float(torch.rand((), generator=generator)) < ratio:
            continue
        if q_probs is not None:
            residual = (p[a] - q_probs[a]).clamp_min(0)
        else:  # norm(max(0, p - one-hot(d))): p without d
            residual = p[a].clone()
            residual[d] = 0.0
        if float(residual.sum()) <= 0:  # p == q: rejection has probability 0; guard rounding
            residual = p[a]
        return a, int(torch.multinomial(residual, 1, generator=generator))
    return m, int(torch.multinomial(p[m], 1, generator=generator))
