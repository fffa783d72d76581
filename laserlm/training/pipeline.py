"""``laserlm calibrate`` end to end: collect -> exit heads -> gates -> [joint] -> router -> thresholds -> artifact.

The run is a list of named stages (:data:`STAGES`, run by :mod:`laserlm.training.stages`). Every
checkpointed stage writes ``<output>.work/<stage>.pt`` and records it in ``<output>.work/manifest.json``
with a hash of its settings and inputs, so that ``resume=True`` skips finished stages whose settings are
unchanged and reruns the others (and the stages that read them).

Data (WikiText-2 *valid* by default, never a test split) is cut into consecutive, disjoint splits of
whole chunks: head training, gate training, threshold calibration, and a held-out evaluation split on
which the run summary reports the measured agreement next to the certified bound.

``source="chat"`` (the calibrated adaptive default of a bundled model, :mod:`laserlm.training.defaults`)
replaces the text by the model's own greedy answers to chat prompts (:mod:`laserlm.training.chat_text`), one
conversation per chunk; then only the positions that predict a generated token count for the thresholds and
the held-out measurement (heads and gates train on all positions).
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..depth.groups import make_groups
from ..depth.heads import GATE_FEATURES
from ..depth.laser_file import LaserArtifact, save_laser_file
from ..depth.policies import AllOf, Compensation, GatePolicy
from ..depth.router import POSITIONS, DynamicRouter, Route
from ..errors import InvalidArgumentError
from ..runtime.options import is_int
from .collect import ExitStates, collect_exit_states, load_text_tokens
from .gates import GateTrainConfig, auroc, gate_probabilities, make_gates, train_gate
from .heads import make_exit_heads
from .predictor import (PredictorTrainConfig, certify_predictor, held_out_report, predictor_inputs,
                        teacher_forced_probs, train_predictor)
from .router import collect_router_data, train_router
from .stages import Stage, StageRunner
from .compensation import (choose_compensation, compensation_candidates, exact_state_measure, relative_change,
                           vetoed)
from .decoding import PropagateDecoding, chunk_sequences, grid_thresholds
from .thresholds import (SHALLOW_MIN_EXITS, SHALLOW_SHARE, calibrate_threshold,  # noqa: F401  (re-exported)
                         candidate_thresholds, exit_decisions, fixed_sequence_test, position_losses, resolve_target,
                         shallow_exit_bias)
from .train import (ExitOutputs, HeadTrainConfig, JointTrainConfig, compute_exit_outputs, head_loss_settings,
                    joint_finetune, train_heads, vocab_size)


@dataclass
class CalibrateConfig:
    """Everything ``laserlm calibrate`` needs; defaults and their sources in the field comments."""

    data: str | None = None            # text file (default WikiText-2 valid); source "chat": a data directory
    source: str = "text"               # "text": the data text; "chat": the model's greedy answers to chat prompts
    groups: str | None = None          # layer groups spec (default: groups of 5, depth package)
    min_depth: int | None = None       # default a quarter of the layers (seed)
    seq_len: int = 256
    train_tokens: int = 8192
    gate_tokens: int = 4096
    calib_tokens: int = 8192
    eval_tokens: int = 4096
    adapter: str = "affine"            # tuned lens (Belrose et al. 2023)
    rank: int = 16
    use_ats: bool = True               # ATS gate feature (seed 004)
    gate_features: str = "state"       # "state": cheap checks (hidden, saturation, ATS, depth); "head": + confidence
    bridge: str = "propagate"          # thresholds certified on: propagate (real decoding) | deferred (exact states)
    patience: int = 0                  # the patience rule certified with the thresholds (seed 000 §2.1: k = 3); 0 off
    compensation: str | float = "off"  # the Residual Bridge's veto (seed 000 §2.1): off | auto | max relative change
    heads: HeadTrainConfig = field(default_factory=HeadTrainConfig)
    gates: GateTrainConfig = field(default_factory=GateTrainConfig)
    joint: JointTrainConfig = field(default_factory=JointTrainConfig)
    predictor: bool = True             # train + certify the pre-layer complexity predictor (seed 000 §2.1)
    predictor_train: PredictorTrainConfig = field(default_factory=PredictorTrainConfig)
    router_prompts: int = 192          # 0 disables the router (seed 004's; mode routed); 57 certify it, one loss each
    router_prompt_len: int = 16
    router_continuation: int = 16
    router_position: str = "last"      # the layer-1 feature's position: last | mean | first (the seed's)
    target_agreement: float | None = 0.99
    max_ppl_increase: float | None = None
    delta: float = 0.1
    p_value: str | None = None         # binomial (agreement) / clt (perplexity)

    def validate(self) -> CalibrateConfig:
        for name in ("train_tokens", "gate_tokens", "calib_tokens", "eval_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < self.seq_len:
                raise InvalidArgumentError(f"{name.replace('_', ' ')} must be an integer >= the sequence length "
                                           f"({self.seq_len}), got {v}")
        if self.seq_len < 2:
            raise InvalidArgumentError(f"sequence length must be >= 2, got {self.seq_len}")
        if (self.target_agreement is None) == (self.max_ppl_increase is None):
            raise InvalidArgumentError("give exactly one target: --target-agreement or --max-ppl-increase")
        if self.target_agreement is not None and not 0 < self.target_agreement < 1:
            raise InvalidArgumentError(f"target agreement must be in (0, 1), got {self.target_agreement}")
        if self.max_ppl_increase is not None and not self.max_ppl_increase > 0:
            raise InvalidArgumentError(f"maximum perplexity increase must be > 0, got {self.max_ppl_increase}")
        if not 0 < self.delta < 1:
            raise InvalidArgumentError(f"delta must be in (0, 1), got {self.delta}")
        if self.gate_features not in GATE_FEATURES:
            raise InvalidArgumentError(f"unknown gate features '{self.gate_features}'; use one of "
                                       f"{', '.join(GATE_FEATURES)}")
        if self.bridge not in ("propagate", "deferred"):
            raise InvalidArgumentError(f"thresholds can be calibrated for bridge 'propagate' or 'deferred', got "
                                       f"'{self.bridge}'")
        if not is_int(self.patience) or self.patience < 0:
            raise InvalidArgumentError(f"patience must be a non-negative integer, got {self.patience!r}")
        if self.patience and self.bridge != "propagate":
            raise InvalidArgumentError("the patience rule is certified on propagate decoding (each calibration chunk "
                                       "decoded in order, with its streak); --bridge deferred replays exact states "
                                       "position by position and cannot certify it: use --patience 0")
        if self.compensation not in ("off", "auto"):
            try:
                c = float(self.compensation)
            except (TypeError, ValueError):
                c = float("nan")
            if not c >= 1e-9 or c == float("inf"):  # the veto's own range (depth.policies.Compensation)
                raise InvalidArgumentError(f"compensation must be 'off', 'auto' or a relative change > 0, got "
                                           f"{self.compensation!r}")
            self.compensation = c
        if self.source not in ("text", "chat"):
            raise InvalidArgumentError(f"calibration source must be 'text' or 'chat', got '{self.source}'")
        if self.router_prompts < 0:
            raise InvalidArgumentError(f"router prompts must be >= 0, got {self.router_prompts}")
        if 0 < self.router_prompts < 4:
            raise InvalidArgumentError(f"the router needs at least 4 prompts (fit, certify and check splits), got "
                                       f"{self.router_prompts}")
        if self.router_position not in POSITIONS:
            raise InvalidArgumentError(f"router position must be one of {', '.join(POSITIONS)}, got "
                                       f"{self.router_position!r}")
        self.heads.validate()
        self.gates.validate()
        self.joint.validate()
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    def training_key(self) -> dict:
        """The settings that determine the trained modules (thresholds can change on resume)."""
        d = self.to_dict()
        for k in ("target_agreement", "max_ppl_increase", "delta", "p_value", "bridge", "patience", "compensation"):
            d.pop(k)
        return d


def _rounded(x: float, digits: int = 4) -> float | None:
    """``x`` rounded, or ``None`` (JSON null) for NaN, e.g. an AUROC on a split where one class is missing."""
    return None if math.isnan(x) else round(x, digits)


def _say(msg: str, progress: bool) -> None:
    if progress:
        tqdm.write(f"laserlm: {msg}", file=sys.stderr)


def _tokens_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


# -- the stages (plain functions of the run context; see laserlm.training.stages) ------------------------
def _counted(ctx: dict, split: ExitStates) -> torch.Tensor | None:
    """``[len(split)]`` bool: the positions of ``split`` that count for thresholds and the held-out measurement
    (source ``chat``: those predicting a generated token); ``None``: all of them."""
    counted = ctx.get("counted")
    if counted is None:
        return None
    seq_len = ctx["cfg"].seq_len  # a split is whole chunks of seq_len positions, in order
    return counted[split.chunk * seq_len + torch.arange(len(split)) % seq_len]


def _set_states(ctx: dict, states: ExitStates) -> None:
    ctx["states"] = states
    total = sum(ctx["chunks"])
    ctx["train"], ctx["gate_split"], ctx["calib"], ctx["held"] = states.split_chunks([c / total for c in ctx["chunks"]])


def _collect(ctx):
    cfg = ctx["cfg"]
    states = collect_exit_states(ctx["engine"], ctx["tokens"][:ctx["n_tok"]], ctx["groups"], cfg.seq_len,
                                 ctx["ats_layer"], ctx["progress"])
    if ctx["adapted"]:  # certify against the model the user chose: the original's tokens are the reference
        states.own_top1 = states.full_top1
        states.full_top1 = _original_top1(ctx)
    _set_states(ctx, states)
    return {"states": states.state_dict()}


def _original_top1(ctx) -> torch.Tensor:
    """The original model's (no delta) full-depth tokens on the collected chunks, same weight format."""
    from ..models.loader import load_model  # noqa: PLC0415
    from ..runtime.engine import Engine  # noqa: PLC0415
    from .collect import reference_top1  # noqa: PLC0415

    lm = ctx["lm"]
    _say("loading the original model (no delta): thresholds are certified against its tokens", ctx["progress"])
    orig = load_model(lm.loaded.name, dtype=lm.engine.dtype, progress=ctx["progress"], weights=lm.loaded.weights,
                      prefill_dtype=lm.loaded.prefill_dtype)
    engine = Engine(orig.model, max_seq_len=lm.engine.max_seq_len)
    with decode_products(engine):
        return reference_top1(engine, ctx["tokens"][:ctx["n_tok"]], ctx["cfg"].seq_len, ctx["progress"])


def _load_collect(ctx, saved):
    _set_states(ctx, ExitStates.from_state_dict(saved["states"]))


def _collect_settings(ctx):
    cfg, g = ctx["cfg"], ctx["groups"]
    return {"model": ctx["lm"].loaded.identity, "dtype": str(ctx["engine"].dtype), "products": "float32",
            "tokens": _tokens_hash(ctx["tokens"][:ctx["n_tok"]]), "groups": g.describe(), "min_depth": g.min_depth,
            "seq_len": cfg.seq_len, "chunks": ctx["chunks"], "ats_layer": ctx["ats_layer"]}


def _new_heads(ctx):
    """Identity-initialised exit heads; on a model adapted by a delta, an affine head at an exit point the delta trained
    an adapter for starts from that adapter (trained jointly with the backbone; the head stage goes on from it)."""
    cfg = ctx["cfg"]
    heads = make_exit_heads(ctx["engine"], ctx["exits"], cfg.adapter, cfg.rank)
    path = ctx["engine"].model.__dict__.get("laserlm_delta_path")
    if path is not None and cfg.adapter == "affine":
        from ..models.delta import read_delta  # noqa: PLC0415

        _, adapters, _ = read_delta(path)
        with torch.no_grad():
            for e in ctx["exits"]:
                if f"{e}.weight" in adapters:
                    heads[str(e)].proj.weight.copy_(adapters[f"{e}.weight"])
                    heads[str(e)].proj.bias.copy_(adapters[f"{e}.bias"])
    return heads


def _heads(ctx):
    heads = ctx["heads"] = _new_heads(ctx)
    ctx["head_report"] = {}
    ctx["head_curve"] = train_heads(heads, ctx["teacher"], ctx["train"], ctx["cfg"].heads, ctx["progress"],
                                    report=ctx["head_report"])
    return {"heads": heads.state_dict(), "curve": ctx["head_curve"], "report": ctx["head_report"]}


def _load_heads(ctx, saved):
    ctx["heads"] = _new_heads(ctx)
    ctx["heads"].load_state_dict(saved["heads"])
    ctx["head_curve"] = list(saved.get("curve", []))
    ctx["head_report"] = dict(saved.get("report", {}))


def _new_gates(ctx):
    cfg = ctx["cfg"]
    return make_gates(ctx["engine"].config.hidden_size, ctx["exits"], cfg.use_ats, cfg.gate_features)


def _gates(ctx):
    cfg, gate_split = ctx["cfg"], ctx["gate_split"]
    gates = ctx["gates"] = _new_gates(ctx)
    g_out = ctx["g_out"] = compute_exit_outputs(ctx["heads"], ctx["teacher"], gate_split, ctx["L"])
    for e in tqdm(ctx["exits"], desc="train exit gates", unit="gate", disable=not ctx["progress"]):
        train_gate(gates[str(e)], gate_split.hidden[e], g_out.scalars[e], g_out.agree[e], cfg.gates, progress=False)
    return {"gates": gates.state_dict()}


def _load_gates(ctx, saved):
    ctx["gates"] = _new_gates(ctx)
    ctx["gates"].load_state_dict(saved["gates"])
    ctx["g_out"] = None


def _joint(ctx):
    heads, gates = ctx["heads"], ctx["gates"]
    joint_finetune(heads, gates, ctx["teacher"], ctx["train"], ctx["L"], ctx["cfg"].joint, ctx["progress"])
    return {"heads": heads.state_dict(), "gates": gates.state_dict()}


def _load_joint(ctx, saved):
    ctx["heads"].load_state_dict(saved["heads"])
    ctx["gates"].load_state_dict(saved["gates"])


def _router_tokens(ctx):
    return ctx["tokens"][ctx["n_tok"]:ctx["n_tok"] + ctx["router_tok"]]


def _router(ctx):
    """Seed 004's router, its data (:mod:`laserlm.training.router`): routes from the exit heads and Block
    Influence, and every route's teacher-forced agreement with the full model on the router prompts (the slow
    part, checkpointed; training and certification are :func:`_router_fit`)."""
    from ..depth.pruning import block_influence  # noqa: PLC0415
    from .router import build_routes  # noqa: PLC0415

    cfg, exits, L, heads, engine = ctx["cfg"], ctx["exits"], ctx["L"], ctx["heads"], ctx["engine"]
    bi = block_influence(engine, ctx["tokens"][:2048])
    routes = build_routes(L, exits, bi)
    rdata = collect_router_data(engine, {e: heads[str(e)] for e in exits}, _router_tokens(ctx), routes,
                                cfg.router_prompts, cfg.router_prompt_len, cfg.router_continuation, ctx["progress"])
    ctx["router_data"] = {"routes": [r.to_dict() for r in routes], "block_influence": bi, "features": rdata.features,
                          "agree": rdata.agree}
    return ctx["router_data"]


def _load_router(ctx, saved):
    ctx["router_data"] = saved


def _router_fit(ctx):
    """Train the router on the first half of the prompts (one per feature position, the configured one kept), with
    labels at the quality target (the route with the fewest layers whose agreement on a prompt's continuation is
    at least the target agreement; every position for a perplexity target); certify its confidence on the next 30 %
    against the full model's greedy tokens (:func:`laserlm.training.router.certify_router`) and check it on the
    last 20 %. Cheap, so it runs on every calibration (a new target re-labels and re-certifies)."""
    from .router import RouterData, certify_router, confidence_candidates, labels_of, route_report  # noqa: PLC0415

    cfg, L, d = ctx["cfg"], ctx["L"], ctx["engine"].config.hidden_size
    saved = ctx["router_data"]
    routes = [Route(tuple(r["kept"]), r["exit"]) for r in saved["routes"]]
    level = cfg.target_agreement if cfg.target_agreement is not None else 1.0
    data = RouterData(saved["features"], saved["agree"], labels_of(saved["agree"], level))
    p = data.labels.numel()
    n_fit, n_cal = max(1, p // 2), max(1, (3 * p) // 10)
    fit, cal, held = data.subset(slice(0, n_fit)), data.subset(slice(n_fit, n_fit + n_cal)), \
        data.subset(slice(n_fit + n_cal, p))
    accuracy, router = {}, None
    for pos in POSITIONS:  # the seed reads the first position; a causal decoder's last one has seen the prompt
        r = DynamicRouter(d, routes, pos)
        train_router(r, fit.features[pos], fit.labels, seed=cfg.heads.seed)
        if held.labels.numel():
            with torch.no_grad():
                accuracy[pos] = round(float((r(held.features[pos]).argmax(-1) == held.labels).float().mean()), 4)
        if pos == cfg.router_position:
            router = r
    agree_rate = saved["agree"].double().mean((0, 2))
    report = {"position": cfg.router_position, "label_agreement": level,
              "routes": {r.describe(L): {"layers": len(r.kept), "agreement": round(float(a), 4)}
                         for r, a in zip(routes, agree_rate)},
              "block_influence": [round(float(x), 5) for x in saved["block_influence"]],
              "label_histogram": {routes[i].describe(L): int((data.labels == i).sum())
                                  for i in range(len(routes)) if int((data.labels == i).sum())},
              "held_out_label_accuracy": accuracy, "split_prompts": [n_fit, n_cal, p - n_fit - n_cal]}
    pos = cfg.router_position
    if cfg.target_agreement is not None and cal.labels.numel():
        c = certify_router(router, cal.features[pos], cal.agree, target_agreement=cfg.target_agreement,
                           delta=cfg.delta, candidates=confidence_candidates(router, fit.features[pos]))
        report["certificate"] = {k: v for k, v in c.to_dict().items() if k != "curve"}
    else:  # a perplexity target: the router's losses are agreements only, so it is not certified and never routes
        router.confidence = 1.0
        report["certificate"] = None
    report["calibration"] = route_report(router, cal.features[pos], cal.agree, L)
    report["held_out"] = route_report(router, held.features[pos], held.agree, L) if held.labels.numel() else None
    ctx["router"], ctx["router_report"] = router, report


def _router_settings(ctx):
    cfg = ctx["cfg"]
    return {"prompts": cfg.router_prompts, "prompt_len": cfg.router_prompt_len, "continuation": cfg.router_continuation,
            "tokens": _tokens_hash(_router_tokens(ctx)), "version": 2}


def _router_fit_settings(ctx):
    cfg = ctx["cfg"]
    return {"position": cfg.router_position, "seed": cfg.heads.seed, **_threshold_settings(ctx)}


def _outputs(ctx):
    """Exit-head outputs of the fixed modules on the calibration, gate and held-out splits (a new target
    on resume reuses them; the propagate decoding caches this stage owns are tied to the same modules)."""
    heads, teacher, L = ctx["heads"], ctx["teacher"], ctx["L"]
    ctx["c_out"] = compute_exit_outputs(heads, teacher, ctx["calib"], L)
    if ctx.get("g_out") is None or ctx["cfg"].joint.epochs > 0:  # gates loaded, or heads changed since the gate stage
        ctx["g_out"] = compute_exit_outputs(heads, teacher, ctx["gate_split"], L)
    ctx["before"] = compute_exit_outputs(None, teacher, ctx["held"], L)
    ctx["after"] = compute_exit_outputs(heads, teacher, ctx["held"], L)
    return {"calib": asdict(ctx["c_out"]), "gate": asdict(ctx["g_out"]), "before": asdict(ctx["before"]),
            "after": asdict(ctx["after"])}


def _load_outputs(ctx, saved):
    for key, name in (("c_out", "calib"), ("g_out", "gate"), ("before", "before"), ("after", "after")):
        ctx[key] = ExitOutputs(**saved[name])


def _thresholds(ctx):
    """Calibrate the gate threshold to the target; held-out decisions (not checkpointed: target-specific)."""
    cfg, exits, L, gates = ctx["cfg"], ctx["exits"], ctx["L"], ctx["gates"]
    c_out, g_out, after = ctx["c_out"], ctx["g_out"], ctx["after"]
    calib, held = ctx["calib"], ctx["held"]
    t0 = time.perf_counter()
    stack = lambda d: torch.stack([d[e] for e in exits])  # noqa: E731
    kind = ctx["kind"] = "agreement" if cfg.target_agreement is not None else "ppl_increase"
    all_pos = lambda n: torch.ones(n, dtype=torch.bool)  # noqa: E731
    g_count, c_count, h_count = (m if (m := _counted(ctx, split)) is not None else all_pos(len(split))
                                 for split in (ctx["gate_split"], calib, held))
    g_probs = gate_probabilities(gates, ctx["gate_split"].hidden, g_out.scalars, exits)[:, g_count]
    ctx["h_probs"] = gate_probabilities(gates, held.hidden, after.scalars, exits)
    ctx["h_count"] = h_count
    g_change = relative_change(ctx["gate_split"], exits)[:, g_count] if cfg.compensation != "off" else None
    comp = _compensation(ctx, g_probs, g_count, g_change)  # None: no veto
    if comp is not None:
        g_probs = vetoed(g_probs, g_change, comp)
    if cfg.bridge == "deferred":  # exact hidden states: replay the decisions on the collected states
        c_probs = gate_probabilities(gates, calib.hidden, c_out.scalars, exits)
        h_probs = ctx["h_probs"]
        if comp is not None:
            c_probs = vetoed(c_probs, relative_change(calib, exits), comp)
            h_probs = vetoed(h_probs, relative_change(held, exits), comp)
        c_probs = c_probs[:, c_count]
        cal = calibrate_threshold(c_probs, stack(c_out.agree)[:, c_count], target_agreement=cfg.target_agreement,
                                  max_ppl_increase=cfg.max_ppl_increase, nll=stack(c_out.nll)[:, c_count],
                                  full_nll=c_out.full_nll[c_count], delta=cfg.delta, method=cfg.p_value,
                                  candidates=candidate_thresholds(g_probs))
        ctx["calibrate_s"] = time.perf_counter() - t0
        dec = exit_decisions(h_probs[:, h_count], cal.threshold)
        held_loss = position_losses(dec, stack(after.agree)[:, h_count], stack(after.nll)[:, h_count],
                                    after.full_nll[h_count], kind)
        layers = torch.tensor(exits + [L], dtype=torch.float64)[dec]
    else:  # propagate: every candidate is tested by decoding the calibration chunks with it
        target, method = resolve_target(cfg.target_agreement, cfg.max_ppl_increase, cfg.delta, cfg.p_value)
        head_d, gate_d = {e: ctx["heads"][str(e)] for e in exits}, {e: gates[str(e)] for e in exits}
        progress = ctx["progress"]
        policy_at, tag = _vetoed_gates(gate_d, comp)

        def decoder(split, outputs, name, count):
            return PropagateDecoding(ctx["engine"], ctx["groups"], head_d, gate_d, ctx["ats_layer"],
                                     chunk_sequences(ctx["tokens"], split, cfg.seq_len), split, outputs.full_nll, kind,
                                     progress=progress, cache_file=ctx["work"] / f"propagate_{name}.pt", count=count,
                                     patience=cfg.patience, policy_at=policy_at, tag=tag)

        def report(entry):
            _say(f"threshold {entry['threshold']:.4f}: risk {entry['risk']:.4f}, p-value {entry['p_value']:.3g}, "
                 f"{entry['exit_fraction']:.1%} of tokens exit", progress)

        cal = fixed_sequence_test(grid_thresholds(g_probs), decoder(calib, c_out, "calib", c_count), target, cfg.delta, method,
                                  on_test=report)
        ctx["calibrate_s"] = time.perf_counter() - t0
        held_dec = decoder(held, after, "held", h_count)
        held_loss, _ = held_dec(cal.threshold if cal.threshold is not None else 1.0)
        layers = held_dec.last_layers.double()
        dec = torch.tensor([exits.index(int(x)) if int(x) in exits else len(exits) for x in layers])
    ctx.update(cal=cal, dec=dec, held_loss=held_loss, layers=layers)


def _predictor_data(ctx, split, outputs):
    exits = ctx["exits"]
    agree = torch.stack([outputs.agree[e] for e in exits])
    return agree, predictor_inputs(ctx["engine"], ctx["tokens"], split, ctx["cfg"].seq_len, agree, exits,
                                   ctx["cfg"].predictor_train.context)


def _new_predictor(ctx):
    pc = ctx["cfg"].predictor_train
    from ..depth.predictor import ComplexityPredictor  # noqa: PLC0415

    return ComplexityPredictor(ctx["engine"].config.hidden_size, ctx["exits"], pc.context, pc.channels,
                               uses_ats=ctx["ats_layer"] is not None)


def _predictor(ctx):
    """Train the complexity predictor on the gate split (the gates' labels, teacher forcing)."""
    pred = ctx["predictor"] = _new_predictor(ctx)
    agree, inputs = _predictor_data(ctx, ctx["gate_split"], ctx["g_out"])
    ctx["predictor_curve"] = train_predictor(pred, inputs, agree, ctx["cfg"].predictor_train)
    return {"predictor": pred.state_dict(), "curve": ctx["predictor_curve"]}


def _load_predictor(ctx, saved):
    ctx["predictor"] = _new_predictor(ctx)
    ctx["predictor"].load_state_dict(saved["predictor"])
    ctx["predictor_curve"] = list(saved.get("curve", []))


def _predictor_thresholds(ctx):
    """Certify the predictor's threshold on the calibration split for the run's bridge, as the gates' is: under
    ``propagate`` every candidate is tested by decoding the calibration chunks with the predictor's decisions
    (:func:`laserlm.depth.batched.score_batch`, per-row predictor state); under ``deferred`` the decisions are
    made in order on exact states. Then measure it on the held-out split."""
    cfg, L, pred, exits = ctx["cfg"], ctx["L"], ctx["predictor"], ctx["exits"]
    t0 = time.perf_counter()
    g_agree, g_in = _predictor_data(ctx, ctx["gate_split"], ctx["g_out"])
    h_agree, h_in = _predictor_data(ctx, ctx["held"], ctx["after"])
    allowed = (1 - cfg.target_agreement) if cfg.target_agreement is not None else None
    if cfg.bridge == "deferred":
        c_agree, c_in = _predictor_data(ctx, ctx["calib"], ctx["c_out"])
        stack = lambda d: torch.stack([d[e] for e in exits])  # noqa: E731
        cands = candidate_thresholds(teacher_forced_probs(pred, g_in), num=60)
        cal, _ = certify_predictor(pred, c_in, c_agree, L, target_agreement=cfg.target_agreement,
                                   max_ppl_increase=cfg.max_ppl_increase, nll=stack(ctx["c_out"].nll),
                                   full_nll=ctx["c_out"].full_nll, delta=cfg.delta, method=cfg.p_value,
                                   candidates=cands, counted=_counted(ctx, ctx["calib"]))
        held = held_out_report(pred, h_in, h_agree, L, cal.threshold, counted=_counted(ctx, ctx["held"]),
                               allowed=allowed)
    else:
        from ..depth.policies import PredictorPolicy  # noqa: PLC0415

        kind = "agreement" if cfg.target_agreement is not None else "ppl_increase"
        target, method = resolve_target(cfg.target_agreement, cfg.max_ppl_increase, cfg.delta, cfg.p_value)
        head_d = {e: ctx["heads"][str(e)] for e in exits}

        def decoder(split, outputs, name):
            return PropagateDecoding(ctx["engine"], ctx["groups"], head_d, None, ctx["ats_layer"],
                                     chunk_sequences(ctx["tokens"], split, cfg.seq_len), split, outputs.full_nll, kind,
                                     progress=ctx["progress"], cache_file=ctx["work"] / f"propagate_predictor_{name}.pt",
                                     count=_counted(ctx, split), policy_at=lambda lam: PredictorPolicy(pred, lam),
                                     patience=cfg.patience)

        g_probs = teacher_forced_probs(pred, g_in)
        g_count = _counted(ctx, ctx["gate_split"])
        cal = fixed_sequence_test(grid_thresholds(g_probs if g_count is None else g_probs[:, g_count]),
                                  decoder(ctx["calib"], ctx["c_out"], "calib"), target, cfg.delta, method,
                                  on_test=lambda e: _say(f"predictor threshold {e['threshold']:.4f}: risk "
                                                         f"{e['risk']:.4f}, {e['exit_fraction']:.1%} of tokens exit",
                                                         ctx["progress"]))
        held_dec = decoder(ctx["held"], ctx["after"], "held")
        loss, _ = held_dec(cal.threshold if cal.threshold is not None else 1.0)
        layers = held_dec.last_layers.double()
        dec = torch.tensor([exits.index(int(x)) if int(x) in exits else len(exits) for x in layers], dtype=torch.long)
        points = list(exits) + [L]
        held = {"positions": int(loss.numel()), "mean_layers": round(float(layers.mean()), 3),
                "exit_fraction": round(float((dec < len(exits)).double().mean()), 4),
                "exit_histogram": {str(e): int((dec == i).sum()) for i, e in enumerate(points)}}
        if kind == "agreement":
            held["agreement"] = round(1 - float(loss.mean()), 5)
        else:
            held["ppl_increase"] = round(math.expm1(float(loss.mean())), 5)
        bias = shallow_exit_bias(dec, loss, len(exits), allowed, who="complexity predictor")
        if bias:
            held["warning"] = bias.format(exit=exits[0])
    if cfg.target_agreement is not None:
        held["target_met"] = bool(held["agreement"] >= cfg.target_agreement)
    h_probs = teacher_forced_probs(pred, h_in)
    auc = [_rounded(auroc(h_probs[i], h_agree[i])) for i in range(len(exits))]
    ctx["predictor_report"] = {
        "bridge": cfg.bridge, "threshold": cal.threshold, "calibration": {k: v for k, v in cal.to_dict().items()
                                                                          if k != "curve"},
        "held_out": held, "auroc_teacher_forced": auc, "train_curve": ctx.get("predictor_curve"),
        "seconds": round(time.perf_counter() - t0, 1)}


def _vetoed_gates(gate_d: dict, comp: float | None):
    """``(policy_at, memo tag)`` for :class:`PropagateDecoding`: the gates under the compensation veto ``comp``, or
    ``(None, "")`` (the gates alone) when ``comp`` is ``None`` or infinite (no veto)."""
    if comp is None or not math.isfinite(comp):
        return None, ""
    return (lambda lam: AllOf([Compensation(comp), GatePolicy(gate_d, lam)])), f"compensation={comp!r}"


def _compensation(ctx, g_probs: torch.Tensor, g_count: torch.Tensor, change: torch.Tensor | None) -> float | None:
    """The compensation veto's threshold for this run (``None``: off): the configured value, or with ``auto`` the one
    :func:`~laserlm.training.compensation.choose_compensation` picks on the gate split, measured on the decoding the
    certificate is about (``propagate``: the gate split decoded for every pair tried; ``deferred``: exact states);
    the choice goes into ``ctx["compensation_report"]``. ``change``: :func:`relative_change` on the gate split's
    counted positions (``None`` when the veto is off)."""
    cfg, exits, L = ctx["cfg"], ctx["exits"], ctx["L"]
    ctx["compensation_report"] = None
    if cfg.compensation == "off":
        return None
    if cfg.compensation != "auto":
        ctx["compensation_report"] = {"threshold": float(cfg.compensation), "chosen_on": "given"}
        return float(cfg.compensation)
    g_out, split = ctx["g_out"], ctx["gate_split"]
    target, _ = resolve_target(cfg.target_agreement, cfg.max_ppl_increase, cfg.delta, cfg.p_value)
    cands = compensation_candidates(change)
    if cfg.bridge == "deferred":
        if target["kind"] == "agreement":
            losses = torch.stack([~g_out.agree[e] for e in exits]).double()
        else:
            losses = torch.stack([g_out.nll[e] for e in exits]).double() - g_out.full_nll.double()
        grid, measure = exact_state_measure(g_probs, change, losses[:, g_count], exits, L)
        where = "gate split (exact states)"
    else:
        head_d, gate_d = {e: ctx["heads"][str(e)] for e in exits}, {e: ctx["gates"][str(e)] for e in exits}
        seqs = chunk_sequences(ctx["tokens"], split, cfg.seq_len)
        decoders = {}  # one per candidate, built when first measured (candidates are measured one after another)

        def decoder(c):
            if c not in decoders:
                policy_at, tag = _vetoed_gates(gate_d, c)
                decoders[c] = PropagateDecoding(ctx["engine"], ctx["groups"], head_d, gate_d, ctx["ats_layer"], seqs,
                                                split, g_out.full_nll, target["kind"], progress=ctx["progress"],
                                                cache_file=ctx["work"] / "propagate_gate.pt",
                                                count=_counted(ctx, split), patience=cfg.patience,
                                                policy_at=policy_at, tag=tag)
            return decoders[c]

        def grid(c):
            return grid_thresholds(vetoed(g_probs, change, c) if math.isfinite(c) else g_probs)

        def measure(c, thr):
            dec = decoder(c)
            losses, _ = dec(thr)
            return float(losses.mean()), float(dec.last_layers.double().mean())

        where = "gate split (propagate decoding)"
    rep = choose_compensation(cands, grid, measure, target["alpha"], L)
    ctx["compensation_report"] = {**rep, "chosen_on": where}
    _say("compensation: " + ("off (no veto saves layers on the gate split)" if rep["threshold"] is None else
                             f"veto exits whose relative change across the group exceeds {rep['threshold']:.4f}"),
         ctx["progress"])
    return rep["threshold"]


def _threshold_settings(ctx):
    cfg = ctx["cfg"]
    return {k: getattr(cfg, k) for k in ("target_agreement", "max_ppl_increase", "delta", "p_value", "bridge",
                                         "patience", "compensation")}


STAGES = (
    Stage("collect", _collect, _load_collect, settings=_collect_settings),
    Stage("heads", _heads, _load_heads, after=("collect",),
          settings=lambda ctx: {"adapter": ctx["cfg"].adapter, "rank": ctx["cfg"].rank, **asdict(ctx["cfg"].heads),
                                "plan": head_loss_settings(ctx["cfg"].heads, vocab_size(ctx["engine"].adapter.lm_head)),
                                "version": 2}),
    Stage("gates", _gates, _load_gates, after=("collect", "heads"),
          settings=lambda ctx: {"use_ats": ctx["cfg"].use_ats, "features": ctx["cfg"].gate_features,
                                **asdict(ctx["cfg"].gates)}),
    Stage("joint", _joint, _load_joint, after=("collect", "heads", "gates"),
          settings=lambda ctx: asdict(ctx["cfg"].joint), when=lambda ctx: ctx["cfg"].joint.epochs > 0),
    Stage("router", _router, _load_router, after=("heads", "joint"), settings=_router_settings,
          when=lambda ctx: ctx["cfg"].router_prompts > 0),
    Stage("router_fit", _router_fit, after=("router",), settings=_router_fit_settings, saves=False,
          when=lambda ctx: ctx["cfg"].router_prompts > 0),
    Stage("outputs", _outputs, _load_outputs, after=("collect", "heads", "gates", "joint"),
          owns=("propagate_calib.pt", "propagate_held.pt", "propagate_gate.pt")),
    Stage("thresholds", _thresholds, after=("outputs",), settings=_threshold_settings, saves=False),
    Stage("predictor", _predictor, _load_predictor, after=("collect", "heads", "gates", "joint", "outputs"),
          settings=lambda ctx: asdict(ctx["cfg"].predictor_train), when=lambda ctx: ctx["cfg"].predictor,
          owns=("propagate_predictor_calib.pt", "propagate_predictor_held.pt")),
    Stage("predictor_thresholds", _predictor_thresholds, after=("outputs", "predictor"), settings=_threshold_settings,
          saves=False, when=lambda ctx: ctx["cfg"].predictor),
)
"""The stages of ``laserlm calibrate``, in order: collect hidden states -> exit heads -> exit gates ->
[joint heads+gates] -> [router data -> router fit + certificate] -> exit-head outputs of the fixed modules -> thresholds -> [complexity predictor
-> its threshold]."""


def _summary(ctx: dict, timings: dict, t_start: float) -> dict:
    """The run summary: per-exit quality and the threshold's measured effect on the held-out split."""
    train, gate_split, calib, held = ctx["train"], ctx["gate_split"], ctx["calib"], ctx["held"]
    lm, cfg, exits, groups, engine = ctx["lm"], ctx["cfg"], ctx["exits"], ctx["groups"], ctx["engine"]
    before, after, h_probs, head_curve = ctx["before"], ctx["after"], ctx["h_probs"], ctx["head_curve"]
    cal, dec, held_loss, layers, kind = ctx["cal"], ctx["dec"], ctx["held_loss"], ctx["layers"], ctx["kind"]
    per_exit = []
    h_count = ctx["h_count"]
    for i, e in enumerate(exits):
        per_exit.append({
            "exit_point": e,
            "agreement_untrained": round(float(before.agree[e].float().mean()), 4),
            "agreement_trained": round(float(after.agree[e].float().mean()), 4),
            "kl_untrained": round(float(before.kl[e].mean()), 4),
            "kl_trained": round(float(after.kl[e].mean()), 4),
            "gate_auroc": _rounded(auroc(h_probs[i][h_count], after.agree[e][h_count])),
            "exit_fraction": round(float((dec == i).double().mean()), 4),
        })
    n_held = int(held_loss.numel())  # the counted held-out positions
    measured = {"positions": n_held, "bridge": cfg.bridge, "patience": cfg.patience,
                "mean_layers": round(float(layers.mean()), 3),
                "full_depth_fraction": round(float((dec == len(exits)).double().mean()), 4)}
    # where the losses fall: at exited tokens, or (propagate only) at full-depth tokens reading bridged K/V
    exited = dec < len(exits)
    measured["loss_at_exited_tokens"] = round(float((held_loss * exited).sum()) / max(n_held, 1), 5)
    measured["loss_at_full_depth_tokens"] = round(float((held_loss * ~exited).sum()) / max(n_held, 1), 5)
    measured["exit_histogram"] = {str(e): int((dec == i).sum()) for i, e in enumerate(exits)}
    measured["exit_histogram"][str(engine.num_layers)] = int((dec == len(exits)).sum())
    bias = shallow_exit_bias(dec, held_loss, len(exits), allowed=(1 - cfg.target_agreement) if kind == "agreement" else None)
    if ctx["adapted"]:  # what the certificate is relative to, and how far the adapted model's full depth is from it
        own = held.own_top1 if h_count is None else held.own_top1[h_count]
        ref = held.full_top1 if h_count is None else held.full_top1[h_count]
        measured["reference"] = "original model (no delta)"
        measured["adapted_full_depth_agreement"] = round(float((own == ref).double().mean()), 5)
    if kind == "agreement":
        measured["agreement"] = round(1 - float(held_loss.mean()), 5)
        measured["target_met"] = bool(measured["agreement"] >= cfg.target_agreement)
    else:
        measured["ppl_increase"] = round(math.expm1(float(held_loss.mean())), 5)
        measured["target_met"] = bool(measured["ppl_increase"] <= cfg.max_ppl_increase)
    timings["total_s"] = time.perf_counter() - t_start
    summary = {
        "model": lm.loaded.name, "dtype": str(engine.dtype).replace("torch.", ""),
        "groups": groups.describe(), "min_depth": groups.min_depth, "exit_points": exits,
        "splits_tokens": {"train": len(train), "gate": len(gate_split), "calibration": len(calib),
                          "held_out": len(held)},
        "calibration": {k: v for k, v in cal.to_dict().items() if k != "curve"},
        "held_out": measured, "per_exit": per_exit, "router": ctx["router_report"],
        "predictor": ctx.get("predictor_report"),
        "compensation": ctx.get("compensation_report"),
        "warnings": ([bias.format(exit=exits[0] if exits else 0)] if bias else [])
                    + ([w] if (w := (ctx.get("predictor_report") or {}).get("held_out", {}).get("warning")) else []),
        "text": ctx["text_report"],
        "head_kl_first_last": [head_curve[0], head_curve[-1]] if head_curve else None,
        "head_loss": ctx.get("head_report"),
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "settings": cfg.to_dict(),
    }
    return summary


def _chat_tokens(lm, cfg: CalibrateConfig, n_tokens: int, work: Path, progress: bool):
    """Source ``chat``: the stream of :func:`laserlm.training.chat_text.chat_token_stream`, generated once into
    ``<work>/chat_text.pt`` (reused while the model, the recipe, the prompt files and the sizes are unchanged)."""
    from ..data import data_root  # noqa: PLC0415
    from ..defaults import CHAT_PROMPT_SOURCES, _file_digest  # noqa: PLC0415
    from .chat_text import CHAT_TEXT_VERSION, chat_token_stream  # noqa: PLC0415

    root = Path(cfg.data).expanduser() if cfg.data else data_root("--data", "data directory with the chat prompts")
    if not root.is_dir():
        raise InvalidArgumentError(f"--data {root}: source 'chat' takes a data directory (with "
                                   f"{', '.join(CHAT_PROMPT_SOURCES)})")
    n_records = -(-n_tokens // cfg.seq_len)
    files = {rel: _file_digest(root / rel) if (root / rel).is_file() else None for rel in CHAT_PROMPT_SOURCES}
    key = {"model": lm.loaded.identity, "dtype": str(lm.engine.dtype), "version": CHAT_TEXT_VERSION,
           "records": n_records, "seq_len": cfg.seq_len, "files": files}
    cache = work / "chat_text.pt"
    if cache.is_file():
        try:
            saved = torch.load(cache)
            if saved.get("key") == key:
                _say(f"reusing the chat calibration text in {cache}", progress)
                return saved["tokens"], saved["counted"], saved["report"]
        except Exception:  # noqa: BLE001  (unreadable: generate again)
            pass
    t0 = time.perf_counter()
    tokens, counted, report = chat_token_stream(lm.engine, n_records, cfg.seq_len, root, progress=progress)
    report = {"source": "chat", **report, "generate_s": round(time.perf_counter() - t0, 1)}
    work.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "tokens": tokens, "counted": counted, "report": report}, cache)
    return tokens, counted, report


class decode_products:
    """Context manager: the quantized matrices of ``engine`` multiply many rows with the arithmetic of a decode step
    (the int16 block kernels; float32 where they are not built) while it is active.

    Calibration compares decoding token by token (the decode kernel) with references from many-row forwards
    (collected states, batched propagate decoding). With a bfloat16 many-row product the reference logits were
    rounded into ties that flipped the top-1 token at ~3 % of positions (SmolLM2, Zen 4: 30 of 1024 against 1 in
    float32), a disagreement floor that no threshold can remove. With the kernels' arithmetic every row is computed
    as in decoding. Float weights are unaffected."""

    def __init__(self, engine):
        a = engine.adapter
        parts = list(getattr(a, "layers", None) or []) + [getattr(a, "lm_head", None)]
        self.mods = [m for part in parts if part is not None for m in part.modules() if hasattr(m, "prefill_dtype")]
        self.saved = []

    def __enter__(self):
        self.saved = [m.prefill_dtype for m in self.mods]
        from ..models import kernels  # noqa: PLC0415

        products = torch.int16 if kernels.ops() is not None else torch.float32
        for m in self.mods:
            m.prefill_dtype = products
        return self

    def __exit__(self, *exc):
        for m, d in zip(self.mods, self.saved):
            m.prefill_dtype = d
        return False


def calibrate(lm, cfg: CalibrateConfig, output, resume: bool = False, progress: bool = True,
              work_dir=None) -> dict:
    """Run the calibration and write the artifact to ``output``; returns the run summary (JSON-able).

    The run is the stage list :data:`STAGES` executed by :class:`~laserlm.training.stages.StageRunner` in
    ``work_dir`` (default ``<output>.work``). Every checkpointed stage is recorded in
    ``<work_dir>/manifest.json`` with a hash of its settings and inputs; with ``resume`` the stages whose
    hash is unchanged are loaded, and a stage whose settings changed runs again together with the stages
    that read it (so another target reuses the trained heads, gates and router and only re-calibrates).
    An unreadable manifest or checkpoint is ignored with a :class:`~laserlm.training.stages.ManifestWarning`
    and recomputed. Without ``resume`` the work directory's stages are cleared first.

    Raises:
        InvalidArgumentError: bad settings, not enough text, a test split as data.
        DataFileError: the calibration text is not found (the message names ``--data``).
    """
    cfg.validate()
    t_start = time.perf_counter()
    engine = lm.engine
    from ..models.delta import ATTRIBUTE as DELTA  # noqa: PLC0415

    adapted = engine.model.__dict__.get(DELTA) is not None
    if adapted and (cfg.bridge != "propagate" or cfg.target_agreement is None):
        raise InvalidArgumentError("on a model adapted by a delta, calibrate certifies agreement with the original "
                                   "model under propagate decoding; --bridge deferred and --max-ppl-increase are not "
                                   "supported there yet")
    L = engine.num_layers
    groups = make_groups(cfg.groups, L, cfg.min_depth)
    exits = groups.exit_points
    if not exits:
        raise InvalidArgumentError(f"layer groups {groups.describe()} with min depth {groups.min_depth} leave no "
                                   "exit point")
    output = Path(output)
    if not output.parent.is_dir():
        raise InvalidArgumentError(f"output directory does not exist: {output.parent}")
    work = Path(work_dir) if work_dir is not None else output.with_name(output.name + ".work")

    t0 = time.perf_counter()
    sizes = [cfg.train_tokens, cfg.gate_tokens, cfg.calib_tokens, cfg.eval_tokens]
    chunks = [s // cfg.seq_len for s in sizes]
    n_tok = sum(chunks) * cfg.seq_len + 1
    router_tok = cfg.router_prompts * cfg.router_prompt_len
    counted, text_report = None, {"source": "text"}
    if cfg.source == "chat":
        tokens, counted, text_report = _chat_tokens(lm, cfg, n_tok + router_tok, work, progress)
    else:
        tokens = load_text_tokens(lm.tokenizer, cfg.data, max_tokens=n_tok + router_tok)
    if tokens.shape[0] < n_tok + router_tok:
        raise InvalidArgumentError(f"the text has {tokens.shape[0]} tokens; this run needs {n_tok + router_tok} "
                                   "(lower the split sizes or give a longer --data file)")
    load_s = time.perf_counter() - t0
    ctx = {"lm": lm, "engine": engine, "cfg": cfg, "groups": groups, "exits": exits, "L": L, "work": work,
           "progress": progress, "tokens": tokens, "chunks": chunks, "n_tok": n_tok, "router_tok": router_tok,
           "ats_layer": (exits[0] - 1) if cfg.use_ats else None, "teacher": engine.head,
           "head_curve": [], "router": None, "router_report": None, "g_out": None, "counted": counted,
           "predictor": None, "predictor_report": None,
           "text_report": text_report, "adapted": adapted}
    runner = StageRunner(work, list(STAGES), resume=resume, say=lambda m: _say(m, progress))
    with decode_products(engine):  # one arithmetic for references and decoding (see decode_products)
        runner.run(ctx)
    sec = runner.seconds
    timings = {"collect_s": load_s + sec.get("collect", 0.0)}
    for name in ("heads", "gates", "joint", "router", "predictor"):
        timings[f"{name}_s"] = sec.get(name, 0.0)
    if ctx.get("predictor_report") is not None:  # the predictor's certification (decoding under propagate)
        timings["predictor_thresholds_s"] = ctx["predictor_report"]["seconds"]
    timings["thresholds_s"] = sec.get("outputs", 0.0) + ctx["calibrate_s"]
    summary = _summary(ctx, timings, t_start)
    heads, gates, cal = ctx["heads"], ctx["gates"], ctx["cal"]
    # the depth package's adaptive mode reads thresholds["gate_threshold"] (GatePolicy: exit iff prob > it);
    # 1.0 = never exit when no threshold could be certified
    thresholds = {"gate_threshold": cal.threshold if cal.threshold is not None else 1.0}
    if (ctx.get("compensation_report") or {}).get("threshold") is not None:  # the veto the gate threshold was certified with
        thresholds["compensation"] = ctx["compensation_report"]["threshold"]
    config = {"groups": groups.describe(), "min_depth": groups.min_depth, "policy": "gate",
              "ats_layer": ctx["ats_layer"], "bridge": cfg.bridge, "patience": cfg.patience, "calibration": summary}
    if ctx["predictor_report"] is not None:  # policy=predictor reads these; certified for the run's bridge
        thr = ctx["predictor_report"]["threshold"]
        thresholds["predictor_threshold"] = thr if thr is not None else 1.0
        config["predictor_bridge"] = cfg.bridge
    save_laser_file(output, lm, LaserArtifact(heads={e: heads[str(e)] for e in exits},
                                              gates={e: gates[str(e)] for e in exits}, router=ctx["router"],
                                              predictor=ctx["predictor"], thresholds=thresholds, config=config),
                    json_copy=True)
    return summary


def format_summary(s: dict) -> str:
    """Human-readable run summary."""
    lines = [f"calibrated {s['model']} ({s['dtype']}), groups {s['groups']}, min depth {s['min_depth']}",
             f"  splits (positions): {s['splits_tokens']}",
             "  exit  agree(untrained) agree(trained)  KL before -> after  gate AUROC  exiting here"]
    for r in s["per_exit"]:
        lines.append(f"  {r['exit_point']:>4}  {r['agreement_untrained']:>16.3f} {r['agreement_trained']:>14.3f}"
                     f"  {r['kl_untrained']:>9.3f} -> {r['kl_trained']:<6.3f}  {r['gate_auroc'] if r['gate_auroc'] is not None else float('nan'):>10.3f}"
                     f"  {r['exit_fraction']:>11.1%}")
    c, h = s["calibration"], s["held_out"]
    if (s.get("head_loss") or {}).get("steps"):
        hl = s["head_loss"]
        lines.append(f"  exit heads: {hl['steps']} steps of the {hl['loss']} KL"
                     + (f" (teacher top {hl['teacher_topk']} + tail, {hl['negatives']} sampled tokens a step)"
                        if hl["loss"] == "sampled" else "")
                     + (f"; exit points {hl['reverted']} kept their starting adapter (training did not lower their"
                        f" exact KL)" if hl.get("reverted") else ""))
    lines.append(f"  guarantee: {c['guarantee']}")
    comp = (s.get("compensation") or {}).get("threshold")
    lines.append(f"  certified with: patience {s['settings'].get('patience', 0)}, compensation veto "
                 + ("off" if comp is None else f"relative change <= {comp:.4g} ({s['compensation']['chosen_on']})"))
    lines.append(f"  calibration split: risk {c['risk']:.4f} over {c['n']} positions, {c['tested']} thresholds tested")
    measured = (f"agreement {h['agreement']:.4f}" if "agreement" in h else f"perplexity increase {h['ppl_increase']:.2%}")
    lines.append(f"  held-out split ({h['positions']} positions, patience {h.get('patience', 0)}): {measured}, "
                 f"mean layers {h['mean_layers']:.2f}, "
                 f"full depth {h['full_depth_fraction']:.1%}, target met: {h['target_met']}")
    if "loss_at_exited_tokens" in h:
        lines.append(f"  held-out losses as a share of all positions: {h['loss_at_exited_tokens']:.4f} at tokens that "
                     f"exited, {h['loss_at_full_depth_tokens']:.4f} at full-depth tokens ({h['bridge']} bridge)")
    if s.get("router"):
        r = s["router"]
        hist = ", ".join(f"{k}: {v}" for k, v in r["label_histogram"].items())
        c, h = r.get("certificate"), r.get("held_out")
        conf = "not certified" if not c else (f"confidence {c['threshold']:.4g} certified" if c["threshold"] is not None
                                              else "no confidence certified (full depth)")
        lines.append(f"  router ({r['position']} position after layer 1; mode routed:laser=PATH): labels {hist}; "
                     f"{conf}" + (f"; held-out {h['prompts']} prompts: routes {h['routes']}, agreement "
                                  f"{h['agreement']}, layers saved {h['layers_saved']:.1%}" if h else ""))
    p = s.get("predictor")
    if p:
        ph = p["held_out"]
        thr = "none (never exits)" if p["threshold"] is None else f"{p['threshold']:.4f}"
        measured = (f"agreement {ph['agreement']:.4f}" if ph.get("agreement") is not None
                    else f"perplexity increase {ph['ppl_increase']:.2%}")
        lines.append(f"  complexity predictor (pre-layer, {p.get('bridge', 'deferred')} bridge): threshold {thr}; "
                     f"held-out {measured}, mean layers {ph['mean_layers']:.2f}, {ph['exit_fraction']:.1%} exit "
                     f"(use with adaptive:laser=PATH,policy=predictor)")
    lines.append(f"  time: {s['timings_s']}")
    return "\n".join(lines)
