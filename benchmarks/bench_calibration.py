"""Evaluate calibration artifacts on the WikiText-2 TEST split (never seen by `laserlm calibrate`).

For each artifact: the calibrated gate policy through the depth package's adaptive mode,
  - ``bridge=deferred, patience=0`` (scored by replay: exactly the setting the guarantee is about —
    every exit decided by the gate on exact hidden states; the skipped layers still run later, so this
    row saves latency-path layers, not FLOPs),
  - ``bridge=propagate, patience=0`` (token-by-token decode; K/V of skipped layers projected from the
    exit state, so FLOPs are really saved but later hidden states drift from the calibrated ones),
and static pruning (ShortGPT Block Influence) at the same average layer count as the baseline.
Metrics vs the full model on the same tokens: top-1 agreement, perplexity, average layers per token,
and whether the stated agreement target held.

Usage:
  python benchmarks/bench_calibration.py --artifacts A.safetensors B.safetensors --tokens 2048 \
      --propagate-tokens 512 --threads 1 --out benchmarks/out/calibration_test.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def score_windows(mode, engine, windows):
    logits, layers = [], []
    for w in windows:
        out = mode.score(engine, w)
        logits.append(out.logits[:-1])  # logits[i] predicts token i+1
        layers.append(out.layers[:-1].float())
    return logits, torch.cat(layers)


def metrics(full_logits, logits, layers, windows):
    agree, nll = [], []
    for f, a, w in zip(full_logits, logits, windows):
        agree.append(a.argmax(-1) == f.argmax(-1))
        nll.append(-torch.log_softmax(a.float(), -1).gather(-1, w[1:, None]).squeeze(-1))
    agree, nll = torch.cat(agree), torch.cat(nll)
    return {"positions": int(agree.numel()), "agreement": round(float(agree.float().mean()), 4),
            "ppl": round(math.exp(float(nll.mean())), 3), "mean_layers": round(float(layers.mean()), 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", nargs="+", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--propagate-tokens", type=int, default=512)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-static", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import laserlm
    from laserlm.depth.laser_file import load_laser_file
    from laserlm.training.collect import load_text_tokens
    from pathlib import Path

    lm = laserlm.load("smollm2-135m")
    eng = lm.engine
    test = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"
    if not test.is_file():
        test = Path("/work/shared/data/wikitext-2/test.txt")
    ids = load_text_tokens(lm.tokenizer, test, max_tokens=args.tokens + 1, allow_test=True)
    windows = [ids[i:i + args.window] for i in range(0, args.tokens - args.window + 1, args.window)]
    n_prop = max(1, args.propagate_tokens // args.window)
    t0 = time.perf_counter()
    full = lm.mode("full")
    full_logits, full_layers = score_windows(full, eng, windows)
    rows = [{"config": "full", **metrics(full_logits, full_logits, full_layers, windows),
             "seconds": round(time.perf_counter() - t0, 1)}]
    print(rows[-1], flush=True)
    for path in args.artifacts:
        art = load_laser_file(path, lm)
        cal = art.config["calibration"]
        target = cal["calibration"]["target"]
        for bridge, wins in (("deferred", windows), ("propagate", windows[:n_prop])):
            t0 = time.perf_counter()
            mode = lm.mode(f"adaptive:laser={path},bridge={bridge},patience=0")
            logits, layers = score_windows(mode, eng, wins)
            m = metrics(full_logits[:len(wins)], logits, layers, wins)
            row = {"config": f"calibrated {target['kind']}>={target['value']} bridge={bridge}",
                   "artifact": str(path), "gate_threshold": art.thresholds.get("gate_threshold"), **m,
                   "target": target["value"], "delta": cal["calibration"]["delta"],
                   "target_held": bool(m["agreement"] >= target["value"]) if target["kind"] == "agreement" else None,
                   "seconds": round(time.perf_counter() - t0, 1)}
            if bridge == "propagate":
                full_m = metrics(full_logits[:len(wins)], full_logits[:len(wins)], full_layers[:len(wins) * (args.window - 1)], wins)
                row["full_ppl_same_tokens"] = full_m["ppl"]
            rows.append(row)
            print(row, flush=True)
        if not args.no_static:
            keep = max(1, round(rows[-2]["mean_layers"]))
            if keep < eng.num_layers:
                t0 = time.perf_counter()
                st = lm.mode(f"static:layers={keep}")
                logits, layers = score_windows(st, eng, windows)
                rows.append({"config": f"static pruning layers={keep} (ShortGPT BI)",
                             **metrics(full_logits, logits, layers, windows),
                             "seconds": round(time.perf_counter() - t0, 1)})
                print(rows[-1], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
