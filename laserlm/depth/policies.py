"""Exit policies: small objects asked at an exit point whether the current token may stop there.

A policy decides for a batch of tokens at once: :meth:`ExitPolicy.decide_batch` gets a :class:`BatchPoint`
(what is known about ``n`` tokens after a layer group) and returns ``[n]`` bool (True: exit). One token is a
batch of one: the adaptive mode's decoding, replayed scoring and batched scoring all call the same rule
(:mod:`laserlm.depth.walk`). Policies compose with :class:`AllOf` / :class:`AnyOf`. Sources:

- :class:`Confidence`: softmax max probability, top-2 margin or entropy of the exit head's distribution
  (CALM, Schuster et al. 2022, "softmax response").
- :class:`Saturation`: cosine similarity of the hidden state across the group (CALM's "hidden-state
  saturation").
- :class:`AttentionTransition`: the attention transition score (ATS) of the seed, the cosine similarity of
  the token's attention distribution with the previous token's at one layer; below 0.7 means "go deeper".
- :class:`GatePolicy`: a trained exit gate (:class:`laserlm.depth.heads.ExitGate`, trained by calibration).
- :class:`PredictorPolicy`: the seed's complexity predictor (:mod:`laserlm.depth.predictor`), asked before the
  token's first layer; its per-exit probabilities reach the exit points in :attr:`BatchPoint.predicted`.
- :class:`Compensation`: the seed's compensation rule, a veto: when the hidden state changes by more than a
  threshold across the exit group (relative L2 change), run the next group instead of exiting.

The *patience rule* and *min depth* are properties of the schedule across tokens, not of one exit point:
see :mod:`laserlm.depth.adaptive` and :mod:`laserlm.depth.groups`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import InvalidArgumentError

CONFIDENCE_MEASURES = ("max", "margin", "entropy")
DEFAULT_ATS_THRESHOLD = 0.7  # the seed's value


@dataclass
class BatchPoint:
    """``n`` tokens (rows) at the same exit point, for :meth:`ExitPolicy.decide_batch`.

    Attributes:
        group: index of the layer group just finished.
        layer: decoder layers run so far (the exit layer if a token stops here).
        num_layers: L.
        hidden, hidden_in: ``[n, d]`` hidden states leaving / entering the group.
        head: ``fn(hidden [n, d]) -> logits [n, V]`` float32, the exit head at this point.
        ats: ``[n]`` attention transition scores (NaN where there is no previous token), or ``None`` when not
            measured.
        predicted: ``[n, E]`` the complexity predictor's exit probabilities per exit point (computed before the
            token's first layer), or ``None`` when the policy has no predictor.
    """

    group: int
    layer: int
    num_layers: int
    hidden: torch.Tensor
    hidden_in: torch.Tensor
    head: Callable
    ats: torch.Tensor | None = None
    _logits: torch.Tensor | None = field(default=None, repr=False)
    head_evals: torch.Tensor | None = field(default=None, repr=False)  # [N] exit-head evaluations per walk row
    rows: torch.Tensor | None = field(default=None, repr=False)  # [n] this point's rows among those N
    predicted: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.hidden.shape[0]

    @property
    def logits(self) -> torch.Tensor:
        """``[n, V]`` float32 exit-head logits (computed once, on first use)."""
        if self._logits is None:
            self._logits = self.head(self.hidden).float()
            if self.head_evals is not None:
                self.head_evals[self.rows if self.rows is not None else slice(None)] += 1
        return self._logits

    def select(self, rows: torch.Tensor) -> BatchPoint:
        """The rows ``rows`` (``[m]`` long indices) as a new point (the head is evaluated on those rows only)."""
        sub = BatchPoint(self.group, self.layer, self.num_layers, self.hidden[rows], self.hidden_in[rows], self.head,
                         self.ats[rows] if self.ats is not None else None,
                         predicted=self.predicted[rows] if self.predicted is not None else None)
        if self._logits is not None:
            sub._logits = self._logits[rows]
        sub.head_evals = self.head_evals
        sub.rows = self.rows[rows] if self.rows is not None else rows
        return sub

    @property
    def saturation(self) -> torch.Tensor:
        """``[n]`` cosine similarity of the hidden state entering and leaving the group."""
        return torch.nn.functional.cosine_similarity(self.hidden_in.float(), self.hidden.float(), dim=-1)


def _check_range(name: str, value: float, lo: float, hi: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}") from None
    if not (lo <= value <= hi) or math.isnan(value):
        raise InvalidArgumentError(f"{name} {value} is out of range [{lo}, {hi}]")
    return value


class ExitPolicy:
    """Base class: ``decide_batch(points) -> [n]`` bool (True: exit here).

    Attributes:
        needs_ats: the policy reads :attr:`BatchPoint.ats` (the adaptive mode then records attention probs).
    """

    needs_ats = False

    @property
    def never_exits(self) -> bool:
        """True when no input can make this policy exit (e.g. a probability threshold of 1: a certified threshold
        of 1.0 means "never exit"); the adaptive mode then runs the plain full-depth path, without checks."""
        return False

    def decide_batch(self, points: BatchPoint) -> torch.Tensor:  # pragma: no cover - interface
        """``[n]`` bool: the decision for every row."""
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


class Confidence(ExitPolicy):
    """Exit when the exit head is confident (CALM softmax response).

    ``max`` / ``margin``: exit iff the value ``> threshold``, threshold in [0, 1] (1 never exits);
    ``entropy``: exit iff entropy (nats) ``< threshold``, threshold in [0, ln V] (0 never exits).

    Raises:
        InvalidArgumentError: unknown measure or threshold out of range.
    """

    def __init__(self, threshold: float = 0.9, measure: str = "max", vocab_size: int | None = None):
        if measure not in CONFIDENCE_MEASURES:
            raise InvalidArgumentError(f"unknown confidence measure '{measure}'; use one of {', '.join(CONFIDENCE_MEASURES)}")
        hi = math.log(vocab_size) if (measure == "entropy" and vocab_size) else (float("inf") if measure == "entropy" else 1.0)
        self.threshold = _check_range(f"confidence threshold ({measure})", threshold, 0.0, hi)
        self.measure = measure


    def decide_batch(self, points):
        logp = torch.log_softmax(points.logits, dim=-1)
        p = logp.exp()
        if self.measure == "entropy":
            return -(p * logp).sum(-1) < self.threshold
        if self.measure == "max":
            return p.max(-1).values > self.threshold
        top = p.topk(2, dim=-1).values
        return (top[:, 0] - top[:, 1]) > self.threshold

    def describe(self):
        return f"confidence({self.measure}{'<' if self.measure == 'entropy' else '>'}{self.threshold:g})"


class Saturation(ExitPolicy):
    """Exit when cos(h_in, h_out) across the group ``> threshold`` (CALM hidden-state saturation); threshold in [-1, 1]."""

    def __init__(self, threshold: float = 0.95):
        self.threshold = _check_range("saturation threshold", threshold, -1.0, 1.0)


    def decide_batch(self, points):
        return points.saturation > self.threshold

    def describe(self):
        return f"saturation>{self.threshold:g}"


def transition_score(prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """Attention transition score (seed): head-mean cosine of a token's attention distribution ``cur [..., H, S]``
    with the previous token's ``prev [..., H, S']`` (``S' <= S``, zero-padded to ``S``) -> ``[...]``."""
    prev = torch.nn.functional.pad(prev, (0, cur.shape[-1] - prev.shape[-1]))
    return torch.nn.functional.cosine_similarity(prev, cur, dim=-1).mean(-1)


class AttentionTransition(ExitPolicy):
    """Allow exit when the attention transition score ``>= threshold`` (seed: ATS < 0.7 -> go deeper).

    The ATS is measured by the adaptive mode at one layer below the first exit point, in the same attention
    pass (``AttentionContext.want_probs``). Threshold in [0, 1].
    """

    needs_ats = True

    def __init__(self, threshold: float = DEFAULT_ATS_THRESHOLD):
        self.threshold = _check_range("attention transition threshold", threshold, 0.0, 1.0)


    def decide_batch(self, points):
        if points.ats is None:  # no previous token to compare with: be safe and go deeper
            return torch.zeros(len(points), dtype=torch.bool)
        return points.ats >= self.threshold  # NaN (no previous token) compares False

    def describe(self):
        return f"ats>={self.threshold:g}"


class Compensation(ExitPolicy):
    """The seed's compensation rule as a veto: exit only if the relative change ``||h_out - h_in|| / ||h_in||``
    across the exit group is ``<= max_change`` (> 0); otherwise the next group runs."""

    def __init__(self, max_change: float = 0.5):
        self.max_change = _check_range("compensation threshold", max_change, 1e-9, float("inf"))


    def decide_batch(self, points):
        a, b = points.hidden_in.float(), points.hidden.float()
        return (b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12) <= self.max_change

    def describe(self):
        return f"change<={self.max_change:g}"


class GatePolicy(ExitPolicy):
    """Exit when a trained exit gate's probability ``> threshold`` (threshold in [0, 1]).

    Args:
        gates: ``exit layer -> ExitGate`` (see :mod:`laserlm.depth.heads`); exit points without a gate never exit.
    """

    def __init__(self, gates: dict, threshold: float = 0.5):
        self.gates = dict(gates)
        self.threshold = _check_range("gate threshold", threshold, 0.0, 1.0)
        self.needs_ats = any(getattr(g, "uses_ats", False) for g in self.gates.values())


    def decide_batch(self, points):
        gate = self.gates.get(points.layer)
        if gate is None:
            return torch.zeros(len(points), dtype=torch.bool)
        from .heads import gate_scalars_batch  # noqa: PLC0415  (heads imports this module)

        logits = points.logits if gate.features == "head" else None
        scalars = gate_scalars_batch(logits, points.hidden, points.hidden_in, points.ats, points.layer,
                                     points.num_layers, gate.features)
        with torch.no_grad():
            return torch.sigmoid(gate(points.hidden, scalars)) > self.threshold

    @property
    def never_exits(self) -> bool:
        return self.threshold >= 1.0  # a sigmoid never exceeds 1

    def describe(self):
        return f"gate>{self.threshold:g}"


class PredictorPolicy(ExitPolicy):
    """Exit at an exit point when the complexity predictor's probability for it ``> threshold`` (in [0, 1]).

    Args:
        predictor: a :class:`~laserlm.depth.predictor.ComplexityPredictor` (``exit_points``, ``uses_ats``).

    The probabilities come from :attr:`BatchPoint.predicted`, computed by the adaptive mode before the token's first
    layer (seed 000 §2.1), so the decision never depends on the token's own layer outputs.

    Raises:
        InvalidArgumentError: threshold out of range; at decision time, a path that gives no prediction.
    """

    needs_prediction = True

    def __init__(self, predictor, threshold: float = 0.5):
        self.predictor = predictor
        self.threshold = _check_range("predictor threshold", threshold, 0.0, 1.0)
        self.needs_ats = bool(predictor.uses_ats)

    def decide_batch(self, points):
        if points.predicted is None:
            raise InvalidArgumentError("policy 'predictor' needs the adaptive mode's pre-layer prediction (adaptive "
                                       "decoding or replay scoring); this path does not provide it")
        if points.layer not in self.predictor.exit_points:
            return torch.zeros(len(points), dtype=torch.bool)
        return points.predicted[:, self.predictor.exit_points.index(points.layer)] > self.threshold

    @property
    def never_exits(self) -> bool:
        return self.threshold >= 1.0

    def describe(self):
        return f"predictor>{self.threshold:g}"


def find_predictor(policy) -> PredictorPolicy | None:
    """The :class:`PredictorPolicy` inside ``policy`` (a policy or a combination of them), or ``None``."""
    if isinstance(policy, PredictorPolicy):
        return policy
    for p in getattr(policy, "policies", ()):
        found = find_predictor(p)
        if found is not None:
            return found
    return None


class _Combined(ExitPolicy):
    """Several policies joined by ``combine`` (``all`` or ``any``; both short-circuit in order)."""

    combine = staticmethod(all)
    separator = " & "

    def __init__(self, policies):
        self.policies = list(policies)
        self.needs_ats = any(p.needs_ats for p in self.policies)


    def decide_batch(self, points):
        """Short-circuits per row, in order: a policy only sees the rows the earlier ones left undecided, so the
        exit head is evaluated only for rows that reach a policy reading it."""
        undecided = self.combine is all  # all: rows still True are undecided; any: rows still False
        out = torch.full((len(points),), undecided, dtype=torch.bool)
        for p in self.policies:
            rows = torch.nonzero(out == undecided).flatten()
            if rows.numel() == 0:
                break
            sub = points if rows.numel() == len(points) else points.select(rows)
            out[rows] = p.decide_batch(sub)
        return out

    @property
    def never_exits(self) -> bool:  # all: one member that never exits blocks every exit; any: every member must
        return (any if self.combine is all else all)(p.never_exits for p in self.policies)

    def describe(self):
        return self.separator.join(p.describe() for p in self.policies)


class AllOf(_Combined):
    """Exit iff every policy says exit (short-circuits in order)."""


class AnyOf(_Combined):
    """Exit iff some policy says exit (short-circuits in order)."""

    combine = staticmethod(any)
    separator = " | "


class Never(ExitPolicy):
    """Never exit (full depth through the adaptive machinery)."""


    def decide_batch(self, points):
        return torch.zeros(len(points), dtype=torch.bool)

    def describe(self):
        return "never"


POLICY_NAMES = ("confidence", "saturation", "ats", "gate", "predictor", "never")


def make_policy(names: str = "confidence", *, threshold=None, measure: str = "max", saturation_threshold=None,
                ats_threshold=None, gate_threshold=None, combine: str = "all", compensation=None,
                gates: dict | None = None, vocab_size: int | None = None, predictor=None,
                predictor_threshold=None) -> ExitPolicy:
    """Build a policy from mode options.

    Args:
        names: policy names joined by ``+`` (``confidence``, ``saturation``, ``ats``, ``gate``, ``never``).
        threshold: threshold of the first listed policy (unless its own option is given).
        combine: ``all`` (exit when every policy agrees) or ``any``.
        compensation: optional max relative hidden change; always combined as a veto (AND).
        gates: ``exit layer -> ExitGate`` for ``gate`` (from a laser file).
        predictor: a :class:`~laserlm.depth.predictor.ComplexityPredictor` for ``predictor`` (from a laser file);
            ``predictor_threshold`` its threshold (else ``threshold`` when it is listed first, else 0.5).

    Raises:
        InvalidArgumentError: unknown names, thresholds out of range, ``gate`` without gates, ``predictor``
            without a predictor.
    """
    parts = [p.strip() for p in str(names).split("+") if p.strip()]
    if not parts:
        raise InvalidArgumentError("no exit policy given; use one of " + ", ".join(POLICY_NAMES))
    first = parts[0]
    built = []
    for name in parts:
        t = threshold if name == first else None
        if name == "confidence":
            built.append(Confidence(0.9 if t is None else t, measure, vocab_size))
        elif name == "saturation":
            v = saturation_threshold if saturation_threshold is not None else t
            built.append(Saturation(0.95 if v is None else v))
        elif name == "ats":
            v = ats_threshold if ats_threshold is not None else t
            built.append(AttentionTransition(DEFAULT_ATS_THRESHOLD if v is None else v))
        elif name == "gate":
            if not gates:
                raise InvalidArgumentError("policy 'gate' needs trained exit gates: pass laser=PATH (from `laserlm calibrate`)")
            v = gate_threshold if gate_threshold is not None else t
            built.append(GatePolicy(gates, 0.5 if v is None else v))
        elif name == "predictor":
            if predictor is None:
                raise InvalidArgumentError("policy 'predictor' needs a trained complexity predictor: pass laser=PATH "
                                           "(from `laserlm calibrate`, which trains one unless --no-predictor)")
            v = predictor_threshold if predictor_threshold is not None else t
            built.append(PredictorPolicy(predictor, 0.5 if v is None else v))
        elif name == "never":
            built.append(Never())
        else:
            raise InvalidArgumentError(f"unknown exit policy '{name}'; use one of {', '.join(POLICY_NAMES)} "
                                       "(join several with '+')")
    if combine not in ("all", "any"):
        raise InvalidArgumentError(f"combine must be 'all' or 'any', got '{combine}'")
    policy = built[0] if len(built) == 1 else (AllOf(built) if combine == "all" else AnyOf(built))
    if compensation is not None:
        policy = AllOf([Compensation(compensation), policy])
    return policy
