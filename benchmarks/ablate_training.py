"""Ablation of the seed's training guidance (issue 17): which of its recipes change what calibration delivers.

Every variant runs ``laserlm calibrate`` (the library function) on the same text with one setting changed, in
one work directory with ``resume`` so that unchanged stages (hidden-state collection, and the head / gate stages
for the joint-stage variants) are loaded rather than recomputed. Thresholds are certified on exact states
(``bridge=deferred``: cheap, and the setting the seed's numbers are about) at each ``--targets`` value.

Reported per variant and target: held-out agreement, mean layers per token, whether the target held, and per
exit point the trained head's held-out agreement and KL, the gate's AUROC, and the head's agreement on the first
and the second half of each chunk's positions (the seed's claim for cross-layer gradient normalisation is about
long sequences). Variants:

- head stage (stage 1, always run): clip 1.0 (default, seed 004) / no clipping / clip 0.2 / adaptive clip in
  [0.2, 1.0] / cross-layer gradient normalisation; and the default with two other random seeds (batch order), the
  spread any difference has to exceed;
- joint stage (stage 2, optional): off (default) / on with the seed's recipe (LR 3e-5, warm-up, threshold decay
  0.95, clip 1.0) / without warm-up / without threshold decay / adaptive clip / cross-layer normalisation;
- min depth: a quarter of the layers (default, seed) / an eighth / a half.

Usage:
  PYTHONPATH=. python benchmarks/ablate_training.py --model smollm2-135m --threads 1 \
      --out benchmarks/out/training_guidance/smollm2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch


def variants(L: int, joint_epochs: int, joint_steps: int):
    from laserlm.training.train import JointTrainConfig

    def joint(**kw):
        return JointTrainConfig(epochs=joint_epochs, steps_per_epoch=joint_steps, **kw)

    # the default last among the head variants: the joint variants then load its heads and gates
    yield "heads: no clipping", {"heads": {"grad_clip": 1e9}}
    yield "heads: clip 0.2", {"heads": {"grad_clip": 0.2}}
    yield "heads: adaptive clip", {"heads": {"adaptive_clip": True}}
    yield "heads: cross-layer norm", {"heads": {"cross_layer_norm": True}}
    yield "heads: clip 1.0 (default)", {}
    yield "heads: clip 1.0, seed 1", {"heads": {"seed": 1}}  # the seed-to-seed spread the differences compare with
    yield "heads: clip 1.0, seed 2", {"heads": {"seed": 2}}
    yield "joint: seed recipe", {"joint": dataclasses.asdict(joint())}
    yield "joint: no warm-up", {"joint": dataclasses.asdict(joint(warmup_steps=0))}
    yield "joint: no threshold decay", {"joint": dataclasses.asdict(joint(threshold_decay=1.0))}
    yield "joint: adaptive clip", {"joint": dataclasses.asdict(joint(adaptive_clip=True))}
    yield "joint: cross-layer norm", {"joint": dataclasses.asdict(joint(cross_layer_norm=True))}
    yield f"min depth {max(1, L // 8)} (L/8)", {"min_depth": max(1, L // 8)}
    yield f"min depth {L // 2} (L/2)", {"min_depth": L // 2}


def make_config(base: dict, change: dict, target: float):
    from laserlm.training.gates import GateTrainConfig
    from laserlm.training.pipeline import CalibrateConfig
    from laserlm.training.train import HeadTrainConfig, JointTrainConfig

    heads = {**base["heads"], **change.get("heads", {})}
    joint = change.get("joint", {})
    top = {k: v for k, v in base.items() if k not in ("heads", "gates")}
    top.update({k: v for k, v in change.items() if k not in ("heads", "joint")})
    return CalibrateConfig(**top, heads=HeadTrainConfig(**heads), gates=GateTrainConfig(**base["gates"]),
                           joint=JointTrainConfig(**joint), target_agreement=target).validate()


def half_agreement(work: Path, seq_len: int) -> dict:
    """Per exit: the trained head's held-out agreement on positions < seq_len/2 and >= seq_len/2 of each chunk."""
    saved = torch.load(work / "outputs.pt")
    agree = saved["after"]["agree"]
    out = {}
    for e, a in agree.items():
        pos = torch.arange(a.numel()) % seq_len
        first = a[pos < seq_len // 2].float().mean()
        second = a[pos >= seq_len // 2].float().mean()
        out[str(e)] = [round(float(first), 4), round(float(second), 4)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--targets", default="0.90,0.95")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--train-tokens", type=int, default=4096)
    ap.add_argument("--gate-tokens", type=int, default=2048)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--head-steps", type=int, default=None)
    ap.add_argument("--joint-epochs", type=int, default=3)
    ap.add_argument("--joint-steps", type=int, default=40, help="joint steps per epoch")
    ap.add_argument("--only", default=None, help="comma-separated variant name prefixes to run")
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import laserlm
    from laserlm.training.pipeline import calibrate

    lm = laserlm.load(args.model, weights=args.weights)
    L = lm.engine.num_layers
    targets = [float(t) for t in args.targets.split(",")]
    base = {"seq_len": args.seq_len, "train_tokens": args.train_tokens, "gate_tokens": args.gate_tokens,
            "calib_tokens": args.calib_tokens, "eval_tokens": args.eval_tokens, "router_prompts": 0,
            "predictor": False, "bridge": "deferred", "use_ats": True,
            "heads": {"steps": args.head_steps}, "gates": {}}
    work_root = Path(args.work or tempfile.mkdtemp(prefix="ablate_training_"))
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, change in variants(L, args.joint_epochs, args.joint_steps):
        if args.only and not any(name.startswith(p) for p in args.only.split(",")):
            continue
        # min-depth variants change the exit points: their own work directory
        work = work_root / ("main" if "min_depth" not in change else f"min_depth_{change['min_depth']}")
        work.mkdir(parents=True, exist_ok=True)
        for target in targets:
            cfg = make_config(base, change, target)
            t0 = time.perf_counter()
            s = calibrate(lm, cfg, work / "laser.safetensors", resume=True, progress=False, work_dir=work)
            h = s["held_out"]
            row = {"variant": name, "target": target, "seconds": round(time.perf_counter() - t0, 1),
                   "held_out_agreement": h["agreement"], "mean_layers": h["mean_layers"],
                   "target_met": h["target_met"], "threshold": s["calibration"].get("threshold"),
                   "exit_points": s["exit_points"],
                   "head_agreement": [r["agreement_trained"] for r in s["per_exit"]],
                   "head_kl": [r["kl_trained"] for r in s["per_exit"]],
                   "gate_auroc": [r["gate_auroc"] for r in s["per_exit"]],
                   "head_agreement_first_second_half": half_agreement(work, args.seq_len),
                   "timings_s": s["timings_s"], "warnings": s["warnings"]}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("variant", "target", "held_out_agreement", "mean_layers",
                                                  "head_agreement", "gate_auroc", "seconds")}), flush=True)
            out.write_text(json.dumps({"model": args.model, "weights": args.weights, "threads": args.threads,
                                       "settings": base, "joint_epochs": args.joint_epochs,
                                       "joint_steps": args.joint_steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
