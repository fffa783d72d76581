"""The per-step draft policy: which source drafts and how many tokens, priced by the verify cost model, and the loss
budget that bounds what drafts that do not pay cost a request (the sources: :mod:`.proposers`, the shallow path in
:mod:`.self_speculative`, the draft head in :mod:`.draft_head`).

Policy (:class:`DraftPolicy`): for each candidate source it estimates the per-token acceptance ``alpha``
from the request's recent cycles (geometric model: a cycle that accepted ``a`` of ``m`` drafts counts ``a``
successes in ``a + [a < m]`` trials; counts decay by ``DECAY`` per update, and an unused estimate relaxes
towards the prior by ``IDLE_DECAY`` per cycle, so a source that stopped paying is probed again later).
**Free observations:** a plain step (no draft) whose lookup sources did propose a draft still tells whether
that draft's first token would have been accepted, at no cost: the emitted token ``t`` is the full model's
(greedy: the argmax; sampling: ``t ~ p``), and a verify accepts ``d`` iff ``d`` is the argmax / with probability
``p(d) = P(t = d)``. So each such step counts one trial, a success iff ``t = d``, for that lookup key. A source
the policy stopped drafting from is then re-tried when its proposals start to match, not by relaxing to the
prior and paying for a probe; the probes it still pays are those its prior makes at the first matches.
N-gram and suffix estimates are kept per match length ``n`` (a 3-token match is more reliable than a
1-token one). With a relative cost ``C(m)`` of drafting ``m`` tokens and verifying ``m + 1`` positions
(a plain full-depth step costs 1), the expected tokens per cycle are ``E(m) = (1 - alpha^(m+1)) / (1 -
alpha)`` (Leviathan et al. 2023, eq. 1) and the policy picks the source and ``m`` that maximise
``E(m) / C(m)``; when no choice beats a plain step (``E/C <= 1``) it drafts nothing. This is the adaptive
draft length and the fall-back to no draft. Verify cost model: ``c(1) = 1`` and
``c(w) = 1 + verify_base + verify_cost * log2(w)`` for ``w >= 2`` (a ``w``-position full-depth forward relative
to one position; a one-row matrix product is a cheaper kernel than a many-row one on CPU, hence the step).
Defaults ``verify_base = 0.34``, ``verify_cost = 0.36`` are fitted to smollm2-135m in float32 on 1 CPU thread
(``verify_cost=auto`` measures the engine's own curve). Priors of the acceptance estimates: ``0.7`` for the
shallow path, ``0.6 + 0.08 n`` for an ``n``-token lookup match (``n <= 3``). A rejected lookup draft
from an ``n``-token match also counts as a failed trial for every longer match length ``n' > n`` of the same
source (which has a more optimistic prior), so a request whose drafts do not pay spends one first probe, not one
per match length.

**Loss budget** (:class:`LossBudget`: a request should never run below 1.0x): the policy above acts on estimates, and
every estimate starts with a probe that may be wasted. To bound what those probes cost, each request keeps a bank
``B`` in units of plain full-depth steps (``loss_budget``, e.g. 1.0; off by default). Before a cycle the draft length ``m``
is limited to those whose predicted waste ``C(m) - 1`` (the cost of the cycle if every draft is rejected and it
emits one token) is at most ``B``; ``m = 0`` leaves a plain step. After every cycle ``B += EPS + emitted -
cost``, with ``EPS = 0.02`` and ``cost`` the *measured* cycle time in plain steps: the cycle's seconds (choice,
draft, verify and bookkeeping) over an exponential moving average of the seconds of the request's own plain
cycles (a plain cycle costs 1 by definition; so the cost model is checked against this machine, not trusted);
the first decode step of a request is a plain step to time that reference. A plain cycle of this mode includes
the lookup bookkeeping (tens of microseconds against milliseconds for a forward), which the budget does not
count. With ``N`` cycles a request then takes at most ``N (1 + EPS) + B0`` plain steps' time
(plus the largest amount by which one cycle's measured cost exceeded its prediction), i.e. it loses at most ``B0`` steps
plus 2 % against plain decoding however badly drafts fail, while a run of accepted drafts earns the bank that
longer drafts need. ``B`` is capped at ``B0`` plus twice the predicted waste of the longest (``k``-token) draft: a
copy-heavy request can absorb two full-length misses in a row (a copy that diverges and resynchronises) without
falling back to plain steps, but a long lucky run cannot license an unbounded series of later losses (the loss
over any stretch of cycles stays below the cap + ``EPS`` per cycle).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError
from ..runtime.options import is_number
from .proposers import DEFAULT_MAX_NGRAM

DEFAULT_VERIFY_COST = 0.36
DEFAULT_VERIFY_BASE = 0.34
# The verify cost tables used by default on packed weights (``Engine.fast_rows`` set; ``--weights native / int4 /
# int8``): the cost of a ``w``-position step in plain steps, per variant of the block kernels (laserlm/models/kernels):
# a step of up to 6 positions (Q4_1 matrices; 8 for Q8_0) costs about one read of the weights, longer ones are
# compute-bound. Not the float32 log-curve, which prices 16 rows at ~2.8 steps. Means of smollm2-135m and
# gemma3-270m native at 1 thread (benchmarks/bench_step_tokens.py); "avx2" is the AVX2 variant
# (LASERLM_KERNEL_ISA=avx2). ``verify_cost=auto`` measures the curve of your engine and machine instead.
PACKED_VERIFY_TABLES = {
    "avx512": {1: 1.0, 2: 1.07, 3: 1.17, 4: 1.31, 5: 1.5, 6: 1.74, 8: 2.23, 12: 3.57, 16: 4.3},
    "avx2": {1: 1.0, 2: 1.09, 3: 1.3, 4: 1.56, 5: 2.8, 6: 2.95, 8: 3.6, 12: 4.9, 16: 6.2},
}


def packed_verify_table() -> dict:
    """The verify cost table of the block-kernel variant this process runs (``avx512``, or ``avx2`` for the avx2 and
    scalar variants); a copy."""
    from ..models import kernels  # noqa: PLC0415

    ops = kernels.ops()
    isa = ops.kernel_isa() if ops is not None else "avx2"
    return dict(PACKED_VERIFY_TABLES.get(isa, PACKED_VERIFY_TABLES["avx2"]))
DEFAULT_PRIOR = 0.7
HEAD_PRIOR = 0.6  # a trained draft head (EAGLE reports 0.6-0.8 per token on chat)
PRIOR_WEIGHT = 2.0
DECAY = 0.9
IDLE_DECAY = 0.98  # re-probing a relaxed estimate is paid from the loss budget (at most EPS per cycle long-run)
DEFAULT_LOSS_BUDGET = 0.0  # off by default: it refuses more gains than it saves
MAX_LOSS_BUDGET = 64.0
BUDGET_EPS = 0.02  # allowance per cycle, plain steps: the long-run loss bound (2 %) that lets probing go on
PLAIN_EMA = 0.2  # weight of the newest plain step in the reference time


def verify_cost(width: int, a: float = DEFAULT_VERIFY_COST, base: float = DEFAULT_VERIFY_BASE) -> float:
    """Relative cost of a full-depth forward over ``width`` positions (1 position = 1):
    ``1 + base + a log2(width)`` for ``width >= 2``."""
    if width <= 1:
        return 1.0
    return 1.0 + base + a * math.log2(width)


def table_cost(width: int, table: dict) -> float:
    """Relative cost of a ``width``-position forward from a measured table ``{w: c(w)}`` (``c(1) = 1``):
    linear interpolation between measured widths, linear extrapolation past the widest one."""
    ws = sorted(int(w) for w in table)
    if width <= ws[0]:
        return float(table[ws[0]])
    for lo, hi in zip(ws, ws[1:]):
        if width <= hi:
            return float(table[lo] + (table[hi] - table[lo]) * (width - lo) / (hi - lo))
    lo, hi = ws[-2], ws[-1]
    return float(table[hi] + (table[hi] - table[lo]) * (width - hi) / (hi - lo))


def expected_tokens(alpha: float, m: int) -> float:
    """Expected tokens emitted by a cycle of ``m`` drafts with i.i.d. acceptance ``alpha`` (incl. the
    correction/bonus token): ``sum_{i<=m} alpha^i`` (Leviathan et al. 2023, eq. 1)."""
    if alpha >= 1.0:
        return float(m + 1)
    return (1.0 - alpha ** (m + 1)) / (1.0 - alpha)


@dataclass
class DraftPolicy:
    """Per-request acceptance estimates behind the choice of draft source and length (module docstring).

    Keys are ``"layers"``, ``"ngram/3"``, ``"suffix/2"``, ... (source / match length).
    """

    prior: float = DEFAULT_PRIOR
    counts: dict = field(default_factory=dict)  # key -> [successes, trials]
    max_ngram: int = DEFAULT_MAX_NGRAM  # longest lookup match length (for the pooled misses)

    def prior_of(self, key: str) -> float:
        """The prior acceptance of ``key``: ``prior`` for the shallow path, ``0.6 + 0.08 min(n, 3)`` for an
        ``n``-token lookup match (a longer match predicts its continuation better)."""
        src, _, n = key.partition("/")
        if src == "head":
            return HEAD_PRIOR
        return self.prior if not n else 0.6 + 0.08 * min(int(n), 3)

    def alpha(self, key: str) -> float:
        s, t = self.counts.get(key, (0.0, 0.0))
        return (s + self.prior_of(key) * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)

    def update(self, key: str | None, accepted: int, drafted: int, observed: dict | None = None) -> None:
        """Record a cycle of ``key`` (``None``: a plain step); every estimate not updated relaxes to the prior.

        A rejection (``accepted < drafted``) of a lookup key ``src/n`` is also a failed trial of ``src/n'`` for
        every ``n < n' <= max_ngram`` (pooled misses, module docstring). ``observed``: ``{key: hit}`` free
        observations of a plain step (module docstring), one trial each, a success iff ``hit``."""
        updated = {key}
        for other, hit in (observed or {}).items():
            c = self.counts.setdefault(other, [0.0, 0.0])
            c[0] = c[0] * DECAY + (1.0 if hit else 0.0)
            c[1] = c[1] * DECAY + 1.0
            updated.add(other)
        if key is not None and drafted > 0 and accepted < drafted and "/" in key:
            src, _, n = key.partition("/")
            for longer in range(int(n) + 1, self.max_ngram + 1):
                c = self.counts.setdefault(f"{src}/{longer}", [0.0, 0.0])
                c[0] *= DECAY
                c[1] = c[1] * DECAY + 1
                updated.add(f"{src}/{longer}")
        for other, c in self.counts.items():
            if other not in updated:
                c[0] *= IDLE_DECAY
                c[1] *= IDLE_DECAY
        if key is None or drafted <= 0:
            return
        c = self.counts.setdefault(key, [0.0, 0.0])
        c[0] = c[0] * DECAY + accepted
        c[1] = c[1] * DECAY + accepted + (1 if accepted < drafted else 0)

    def best_length(self, key: str, max_m: int, cost, max_waste: float = math.inf) -> tuple[int, float]:
        """``(m, E(m)/C(m))`` maximising the expected speed-up for ``1 <= m <= max_m`` under ``cost(m)``, among
        the lengths whose waste ``cost(m) - 1`` is at most ``max_waste`` (the loss budget); ``(0, 1.0)`` when
        there is none."""
        a = self.alpha(key)
        best = (0, 1.0)
        for m in range(1, max_m + 1):
            c = cost(m)
            if c - 1.0 > max_waste:
                continue
            gain = expected_tokens(a, m) / c
            if gain > best[1] + 1e-12:
                best = (m, gain)
        return best


def affordable(max_m: int, cost, max_waste: float) -> int:
    """The longest draft ``m <= max_m`` whose waste ``cost(m) - 1`` is at most ``max_waste`` (0: none)."""
    for m in range(max_m, 0, -1):
        if cost(m) - 1.0 <= max_waste:
            return m
    return 0


@dataclass
class LossBudget:
    """A request's loss budget (module docstring): the bank, in plain full-depth steps, that draft cycles may
    lose against plain decoding, and the plain-step reference time that converts cycle seconds into steps.

    Args:
        start: ``B0``, the bank at the start of the request (plain steps, > 0).
        cap: the most the bank may hold (``B0`` + twice the predicted waste of the longest draft).
    """

    start: float
    cap: float
    bank: float = field(init=False)
    plain_s: float | None = None  # EMA of the seconds of the request's plain cycles (None: not timed yet)

    def __post_init__(self):
        self.bank = self.start

    def settle(self, emitted: int, seconds: float, predicted: float, plain: bool) -> float:
        """Book one cycle and return its cost in plain steps: 1 for a plain step (which updates the reference
        time), else ``seconds`` over the reference, or ``predicted`` while no plain step has been timed.

        Args:
            emitted: tokens the cycle emitted.
            seconds: wall-clock seconds of the whole cycle (draft choice, draft, verify, bookkeeping).
            predicted: the cost model's cost of the cycle (plain steps).
            plain: the cycle drafted nothing (a plain full-depth step).
        """
        if plain:
            cost = 1.0
            if seconds > 0:
                self.plain_s = seconds if self.plain_s is None else (1 - PLAIN_EMA) * self.plain_s + PLAIN_EMA * seconds
        else:
            cost = seconds / self.plain_s if self.plain_s else predicted
        self.bank = min(self.cap, self.bank + BUDGET_EPS + emitted - cost)
        return cost


def check_loss_budget(value) -> float:
    """``loss_budget`` as a number of plain steps (``"off"`` -> 0.0).

    Raises:
        InvalidArgumentError: not a finite number in ``[0, 64]`` or ``off``.
    """
    if isinstance(value, str) and value.strip().lower() == "off":
        return 0.0
    if (not is_number(value) or not math.isfinite(value)
            or not 0.0 <= value <= MAX_LOSS_BUDGET):
        raise InvalidArgumentError(f"loss_budget (plain steps a request may lose to drafts that do not pay; 0 or "
                                   f"off disables the budget) must be a number in [0, {MAX_LOSS_BUDGET:g}] or off, "
                                   f"got {value!r}")
    return float(value)


__all__ = ["BUDGET_EPS", "DEFAULT_LOSS_BUDGET", "DEFAULT_VERIFY_BASE", "DEFAULT_VERIFY_COST", "DraftPolicy",
           "LossBudget", "MAX_LOSS_BUDGET", "PACKED_VERIFY_TABLES", "affordable", "check_loss_budget", "expected_tokens",
           "packed_verify_table", "table_cost", "verify_cost"]
