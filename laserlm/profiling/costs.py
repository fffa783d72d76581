"""Break-even points and predicted speedups of each technique, from measured per-part costs.

All times are seconds of one decode step (see :class:`~laserlm.profiling.timing.StepTimes`). The models are
deliberately simple (documented per function) so that a user can check whether a technique can pay on this
machine before calibrating anything. Speedups are full-depth decode time / the technique's decode time.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError


def static_pruning(t1, dropped: list[int]) -> dict:
    """Static pruning (ShortGPT): the ``dropped`` layers never run; the rest of the step is unchanged, except
    that the kept layers run as one run per block of consecutive kept layers (one ``call_s`` each).

    Returns ``{"step_s", "speedup", "layers"}``.
    """
    gone = set(dropped)
    kept = [i for i in range(len(t1.layer_s)) if i not in gone]
    runs = sum(1 for n, i in enumerate(kept) if n == 0 or kept[n - 1] != i - 1)
    step = t1.begin_s + sum(t1.layer_s[i] for i in kept) + runs * t1.call_s + t1.head_s
    return {"step_s": step, "speedup": t1.total_s / step, "layers": len(t1.layer_s) - len(dropped)}


def exit_saving(t1, exit_layer: int, kv_share: float, bridge: str = "propagate") -> float:
    """Seconds saved by one token stopping after ``exit_layer`` layers: the skipped layers' time, less the
    bridge's cost for them (``propagate`` projects K/V for every skipped layer: ``kv_share`` of each layer's
    time; ``deferred`` runs the skipped layers later: nothing saved; ``none``: no bridge cost)."""
    skipped = t1.layers_s(exit_layer, len(t1.layer_s))
    if bridge == "propagate":
        return skipped * (1.0 - kv_share)
    if bridge == "deferred":
        return 0.0
    if bridge == "none":
        return skipped
    raise InvalidArgumentError(f"unknown bridge {bridge!r}; expected propagate, deferred or none")


def break_even_exit_rate(t1, exit_layer: int, checks: int, check_s: float, kv_share: float,
                         bridge: str = "propagate") -> float:
    """Fraction of tokens that must stop after ``exit_layer`` layers for an exit policy to pay for itself.

    Every token pays ``checks`` exit checks of ``check_s`` seconds (the policy asks at each exit point it
    passes; a token that stops early pays fewer, ignored here, so the rate is slightly pessimistic); each
    stopping token saves :func:`exit_saving`. Returns ``checks * check_s / saving`` (``inf`` when nothing is
    saved; a value above 1 means the technique cannot pay at that exit point).
    """
    saving = exit_saving(t1, exit_layer, kv_share, bridge)
    return float("inf") if saving <= 0 else checks * check_s / saving


def adaptive_step(t1, layers_per_token: float, checks_per_token: float, check_s: float, kv_share: float) -> float:
    """Predicted seconds of an adaptive-depth decode step (propagate bridge): begin + the layers run
    (``layers_per_token`` on average; layer time interpolated by the mean layer time past the exit) + the K/V
    projections of the skipped layers + ``checks_per_token`` checks of ``check_s`` (each check ends a run of
    layers, so each also pays one more ``call_s``) + one exit head."""
    L = len(t1.layer_s)
    mean_layer = sum(t1.layer_s) / L
    skipped = L - layers_per_token
    return (t1.begin_s + sum(t1.layer_s) - skipped * mean_layer * (1.0 - kv_share)
            + checks_per_token * (check_s + t1.call_s) + t1.call_s + t1.head_s)


def expected_accepted(alpha: float, k: int) -> float:
    """Tokens produced per speculative cycle with ``k`` drafts and independent per-token acceptance
    ``alpha`` (Leviathan et al. 2023, eq. 1): ``(1 - alpha^(k+1)) / (1 - alpha)``."""
    if not 0.0 <= alpha <= 1.0:
        raise InvalidArgumentError(f"acceptance must be in [0, 1], got {alpha}")
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speculative_cycle_s(t1, tk, draft_layers: int) -> float:
    """Seconds of one self-speculative cycle with ``k = tk.tokens - 1`` drafts (LayerSkip with reuse): ``k``
    shallow steps (begin + layers ``0..N-1`` + exit head) and one verify of ``k + 1`` tokens through layers
    ``N..L-1`` + head (``tk``: times of a ``k + 1``-token forward)."""
    k = tk.tokens - 1
    draft = t1.begin_s + t1.layers_s(0, draft_layers) + t1.call_s + t1.head_s
    verify = tk.begin_s + tk.layers_s(draft_layers, len(tk.layer_s)) + tk.call_s + tk.head_s
    return k * draft + verify


def speculative_speedup(t1, tk, draft_layers: int, alpha: float) -> float:
    """Predicted decode speedup of self-speculative decoding at acceptance ``alpha``."""
    k = tk.tokens - 1
    return expected_accepted(alpha, k) * t1.total_s / speculative_cycle_s(t1, tk, draft_layers)


def break_even_acceptance(t1, tk, draft_layers: int, tol: float = 1e-4) -> float:
    """The acceptance at which self-speculative decoding matches full depth (bisection); ``inf`` when even
    ``alpha = 1`` does not pay."""
    if speculative_speedup(t1, tk, draft_layers, 1.0) < 1.0:
        return float("inf")
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if speculative_speedup(t1, tk, draft_layers, mid) >= 1.0:
            hi = mid
        else:
            lo = mid
    return hi


def sparse_prefill_speedup(cfg, num_layers: int, dense_layers: int, context: int, density: float) -> float:
    """FLOP model of block-sparse prefill over ``context`` tokens: per layer and token, ``2 * params`` for
    the weight matrices plus ``4 * heads * head_dim * n`` for attention over ``n`` keys (``n`` averages
    ``context / 2`` under the causal mask); sparse layers compute ``density`` of the attention part.
    Selection overhead is not counted (an upper bound on the wall-clock gain)."""
    d = cfg.hidden_size
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or d // heads
    kvh = cfg.num_key_value_heads
    params = 2 * heads * hd * d + 2 * kvh * hd * d + 3 * d * cfg.intermediate_size
    attn = 4 * heads * hd * context / 2
    dense = num_layers * (2 * params + attn)
    sparse = num_layers * 2 * params + (dense_layers + (num_layers - dense_layers) * density) * attn
    return dense / sparse
