"""``profile(lm)``: the whole profile of one loaded model, as a JSON-ready dict.

Steps (each one tick of the progress bar): decode-step timing (1 token, and ``k + 1`` tokens for a
speculative verify), gate and head check costs, one forward over the calibration text keeping every layer's
hidden state, raw and quick-lens agreement per layer, Block Influence, skip sensitivity of attention and MLP
per layer, static pruning quality, sparse-attention density vs context, and a measured decode of full depth
and of the static-pruning settings (the check of the cost model on this machine).
"""

from __future__ import annotations

import time

import torch

from ..depth.groups import DEFAULT_GROUP_SIZE, default_min_depth
from ..depth.heads import ExitGate
from ..errors import InvalidArgumentError
from . import costs
from .quality import (
    block_influence,
    collect,
    confidence_exits,
    layer_quality,
    skip_sensitivity,
    skippable,
    subset_quality,
)
from .sparse import density_vs_context
from .timing import parameter_shares, time_module, time_step

TARGETS = (0.99, 0.95, 0.90)
THRESHOLDS = tuple(round(0.5 + 0.01 * i, 2) for i in range(50)) + (0.995, 0.999)


def default_drops(num_layers: int) -> list[int]:
    """Static-pruning sizes profiled: 1, 2, L/8 and L/4 layers dropped (distinct, < L)."""
    return sorted({n for n in (1, 2, max(1, num_layers // 8), max(1, num_layers // 4)) if n < num_layers})


@torch.inference_mode()
def measure_decode(engine, spec: str, n: int = 32, reps: int = 3) -> dict:
    """Measured greedy decode through the runtime loop: ``n`` tokens after a 1-token prompt (llama-bench
    tg), median over ``reps``; ``{"spec", "tokens_per_s", "step_s"}``."""
    from ..mode_table import make_mode  # noqa: PLC0415
    from ..runtime.loop import generate_tokens  # noqa: PLC0415
    from ..runtime.sampling import SamplingParams  # noqa: PLC0415

    mode = make_mode(spec, engine)
    greedy = SamplingParams(max_new_tokens=n, temperature=0.0)
    ids = torch.tensor([min(100, engine.config.vocab_size - 1)])
    steps = []
    for _ in range(reps + 1):
        ev = list(generate_tokens(engine, mode, ids, greedy, n))
        steps.append(sum(e.seconds for e in ev[1:]) / max(1, len(ev) - 1))
    steps = sorted(steps[1:])
    step = steps[len(steps) // 2]
    return {"spec": spec, "tokens_per_s": 1.0 / step, "step_s": step}


def measure_against_prediction(engine, drop: list[int], context: int = 64, reps: int = 10, rounds: int = 5,
                               n: int = 64) -> list[dict]:
    """Predicted vs measured decode of full depth and of static pruning (``drop``), in interleaved rounds
    (time the step's parts, then decode full depth and the pruned model, in alternating order; medians), so that
    load from other
    processes affects prediction and measurement alike. Rows: ``{"spec", "step_s", "tokens_per_s",
    "predicted_step_s", "predicted_tokens_per_s", "prediction_error"}`` (+ speedups on the static row)."""
    import statistics  # noqa: PLC0415

    specs = ["full"] + (["static:drop=" + "/".join(str(i) for i in drop)] if drop else [])
    pred = {s: [] for s in specs}
    meas = {s: [] for s in specs}
    for r in range(rounds):
        t = time_step(engine, context=context, tokens=1, reps=reps)
        pred["full"].append(t.total_s)
        if drop:
            pred[specs[1]].append(costs.static_pruning(t, drop)["step_s"])
        for s in (specs if r % 2 == 0 else specs[::-1]):  # alternate the order: no position effect
            meas[s].append(measure_decode(engine, s, n=n, reps=1)["step_s"])
    rows = []
    for s in specs:
        p, m = statistics.median(pred[s]), statistics.median(meas[s])
        rows.append({"spec": s, "step_s": m, "tokens_per_s": 1.0 / m, "predicted_step_s": p,
                     "predicted_tokens_per_s": 1.0 / p, "prediction_error": p / m - 1.0, "rounds": rounds})
    if len(rows) == 2:
        rows[1]["measured_speedup"] = rows[0]["step_s"] / rows[1]["step_s"]
        rows[1]["predicted_speedup"] = rows[0]["predicted_step_s"] / rows[1]["predicted_step_s"]
    return rows


def profile(lm, ids: torch.Tensor, long_ids: torch.Tensor | None = None, *, drops: list[int] | None = None,
            draft_layers: int | None = None, k: int = 4, context: int = 64, reps: int = 10,
            sparse_lengths: tuple[int, ...] = (512, 1024, 2048), sensitivity_positions: int = 256,
            measure: bool = True, progress: bool = True) -> dict:
    """Profile ``lm`` (a :class:`laserlm.LaserLM`) on calibration tokens ``ids [N]`` (``long_ids``: a long
    document for the sparse-attention density; ``None`` skips it).

    Returns a dict with ``timing`` (seconds), ``layers`` (per-layer lists), ``techniques`` (break-even points
    and predicted speedups with their quality cost), ``sparse`` and ``measured``.

    Raises:
        InvalidArgumentError: too few tokens, a bad draft depth or ``k``.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    eng = lm.engine
    L = eng.num_layers
    draft_layers = L // 2 if draft_layers is None else draft_layers
    if not 1 <= draft_layers < L:
        raise InvalidArgumentError(f"draft layers must be in 1-{L - 1}, got {draft_layers}")
    if not 1 <= k <= 16:
        raise InvalidArgumentError(f"k (drafted tokens per cycle) must be in 1-16, got {k}")
    drops = default_drops(L) if drops is None else drops
    can_skip = skippable(eng)
    n_steps = 4 + L + (2 * L if can_skip else 0) + len(drops) + (len(sparse_lengths) if long_ids is not None else 0) \
        + (2 if measure else 0)
    bar = tqdm(total=n_steps, desc="profile", disable=not progress, dynamic_ncols=True, leave=False)
    tick = bar.update
    t_start = time.perf_counter()

    bar.set_postfix_str("timing")
    t1 = time_step(eng, context=context, tokens=1, reps=reps)
    tick()
    tk = time_step(eng, context=context, tokens=k + 1, reps=max(3, reps // 2))
    tick()
    d = eng.config.hidden_size
    gate = ExitGate(d, features="state").to(eng.dtype)
    hsample = torch.randn(1, d, dtype=eng.dtype)
    scal = torch.zeros(1, gate.num_scalars, dtype=eng.dtype)
    gate_s = time_module(lambda: gate(hsample, scal))
    head_check_s = t1.head_s + time_module(lambda: torch.softmax(torch.randn(1, eng.config.vocab_size), -1).max())
    shares = parameter_shares(eng)
    tick()

    bar.set_postfix_str("hidden states")
    hs = collect(eng, ids)
    tick()
    bar.set_postfix_str("exit heads")
    q = layer_quality(eng, hs, progress=tick)
    bi = block_influence(hs)

    sens = {"attention": [], "mlp": []}
    if can_skip:
        for part in ("attention", "mlp"):
            bar.set_postfix_str(f"skip {part}")
            for i in range(L):
                sens[part].append(skip_sensitivity(eng, hs, part, i, sensitivity_positions))
                tick()

    # -- techniques ---------------------------------------------------------------------------
    order = sorted(range(L), key=lambda i: bi[i])
    static_rows = []
    bar.set_postfix_str("static pruning")
    for n in drops:
        dropped = sorted(order[:n])
        kept = [i for i in range(L) if i not in set(dropped)]
        row = {"drop": dropped, **costs.static_pruning(t1, dropped), **subset_quality(eng, hs, kept)}
        static_rows.append(row)
        tick()

    min_depth = default_min_depth(L)
    exit_points = list(range(DEFAULT_GROUP_SIZE, L, DEFAULT_GROUP_SIZE))
    kv = shares["kv_projection"]
    sims = [confidence_exits(q, exit_points, min_depth, th) for th in THRESHOLDS]
    adaptive_rows = []
    for target in TARGETS:
        ok = [s for s in sims if s["agreement"] >= target]
        best = min(ok, key=lambda s: s["layers_per_token"]) if ok else None
        row = {"target": target, "simulation": best}
        if best is not None:
            for name, c in (("state_gate", gate_s), ("head_check", head_check_s)):
                step = costs.adaptive_step(t1, best["layers_per_token"], best["checks_per_token"], c, kv)
                row[f"speedup_{name}"] = t1.total_s / step
        adaptive_rows.append(row)
    points = [p for p in exit_points if p >= min_depth]
    break_even = []
    for p in points:
        checks = len(points)
        break_even.append({"exit_layer": p, "saving_s": costs.exit_saving(t1, p, kv),
                           "rate_state_gate": costs.break_even_exit_rate(t1, p, checks, gate_s, kv),
                           "rate_head_check": costs.break_even_exit_rate(t1, p, checks, head_check_s, kv)})
    spec_row = {"draft_layers": draft_layers, "k": k,
                "break_even_acceptance": costs.break_even_acceptance(t1, tk, draft_layers),
                "acceptance_raw": q.raw_agreement[draft_layers - 1],
                "acceptance_lens": q.lens_agreement[draft_layers - 1]}
    spec_row["speedup_raw"] = costs.speculative_speedup(t1, tk, draft_layers, spec_row["acceptance_raw"])
    spec_row["speedup_lens"] = costs.speculative_speedup(t1, tk, draft_layers, spec_row["acceptance_lens"])
    spec_row["speedup_if_all_accepted"] = costs.speculative_speedup(t1, tk, draft_layers, 1.0)
    skip_rows = {}
    for part, share in (("attention", shares["attention"]), ("mlp", shares["mlp"])):
        if sens[part]:
            best_i = max(range(L), key=lambda i: (sens[part][i]["agreement"], -sens[part][i]["nll_increase"]))
            saved = t1.layer_s[best_i] * share
            skip_rows[part] = {"layer": best_i, "speedup": t1.total_s / (t1.total_s - saved), **sens[part][best_i]}

    sparse_rows = []
    if long_ids is not None:
        bar.set_postfix_str("sparse attention")
        sparse_rows = density_vs_context(eng, long_ids, list(sparse_lengths), progress=tick)
        from ..attention import parse_attention  # noqa: PLC0415

        cfg = parse_attention("sparse")
        for r in sparse_rows:
            r["predicted_prefill_speedup"] = costs.sparse_prefill_speedup(
                eng.config, L, cfg.dense_layers, r["context"], r["density"])
            r["measured_prefill_speedup"] = r["dense_s"] / r["sparse_s"]

    measured = []
    if measure:
        bar.set_postfix_str("measured decode")
        measured = measure_against_prediction(eng, static_rows[-1]["drop"] if static_rows else [], context, reps)
        tick(2)
    bar.close()

    return {
        "num_layers": L, "calibration_tokens": int(ids.shape[0]), "threads": torch.get_num_threads(),
        "weights": eng.weights, "dtype": str(eng.dtype).replace("torch.", ""), "seconds": time.perf_counter() - t_start,
        "timing": {"context": context, "begin_s": t1.begin_s, "head_s": t1.head_s, "call_s": t1.call_s,
                   "step_s": t1.total_s,
                   "predicted_tokens_per_s": 1.0 / t1.total_s, "verify_tokens": k + 1, "verify_step_s": tk.total_s,
                   "state_gate_s": gate_s, "head_check_s": head_check_s, "parameter_shares": shares},
        "layers": {"time_s": t1.layer_s, "verify_time_s": tk.layer_s, "raw_agreement": q.raw_agreement,
                   "lens_agreement": q.lens_agreement, "block_influence": bi,
                   "skip_attention": sens["attention"], "skip_mlp": sens["mlp"]},
        "techniques": {"static_pruning": static_rows, "adaptive_confidence": adaptive_rows,
                       "exit_break_even": break_even, "min_depth": min_depth, "exit_points": exit_points,
                       "speculative": spec_row, "skip": skip_rows},
        "sparse": sparse_rows, "measured": measured,
    }
