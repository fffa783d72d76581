"""Exit heads trained with the full-vocabulary KL against the sampled loss (``--head-vocab``), on a real model.

Collects exit states once, trains one set of affine exit heads per setting (same steps, batch and seed) and reports
the held-out full-vocabulary KL and top-1 agreement per exit point, the mean, and the training time. Run alone.

    PYTHONPATH=. python benchmarks/head_vocab_curve.py -m smollm2-135m --settings full,sampled:32:1024 --out F.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import laserlm
from laserlm.depth.groups import make_groups
from laserlm.training.collect import collect_exit_states, load_text_tokens
from laserlm.training.heads import make_exit_heads
from laserlm.training.train import HeadTrainConfig, compute_exit_outputs, train_heads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--settings", default="full,sampled:32:1024",
                    help="comma-separated: full | sampled:TOPK:NEGATIVES, each optionally @STEPS (default --steps)")
    ap.add_argument("--train-tokens", type=int, default=8192)
    ap.add_argument("--held-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = laserlm.load(a.model)
    L = lm.engine.num_layers
    groups = make_groups(None, L)
    seq = 256
    tokens = load_text_tokens(lm.tokenizer, max_tokens=a.train_tokens + a.held_tokens + 1)
    t0 = time.perf_counter()
    states = collect_exit_states(lm.engine, tokens, groups, seq_len=seq, ats_layer=None, progress=False)
    collect_s = time.perf_counter() - t0
    total = a.train_tokens + a.held_tokens
    train, held = states.split_chunks([a.train_tokens / total, a.held_tokens / total])
    exits = list(states.exit_points)
    plain = compute_exit_outputs(None, lm.engine.head, held, L)
    rows = [{"setting": "untrained (logit lens)", "kl": {e: float(plain.kl[e].mean()) for e in exits},
             "agreement": {e: float(plain.agree[e].float().mean()) for e in exits}}]
    for setting in a.settings.split(","):
        name, _, steps = setting.partition("@")
        parts = name.split(":")
        cfg = HeadTrainConfig(steps=int(steps) if steps else a.steps, vocab=parts[0])
        if parts[0] == "sampled":
            cfg.teacher_topk, cfg.negatives = int(parts[1]), int(parts[2])
        heads = make_exit_heads(lm.engine, exits, "affine")
        t0 = time.perf_counter()
        curve = train_heads(heads, lm.engine.head, train, cfg, progress=False)
        secs = time.perf_counter() - t0
        out = compute_exit_outputs(heads, lm.engine.head, held, L)
        rows.append({"setting": setting, "steps": cfg.steps, "train_s": round(secs, 1), "loss_first_last": [curve[0], curve[-1]] if curve else None,
                     "kl": {e: float(out.kl[e].mean()) for e in exits},
                     "agreement": {e: float(out.agree[e].float().mean()) for e in exits}})
        print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        r["kl_mean"] = sum(r["kl"].values()) / len(exits)
        r["agreement_mean"] = sum(r["agreement"].values()) / len(exits)
    res = {"model": a.model, "vocab": int(lm.engine.adapter.lm_head.weight.shape[0]), "exits": exits,
           "train_positions": len(train), "held_positions": len(held), "default_steps": a.steps, "threads": a.threads,
           "collect_s": round(collect_s, 1), "rows": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'setting':<24} {'train s':>8} {'KL mean':>8} {'agree mean':>10}")
    for r in rows:
        print(f"{r['setting']:<24} {r.get('train_s', 0):>8} {r['kl_mean']:>8.3f} {r['agreement_mean']:>10.3f}")


if __name__ == "__main__":
    main()
