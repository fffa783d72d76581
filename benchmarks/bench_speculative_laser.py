"""Speculative decoding with a calibrated exit head (``laser=PATH``) vs the raw LM head, same draft depth.

Interleaved A/B in one process (raw, laser, raw, laser ...) on the same prompts, greedy; reports the
acceptance rate, mean accepted length and the decode tok/s ratio laser / raw (other jobs may be loading
the machine: compare the ratio, not absolute speeds).

    python benchmarks/bench_speculative_laser.py --laser FILE --draft-layers 16 --k 2 -n 48
"""

from __future__ import annotations

import argparse
import json
import statistics

import laserlm

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    " = Valkyria Chronicles III = \n\n Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical role",
    "The history of the Roman Empire",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--laser", required=True)
    ap.add_argument("--draft-layers", type=int, required=True)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    lm = laserlm.load("smollm2-135m", dtype="float32")
    base = f"speculative:draft_layers={args.draft_layers},k={args.k}"
    specs = {"raw": base, "laser": f"{base},laser={args.laser}"}
    agg = {name: {"accepted": 0, "drafted": 0, "emitted": 0, "cycles": 0, "tps": []} for name in specs}
    texts = {}
    lm.generate(PROMPTS[0], mode=base, max_new_tokens=4)  # warm-up
    for _ in range(args.repeats):
        for prompt in PROMPTS:
            for name, spec in specs.items():
                r = lm.generate(prompt, mode=spec, max_new_tokens=args.n, ignore_eos=True)
                s = r.extra["speculative"]
                for key in ("accepted", "drafted", "emitted", "cycles"):
                    agg[name][key] += s[key]
                agg[name]["tps"].append(r.decode_tokens_per_s)
                texts.setdefault(prompt, {})[name] = r.text
    out = {"draft_layers": args.draft_layers, "k": args.k, "n": args.n, "laser": args.laser,
           "same_text": all(t["raw"] == t["laser"] for t in texts.values())}
    for name, a in agg.items():
        out[name] = {"acceptance_rate": round(a["accepted"] / max(a["drafted"], 1), 4),
                     "mean_accepted_length": round(a["emitted"] / max(a["cycles"], 1), 4),
                     "median_tok_s": round(statistics.median(a["tps"]), 2)}
    ratios = [b / a for a, b in zip(agg["raw"]["tps"], agg["laser"]["tps"])]
    out["tok_s_ratio_laser_over_raw_median"] = round(statistics.median(ratios), 3)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
