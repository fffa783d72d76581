"""Threshold calibration with a statistical guarantee (Learn then Test; CALM-style).

The user states a quality target (minimum top-1 agreement with the full model, or a maximum
perplexity increase) and a confidence level ``delta``. Candidate gate thresholds are ordered from
strict (nobody exits) to loose. For each candidate ``lam_j`` the null hypothesis is
``H_j: risk(lam_j) > alpha`` (risk = disagreement rate, alpha = 1 - target agreement). Fixed-sequence
testing (Angelopoulos, Bates, Candès, Jordan, Lei: "Learn then Test", 2021; used by CALM, Schuster et
al. 2022) tests ``H_1, H_2, ...`` in order at level ``delta`` and stops at the first non-rejection;
the loosest rejected threshold is returned. Then with probability >= 1 - delta over the draw of the
calibration set, the chosen threshold's risk is <= alpha (family-wise error control needs no
multiplicity correction for a fixed sequence).

p-values:
- ``binomial`` (default, exact for 0/1 losses): ``p = P[Binom(n, alpha) <= k]`` with ``k`` the
  observed disagreements (Clopper-Pearson tail);
- ``hoeffding_bentkus``: ``min(exp(-n h(r/n, alpha)), e * P[Binom(n, alpha) <= ceil(k)])`` (Bates et
  al., "Distribution-free, risk-controlling prediction sets", 2021), valid for any [0, 1] loss.
- ``clt`` (for the perplexity target, an unbounded loss): one-sided normal p-value of the mean
  per-token NLL increase; an *asymptotic* guarantee only, reported as such.

Assumption: calibration positions are exchangeable with the positions the guarantee is about. Tokens
of one document are correlated, so the effective sample size is smaller than the token count; we
report the bound with that caveat and check it on a separate split.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..errors import InvalidArgumentError

P_VALUE_METHODS = ("binomial", "hoeffding_bentkus", "clt")


def binom_cdf(k: int, n: int, p: float) -> float:
    """``P[Binom(n, p) <= k]`` computed in log space (exact up to float rounding; any n)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    lg = math.lgamma(n + 1)
    terms = [lg - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k + 1)]
    m = max(terms)
    return min(1.0, math.exp(m) * sum(math.exp(t - m) for t in terms))


def binomial_p_value(losses_sum: float, n: int, alpha: float) -> float:
    """Exact p-value of ``H: risk > alpha`` for 0/1 losses: ``P[Binom(n, alpha) <= k]``, ``k = losses_sum``."""
    return binom_cdf(int(math.floor(losses_sum + 1e-9)), n, alpha)


def hoeffding_bentkus_p_value(risk_hat: float, n: int, alpha: float) -> float:
    """Hoeffding-Bentkus p-value of ``H: risk > alpha`` for losses in [0, 1] (Bates et al. 2021)."""
    def h1(a, b):
        a = min(max(a, 1e-12), 1 - 1e-12)
        return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))

    hoeffding = math.exp(-n * h1(min(risk_hat, alpha), alpha))
    bentkus = math.e * binom_cdf(math.ceil(n * risk_hat), n, alpha)
    return min(hoeffding, bentkus, 1.0)


def clt_p_value(mean: float, std: float, n: int, alpha: float) -> float:
    """One-sided normal p-value of ``H: E[loss] > alpha`` (asymptotic)."""
    if n < 2:
        return 1.0
    se = max(std, 1e-12) / math.sqrt(n)
    z = (alpha - mean) / se
    return 0.5 * math.erfc(z / math.sqrt(2))


@dataclass
class Calibration:
    """The result of threshold calibration.

    Attributes:
        threshold: chosen gate threshold (``None`` if even the strictest candidate failed: never exit).
        target: ``{"kind": "agreement" | "ppl_increase", "value": ..., "alpha": risk bound}``.
        delta: the guarantee holds with probability >= 1 - delta.
        method: p-value method.
        n: calibration positions.
        risk: empirical risk at the chosen threshold on the calibration split.
        p_value: its p-value.
        tested: how many candidates were tested (fixed sequence, strict to loose).
        guarantee: one-sentence statement of the guarantee.
    """

    threshold: float | None
    target: dict
    delta: float
    method: str
    n: int
    risk: float
    p_value: float
    tested: int
    guarantee: str
    curve: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def exit_decisions(gate_probs: torch.Tensor, threshold: float | None, strict: bool = True) -> torch.Tensor:
    """Exit index per position under one threshold shared by all exit points.

    Args:
        gate_probs: ``[E, N]`` gate probabilities at the E exit points (in depth order).
        threshold: a position exits at the first exit point where ``prob > threshold`` (``>=`` when not
            ``strict``); ``None`` never exits.

    Returns:
        ``[N]`` int64: the exit point index, or ``E`` for full depth.
    """
    e, n = gate_probs.shape
    if threshold is None:
        return torch.full((n,), e, dtype=torch.long)
    ok = gate_probs > threshold if strict else gate_probs >= threshold
    ok = torch.cat([ok, torch.ones(1, n, dtype=torch.bool)], dim=0)
    return ok.float().argmax(0)


def position_losses(decision: torch.Tensor, agree: torch.Tensor, nll: torch.Tensor | None = None,
                    full_nll: torch.Tensor | None = None, kind: str = "agreement") -> torch.Tensor:
    """Per-position loss under exit decisions ``[N]``.

    ``agreement``: 1 where the token's exit head disagrees with the full model (full depth: 0).
    ``ppl_increase``: NLL at the exit minus the full model's NLL (full depth: 0).
    ``agree`` / ``nll``: ``[E, N]``; ``full_nll``: ``[N]``.
    """
    e = agree.shape[0]
    idx = decision.clamp_max(e - 1).unsqueeze(0)
    exited = decision < e
    if kind == "agreement":
        wrong = ~agree.gather(0, idx).squeeze(0)
        return (wrong & exited).double()
    diff = nll.gather(0, idx).squeeze(0).double() - full_nll.double()
    return torch.where(exited, diff, torch.zeros_like(diff))


def candidate_thresholds(gate_probs: torch.Tensor, num: int = 200) -> list[float]:
    """Candidates from strict to loose: 1.0, then ``num`` descending quantiles of the gate probabilities."""
    flat = gate_probs.flatten().double()
    qs = torch.quantile(flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:100_000]],
                        torch.linspace(1.0, 0.0, num + 1, dtype=torch.float64)).tolist()
    out = [1.0]
    for q in qs:
        q = float(q)
        if q < out[-1]:
            out.append(q)
    return out


def calibrate_threshold(gate_probs: torch.Tensor, agree: torch.Tensor, *, target_agreement: float | None = None,
                        max_ppl_increase: float | None = None, nll: torch.Tensor | None = None,
                        full_nll: torch.Tensor | None = None, delta: float = 0.1, method: str | None = None,
                        candidates: list[float] | None = None) -> Calibration:
    """Choose the loosest gate threshold whose risk is certified at level ``delta`` (fixed-sequence LTT).

    Args:
        gate_probs: ``[E, N]`` gate probabilities per exit point on the calibration split.
        agree: ``[E, N]`` bool, exit head top-1 == full-model top-1.
        target_agreement: minimum agreement with the full model's top-1 (e.g. 0.99); risk bound
            ``alpha = 1 - target``.
        max_ppl_increase: alternatively, a maximum relative perplexity increase (0.05 = +5 %); risk =
            mean NLL increase per token, ``alpha = log(1 + max_ppl_increase)``; needs ``nll [E, N]`` and
            ``full_nll [N]``; CLT p-values (asymptotic guarantee).
        delta: 1 - confidence of the guarantee, in (0, 1).
        method: ``binomial`` (default for agreement), ``hoeffding_bentkus`` or ``clt``.
        candidates: thresholds from strict to loose (default :func:`candidate_thresholds`).

    Raises:
        InvalidArgumentError: no target or both, targets/delta out of range, unknown method, missing NLLs.
    """
    target, method = resolve_target(target_agreement, max_ppl_increase, delta, method)
    kind = target["kind"]
    if kind != "agreement" and (nll is None or full_nll is None):
        raise InvalidArgumentError("a perplexity target needs per-position NLLs")
    n = gate_probs.shape[1]
    if n == 0:
        raise InvalidArgumentError("the calibration split is empty")
    cands = candidates if candidates is not None else candidate_thresholds(gate_probs)

    def losses_at(lam):
        d = exit_decisions(gate_probs, lam)
        return position_losses(d, agree, nll, full_nll, kind), float((d < gate_probs.shape[0]).double().mean())

    return fixed_sequence_test(cands, losses_at, target, delta, method)


def resolve_target(target_agreement: float | None, max_ppl_increase: float | None, delta: float,
                   method: str | None) -> tuple[dict, str]:
    """Check a quality target and p-value method; returns ``(target dict, method)``.

    Raises:
        InvalidArgumentError: no target or both, values out of range, unknown or unsuitable method.
    """
    if (target_agreement is None) == (max_ppl_increase is None):
        raise InvalidArgumentError("give exactly one target: a target agreement or a maximum perplexity increase")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise InvalidArgumentError(f"delta must be in (0, 1), got {delta}")
    if target_agreement is not None:
        if not 0 < target_agreement < 1:
            raise InvalidArgumentError(f"target agreement must be in (0, 1), got {target_agreement}")
        target = {"kind": "agreement", "value": target_agreement, "alpha": 1.0 - target_agreement}
        method = method or "binomial"
    else:
        if not max_ppl_increase > 0:
            raise InvalidArgumentError(f"maximum perplexity increase must be > 0, got {max_ppl_increase}")
        target = {"kind": "ppl_increase", "value": max_ppl_increase, "alpha": math.log1p(max_ppl_increase)}
        method = method or "clt"
        if method != "clt":
            raise InvalidArgumentError("the perplexity target supports only the 'clt' p-value (NLL is unbounded)")
    if method not in P_VALUE_METHODS:
        raise InvalidArgumentError(f"unknown p-value method {method!r}; use one of {', '.join(P_VALUE_METHODS)}")
    return target, method


def fixed_sequence_test(candidates: list[float], losses_at, target: dict, delta: float, method: str,
                        on_test=None, what: str = "gate threshold", none_means: str = "tokens never exit (full depth)",
                        unit: str = "positions") -> Calibration:
    """Learn-then-Test fixed-sequence testing over ``candidates`` (strict to loose).

    Args:
        candidates: thresholds, ordered before looking at the calibration data.
        losses_at: ``fn(threshold) -> (losses [n] float64, exit_fraction)``: per-position losses on the
            calibration split when that threshold is used (0/1 disagreements, or NLL increases). This is where
            the decoding the guarantee is about happens: replayed exact states, or real ``propagate`` decoding.
        target: from :func:`resolve_target`; ``delta``, ``method``: as in :func:`calibrate_threshold`.
        on_test: optional ``fn(curve_entry)`` called after each tested candidate (progress reporting).
        what / none_means / unit: the guarantee sentence's words for the parameter, for "nothing certified", and
            for one loss (defaults: the gate threshold's).

    Returns:
        :class:`Calibration` with the loosest threshold whose null hypothesis ``risk > alpha`` was rejected.
    """
    kind, alpha = target["kind"], target["alpha"]
    chosen, chosen_risk, chosen_p, tested, curve, n = None, 0.0, 0.0, 0, [], 0
    for lam in candidates:
        losses, exit_frac = losses_at(lam)
        n = losses.numel()
        if n == 0:
            raise InvalidArgumentError("the calibration split is empty")
        risk = float(losses.mean())
        if method == "binomial":
            p = binomial_p_value(float(losses.sum()), n, alpha)
        elif method == "hoeffding_bentkus":
            p = hoeffding_bentkus_p_value(risk, n, alpha)
        else:
            p = clt_p_value(risk, float(losses.std()) if n > 1 else 0.0, n, alpha)
        tested += 1
        curve.append({"threshold": lam, "risk": risk, "p_value": p, "exit_fraction": exit_frac})
        if on_test is not None:
            on_test(curve[-1])
        if p > delta:
            break
        chosen, chosen_risk, chosen_p = lam, risk, p
    target_agreement = target["value"] if kind == "agreement" else None
    max_ppl_increase = target["value"] if kind != "agreement" else None
    claim = (f"top-1 agreement with the full model >= {target_agreement:g}" if kind == "agreement"
             else f"perplexity increase <= {max_ppl_increase:.1%} (mean NLL increase <= {alpha:.4f} nats)")
    if chosen is None:
        guarantee = f"no threshold could be certified for {claim} at delta={delta:g} on {n} {unit}: {none_means}"
    else:
        kind_txt = "asymptotic (CLT) " if method == "clt" else ""
        guarantee = (f"with probability >= {1 - delta:g}, {claim} at {what} {chosen:.4g} "
                     f"({kind_txt}{method} p-value {chosen_p:.3g}, fixed-sequence test on {n} calibration "
                     f"{unit}, assuming new {unit} are exchangeable with them)")
    return Calibration(chosen, target, delta, method, n, chosen_risk, chosen_p, tested, guarantee, curve)


SHALLOW_SHARE = 0.5  # share of the exits at the first exit point above which the gates look shallow-biased
SHALLOW_MIN_EXITS = 20


def shallow_exit_bias(dec: torch.Tensor, loss: torch.Tensor, num_exits: int, allowed: float | None,
                      who: str = "exit gates") -> str | None:
    """A warning when the exit gates (or ``who``: the complexity predictor) are biased toward shallow layers on
    held-out text (the seed's failure mode), else ``None``: at least :data:`SHALLOW_MIN_EXITS` held-out positions exit, at least
    :data:`SHALLOW_SHARE` of them at the first exit point, and (when ``allowed`` is given, the target's allowed
    disagreement) their loss rate there exceeds ``allowed``.

    Args:
        dec: ``[n]`` exit index per held-out position (``num_exits`` = full depth).
        loss: ``[n]`` per-position loss (disagreement 0/1, or NLL increase).
    The returned text has a ``{exit}`` field for the first exit point's layer.
    """
    exited = dec < num_exits
    n_exit = int(exited.sum())
    if n_exit < SHALLOW_MIN_EXITS:
        return None
    first = dec == 0
    share = int(first.sum()) / n_exit
    if share < SHALLOW_SHARE:
        return None
    rate = float(loss[first].double().mean()) if first.any() else 0.0
    if allowed is not None and rate <= allowed:
        return None
    return (f"{who} look{'s' if who.endswith('predictor') else ''} biased toward shallow layers: {share:.0%} of the held-out exits stop at the first "
            "exit point (layer {exit})" + (f", where the loss rate is {rate:.3f} > the {allowed:.3f} the target "
                                          "allows" if allowed is not None else "")
            + "; consider a larger --min-depth or more calibration text")
