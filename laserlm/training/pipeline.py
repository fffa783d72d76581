"""``laserlm calibrate`` end to end: collect -> exit heads -> gates -> [joint] -> router -> thresholds -> artifact.

Every stage writes a checkpoint into ``<output>.work/`` so that ``resume=True`` skips finished stages
(the configuration must be unchanged; it is stored in ``config.json`` there and compared).

Data (WikiText-2 *valid* by default, never a test split) is cut into consecutive, disjoint splits of
whole chunks: head training, gate training, threshold calibration, and a held-out evaluation split on
which the run summary reports the measured agreement next to the certified bound.
"""

from __future__ import annotations

import json
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
from ..depth.router import DynamicRouter
from ..errors import InvalidArgumentError
from .collect import ExitStates, collect_exit_states, load_text_tokens
from .gates import GateTrainConfig, auroc, gate_probabilities, make_gates, train_gate
from .heads import make_exit_heads
from .router import collect_router_data, train_router
from .decoding import PropagateDecoding, chunk_sequences, grid_thresholds
from .thresholds import (calibrate_threshold, candidate_thresholds, exit_decisions, fixed_sequence_test,
                         position_losses, resolve_target)
from .train import (ExitOutputs, HeadTrainConfig, JointTrainConfig, compute_exit_outputs, joint_finetune,
                    train_heads)


@dataclass
class CalibrateConfig:
    """Everything ``laserlm calibrate`` needs; defaults and their sources in the field comments."""

    data: str | None = None            # text file (default WikiText-2 valid)
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
    heads: HeadTrainConfig = field(default_factory=HeadTrainConfig)
    gates: GateTrainConfig = field(default_factory=GateTrainConfig)
    joint: JointTrainConfig = field(default_factory=JointTrainConfig)
    router_prompts: int = 48           # 0 disables the router
    router_prompt_len: int = 64
    router_continuation: int = 8
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
        if self.router_prompts < 0:
            raise InvalidArgumentError(f"router prompts must be >= 0, got {self.router_prompts}")
        self.heads.validate()
        self.gates.validate()
        self.joint.validate()
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    def training_key(self) -> dict:
        """The settings that determine the trained modules (thresholds can change on resume)."""
        d = self.to_dict()
        for k in ("target_agreement", "max_ppl_increase", "delta", "p_value", "bridge"):
            d.pop(k)
        return d


def _say(msg: str, progress: bool) -> None:
    if progress:
        tqdm.write(f"laserlm: {msg}", file=sys.stderr)


def calibrate(lm, cfg: CalibrateConfig, output, resume: bool = False, progress: bool = True,
              work_dir=None) -> dict:
    """Run the calibration and write the artifact to ``output``; returns the run summary (JSON-able).

    ``work_dir`` holds the per-stage checkpoints (default ``<output>.work``); with ``resume`` a run with
    the same training settings but another target reuses the trained heads, gates and router.

    Raises:
        InvalidArgumentError: bad settings, resume with a different configuration, not enough text.
        ModelNotFoundError: the data file does not exist.
    """
    cfg.validate()
    t_start = time.perf_counter()
    engine = lm.engine
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
    work.mkdir(parents=True, exist_ok=True)
    key = {"model": lm.loaded.identity, "dtype": str(engine.dtype), **cfg.training_key()}
    key_file = work / "config.json"
    if resume and key_file.is_file():
        old = json.loads(key_file.read_text())
        new = json.loads(json.dumps(key))
        if old != new:
            changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise InvalidArgumentError(f"--resume: {work} was made with different settings ({', '.join(changed)}); "
                                       "remove it or drop --resume")
    elif not resume:
        for name in ("states", "heads", "gates", "joint", "router", "outputs", "propagate_calib", "propagate_held"):
            (work / f"{name}.pt").unlink(missing_ok=True)
    key_file.write_text(json.dumps(key, indent=2))
    timings = {}

    def stage(name):
        return (work / f"{name}.pt") if resume and (work / f"{name}.pt").is_file() else None

    # 1. collect hidden states once --------------------------------------------------------------
    t0 = time.perf_counter()
    ats_layer = (exits[0] - 1) if cfg.use_ats else None
    sizes = [cfg.train_tokens, cfg.gate_tokens, cfg.calib_tokens, cfg.eval_tokens]
    chunks = [s // cfg.seq_len for s in sizes]
    n_tok = sum(chunks) * cfg.seq_len + 1
    router_tok = cfg.router_prompts * cfg.router_prompt_len
    tokens = load_text_tokens(lm.tokenizer, cfg.data, max_tokens=n_tok + router_tok)
    if tokens.shape[0] < n_tok + router_tok:
        raise InvalidArgumentError(f"the text has {tokens.shape[0]} tokens; this run needs {n_tok + router_tok} "
                                   "(lower the split sizes or give a longer --data file)")
    if (p := stage("states")) is not None:
        states = ExitStates.from_state_dict(torch.load(p))
        _say("resume: hidden states loaded", progress)
    else:
        states = collect_exit_states(engine, tokens[:n_tok], groups, cfg.seq_len, ats_layer, progress)
        torch.save(states.state_dict(), work / "states.pt")
    total = sum(chunks)
    train, gate_split, calib, held = states.split_chunks([c / total for c in chunks])
    timings["collect_s"] = time.perf_counter() - t0

    # 2. exit heads ------------------------------------------------------------------------------
    t0 = time.perf_counter()
    heads = make_exit_heads(engine, exits, cfg.adapter, cfg.rank)
    teacher = engine.head
    if (p := stage("heads")) is not None:
        heads.load_state_dict(torch.load(p))
        _say("resume: exit heads loaded", progress)
        head_curve = []
    else:
        head_curve = train_heads(heads, teacher, train, cfg.heads, progress)
        torch.save(heads.state_dict(), work / "heads.pt")
    timings["heads_s"] = time.perf_counter() - t0

    # 3. gates -----------------------------------------------------------------------------------
    t0 = time.perf_counter()
    gates = make_gates(engine.config.hidden_size, exits, cfg.use_ats, cfg.gate_features)
    g_out = None
    if (p := stage("gates")) is not None:
        gates.load_state_dict(torch.load(p))
        _say("resume: exit gates loaded", progress)
    else:
        g_out = compute_exit_outputs(heads, teacher, gate_split, L)
        for e in tqdm(exits, desc="train exit gates", unit="gate", disable=not progress):
            train_gate(gates[str(e)], gate_split.hidden[e], g_out.scalars[e], g_out.agree[e], cfg.gates,
                       progress=False)
        torch.save(gates.state_dict(), work / "gates.pt")
    timings["gates_s"] = time.perf_counter() - t0

    # 4. optional joint stage --------------------------------------------------------------------
    t0 = time.perf_counter()
    if cfg.joint.epochs > 0:
        if (p := stage("joint")) is not None:
            sd = torch.load(p)
            heads.load_state_dict(sd["heads"])
            gates.load_state_dict(sd["gates"])
        else:
            joint_finetune(heads, gates, teacher, train, L, cfg.joint, progress)
            torch.save({"heads": heads.state_dict(), "gates": gates.state_dict()}, work / "joint.pt")
    timings["joint_s"] = time.perf_counter() - t0

    # 5. router ----------------------------------------------------------------------------------
    t0 = time.perf_counter()
    router, router_report = None, None
    if cfg.router_prompts > 0:
        router = DynamicRouter(engine.config.hidden_size, exits)
        if (p := stage("router")) is not None:
            sd = torch.load(p)
            router.load_state_dict(sd["router"])
            router_report = sd["report"]
        else:
            head_fns = {e: heads[str(e)] for e in exits}
            rdata = collect_router_data(engine, head_fns, tokens[n_tok:n_tok + router_tok], exits,
                                        cfg.router_prompts, cfg.router_prompt_len, cfg.router_continuation,
                                        progress)
            n_fit = max(1, int(round(0.75 * cfg.router_prompts)))
            from .router import RouterData  # noqa: PLC0415

            fit = RouterData(rdata.pooled[:n_fit], rdata.labels[:n_fit])
            train_router(router, fit, seed=cfg.heads.seed)
            with torch.no_grad():
                pred = router(rdata.pooled[n_fit:]).argmax(-1) if n_fit < cfg.router_prompts else torch.empty(0)
            lab = rdata.labels[n_fit:]
            router_report = {
                "label_histogram": {str(exits[r] if r < len(exits) else L): int((rdata.labels == r).sum())
                                    for r in range(len(exits) + 1)},
                "held_out_prompts": int(lab.numel()),
                "held_out_accuracy": float((pred == lab).float().mean()) if lab.numel() else None,
                "held_out_safe_rate": float((pred >= lab).float().mean()) if lab.numel() else None,
            }
            torch.save({"router": router.state_dict(), "report": router_report}, work / "router.pt")
    timings["router_s"] = time.perf_counter() - t0

    # 6. thresholds ------------------------------------------------------------------------------
    t0 = time.perf_counter()
    if (p := stage("outputs")) is not None:  # exit-head outputs of the fixed modules: reuse for a new target
        cached = torch.load(p)
        c_out, g_out, before, after = (ExitOutputs(**cached[k]) for k in ("calib", "gate", "before", "after"))
    else:
        c_out = compute_exit_outputs(heads, teacher, calib, L)
        if g_out is None or cfg.joint.epochs > 0:  # heads changed since the gate stage
            g_out = compute_exit_outputs(heads, teacher, gate_split, L)
        before = compute_exit_outputs(None, teacher, held, L)
        after = compute_exit_outputs(heads, teacher, held, L)
        torch.save({k: asdict(v) for k, v in (("calib", c_out), ("gate", g_out), ("before", before),
                                              ("after", after))}, work / "outputs.pt")
    stack = lambda d: torch.stack([d[e] for e in exits])  # noqa: E731
    kind = "agreement" if cfg.target_agreement is not None else "ppl_increase"
    g_probs = gate_probabilities(gates, gate_split.hidden, g_out.scalars, exits)
    h_probs = gate_probabilities(gates, held.hidden, after.scalars, exits)
    if cfg.bridge == "deferred":  # exact hidden states: replay the decisions on the collected states
        c_probs = gate_probabilities(gates, calib.hidden, c_out.scalars, exits)
        cal = calibrate_threshold(c_probs, stack(c_out.agree), target_agreement=cfg.target_agreement,
                                  max_ppl_increase=cfg.max_ppl_increase, nll=stack(c_out.nll),
                                  full_nll=c_out.full_nll, delta=cfg.delta, method=cfg.p_value,
                                  candidates=candidate_thresholds(g_probs))
        timings["thresholds_s"] = time.perf_counter() - t0
        dec = exit_decisions(h_probs, cal.threshold)
        held_loss = position_losses(dec, stack(after.agree), stack(after.nll), after.full_nll, kind)
        layers = torch.tensor(exits + [L], dtype=torch.float64)[dec]
    else:  # propagate: every candidate is tested by decoding the calibration chunks with it
        target, method = resolve_target(cfg.target_agreement, cfg.max_ppl_increase, cfg.delta, cfg.p_value)
        head_d, gate_d = {e: heads[str(e)] for e in exits}, {e: gates[str(e)] for e in exits}

        def decoder(split, outputs, name):
            return PropagateDecoding(engine, groups, head_d, gate_d, ats_layer,
                                     chunk_sequences(tokens, split, cfg.seq_len), split, outputs.full_nll, kind,
                                     progress=progress, cache_file=work / f"propagate_{name}.pt")

        def report(entry):
            _say(f"threshold {entry['threshold']:.4f}: risk {entry['risk']:.4f}, p-value {entry['p_value']:.3g}, "
                 f"{entry['exit_fraction']:.1%} of tokens exit", progress)

        cal = fixed_sequence_test(grid_thresholds(g_probs), decoder(calib, c_out, "calib"), target, cfg.delta, method,
                                  on_test=report)
        timings["thresholds_s"] = time.perf_counter() - t0
        held_dec = decoder(held, after, "held")
        held_loss, _ = held_dec(cal.threshold if cal.threshold is not None else 1.0)
        layers = held_dec.last_layers.double()
        dec = torch.tensor([exits.index(int(x)) if int(x) in exits else len(exits) for x in layers])

    # 7. summary on the held-out split -----------------------------------------------------------
    per_exit = []
    for i, e in enumerate(exits):
        per_exit.append({
            "exit_point": e,
            "agreement_untrained": round(float(before.agree[e].float().mean()), 4),
            "agreement_trained": round(float(after.agree[e].float().mean()), 4),
            "kl_untrained": round(float(before.kl[e].mean()), 4),
            "kl_trained": round(float(after.kl[e].mean()), 4),
            "gate_auroc": round(auroc(h_probs[i], after.agree[e]), 4),
            "exit_fraction": round(float((dec == i).double().mean()), 4),
        })
    measured = {"positions": len(held), "bridge": cfg.bridge, "mean_layers": round(float(layers.mean()), 3),
                "full_depth_fraction": round(float((dec == len(exits)).double().mean()), 4)}
    # where the losses fall: at exited tokens, or (propagate only) at full-depth tokens reading bridged K/V
    exited = dec < len(exits)
    measured["loss_at_exited_tokens"] = round(float((held_loss * exited).sum()) / max(len(held), 1), 5)
    measured["loss_at_full_depth_tokens"] = round(float((held_loss * ~exited).sum()) / max(len(held), 1), 5)
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
        "held_out": measured, "per_exit": per_exit, "router": router_report,
        "head_kl_first_last": [head_curve[0], head_curve[-1]] if head_curve else None,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "settings": cfg.to_dict(),
    }
    # the depth package's adaptive mode reads thresholds["gate_threshold"] (GatePolicy: exit iff prob > it);
    # 1.0 = never exit when no threshold could be certified
    thresholds = {"gate_threshold": cal.threshold if cal.threshold is not None else 1.0}
    config = {"groups": groups.describe(), "min_depth": groups.min_depth, "policy": "gate",
              "ats_layer": ats_layer, "bridge": cfg.bridge, "patience": 0, "calibration": summary}
    save_laser_file(output, lm, LaserArtifact(heads={e: heads[str(e)] for e in exits},
                                              gates={e: gates[str(e)] for e in exits}, router=router,
                                              thresholds=thresholds, config=config), json_copy=True)
    return summary


def format_summary(s: dict) -> str:
    """Human-readable run summary."""
    lines = [f"calibrated {s['model']} ({s['dtype']}), groups {s['groups']}, min depth {s['min_depth']}",
             f"  splits (positions): {s['splits_tokens']}",
             "  exit  agree(untrained) agree(trained)  KL before -> after  gate AUROC  exiting here"]
    for r in s["per_exit"]:
        lines.append(f"  {r['exit_point']:>4}  {r['agreement_untrained']:>16.3f} {r['agreement_trained']:>14.3f}"
                     f"  {r['kl_untrained']:>9.3f} -> {r['kl_trained']:<6.3f}  {r['gate_auroc']:>10.3f}"
                     f"  {r['exit_fraction']:>11.1%}")
    c, h = s["calibration"], s["held_out"]
    lines.append(f"  guarantee: {c['guarantee']}")
    lines.append(f"  calibration split: risk {c['risk']:.4f} over {c['n']} positions, {c['tested']} thresholds tested")
    measured = (f"agreement {h['agreement']:.4f}" if "agreement" in h else f"perplexity increase {h['ppl_increase']:.2%}")
    lines.append(f"  held-out split ({h['positions']} positions): {measured}, mean layers {h['mean_layers']:.2f}, "
                 f"full depth {h['full_depth_fraction']:.1%}, target met: {h['target_met']}")
    if "loss_at_exited_tokens" in h:
        lines.append(f"  held-out losses as a share of all positions: {h['loss_at_exited_tokens']:.4f} at tokens that "
                     f"exited, {h['loss_at_full_depth_tokens']:.4f} at full-depth tokens ({h['bridge']} bridge)")
    if s.get("router"):
        r = s["router"]
        hist = ", ".join(f"{k}: {v}" for k, v in r["label_histogram"].items())
        acc = "n/a" if r.get("held_out_accuracy") is None else f"{r['held_out_accuracy']:.2f}"
        lines.append(f"  router: route labels (layers: prompts) {hist}; held-out accuracy {acc} on "
                     f"{r['held_out_prompts']} prompts (use with adaptive:laser=PATH,router=1)")
    lines.append(f"  time: {s['timings_s']}")
    return "\n".join(lines)
