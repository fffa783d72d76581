"""Self-speculative decoding vs full depth: tg128 and end-to-end tokens/s, acceptance, cost analysis.

For every prompt the modes run back to back (full, spec config 1, spec config 2, ..., and again per
repetition), so load from other jobs hits all alike; ratios to full depth are per prompt and
repetition, then averaged (geometric mean). Greedy decoding of ``--tokens`` tokens with EOS ignored;
every speculative output is checked to be identical to the full-depth output.

- tg (decode tokens/s): ``(generated - 1) / sum(inter-token latencies)`` (the first token comes from
  the prefill); e2e: ``generated / total seconds`` including prefill.
- prompt sets (test splits): ``chat`` = ARC-Easy *test* questions through the chat template;
  ``wiki`` = WikiText-2 *test* paragraphs cut to 64 tokens (continuation).
- cost analysis: per-layer seconds on 1 and ``K+1`` tokens and the exit head (measured in this
  engine), the raw-LM-head top-1 agreement with the full model at each depth (from the bench's own
  greedy outputs), and the i.i.d. acceptance rate ``alpha*`` at which speculation would break even:
  ``E[tokens/cycle] = (1 - a^(K+1)) / (1 - a)``, cycle cost ``(K+1)*N*t1 + K*head + (L-N)*t(K+1) + head``
  (reuse on, fixed K), full cost per token ``L*t1 + head``.

Usage::

    python benchmarks/bench_speculative.py --model smollm2-135m --tokens 128 --prompts 2 \
        --out benchmarks/out/speculative_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from laserlm.data import find_data_root

DATA = find_data_root() or Path("shared-data-not-found")  # $LASERLM_DATA or ../shared/data (laserlm.data)
DEFAULT_CONFIGS = [
    "draft_layers=26,k=1,threshold=0.9",
    "draft_layers=26,k=2,threshold=0.0",
    "draft_layers=24,k=4,threshold=0.5",
    "draft_layers=24,k=4,threshold=0.5,reuse=0",
    "draft_layers=20,k=3,threshold=0.0",
    "draft_layers=15,k=4,threshold=0.0",
    "draft_layers=8,k=2,threshold=0.0",
]


def prompt_sets(tokenizer, n: int) -> dict[str, list]:
    arc = [json.loads(line)["question"] for line in (DATA / "arc" / "ARC-Easy-Test.jsonl").read_text().splitlines()[:n]]
    chat = [[{"role": "user", "content": q["stem"] + " " + " ".join(f"({c['label']}) {c['text']}" for c in q["choices"])
              + " Explain your answer."}] for q in arc]
    paras = [p.strip() for p in (DATA / "wikitext-2" / "test.txt").read_text().splitlines()
             if len(p.split()) > 80 and not p.strip().startswith("=")]
    wiki = [tokenizer.decode(tokenizer(p)["input_ids"][:64]) for p in paras[: 10 * n: 10]]
    return {"chat": chat, "wiki": wiki}


def break_even_alpha(n_draft: int, n_layers: int, k: int, t1: float, tk: float, head: float) -> float:
    """Smallest i.i.d. acceptance rate at which (reuse, fixed K) speculation matches full depth."""
    full = n_layers * t1 + head
    cycle = (k + 1) * n_draft * t1 + k * head + (n_layers - n_draft) * tk + head

    def speedup(a):
        e = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
        return e * full / cycle

    if speedup(1.0) < 1:
        return float("nan")  # even perfect acceptance does not pay
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(mid) < 1 else (lo, mid)
    return hi


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per set (chat, wiki)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS, help="speculative option strings")
    ap.add_argument("--auto", action="store_true", help="also run speculative:auto=1 (calibrated on valid data)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import laserlm
    from laserlm.speculative.calibration import greedy_traces, measure_costs

    lm = laserlm.load(args.model, dtype="float32")
    modes = {"full": "full", **{f"speculative:{c}": f"speculative:{c}" for c in args.configs}}
    calibration = None
    if args.auto:
        m = lm.mode("speculative:auto=1")
        calibration = m.calibration
        modes[f"auto -> speculative:{','.join(f'{k}={v}' for k, v in m.config().items() if k != 'exit_head')}"] = m
    built = {name: lm.mode(spec) for name, spec in modes.items()}
    sets = prompt_sets(lm.tokenizer, args.prompts)
    rows: dict[str, dict] = {name: {"tg": [], "e2e": [], "tg_ratio": [], "e2e_ratio": [], "spec": []} for name in modes}
    mismatches = []
    lm.generate("warm up", max_new_tokens=4)
    for set_name, prompts in sets.items():
        for pi, prompt in enumerate(prompts):
            for rep in range(args.reps):
                base = None
                for name, mode in built.items():
                    r = lm.generate(prompt, chat=set_name == "chat", mode=mode, max_new_tokens=args.tokens,
                                    ignore_eos=True)
                    tg, e2e = r.decode_tokens_per_s, r.generated_tokens / r.total_s
                    row = rows[name]
                    row["tg"].append(tg)
                    row["e2e"].append(e2e)
                    if base is None:
                        base = (r.token_ids, tg, e2e)
                    else:
                        row["tg_ratio"].append(tg / base[1])
                        row["e2e_ratio"].append(e2e / base[2])
                        if r.token_ids != base[0]:
                            mismatches.append((name, set_name, pi))
                    if "speculative" in r.extra:
                        row["spec"].append(r.extra["speculative"])
                    print(f"{set_name}[{pi}] rep{rep} {name:<48} tg {tg:7.2f} t/s  e2e {e2e:7.2f} t/s"
                          + (f"  acc {r.extra['speculative']['acceptance_rate'] or 0:.3f}"
                             f" tau {r.extra['speculative']['mean_accepted_length'] or 0:.3f}" if "speculative" in r.extra else ""),
                          file=sys.stderr, flush=True)
    summary = []
    for name, row in rows.items():
        s = row["spec"]
        tot = {key: sum(x[key] for x in s) for key in ("drafted", "accepted", "emitted", "cycles", "draft_s", "verify_s")} if s else {}
        summary.append({
            "mode": name,
            "tg_tps": round(statistics.mean(row["tg"]), 2),
            "e2e_tps": round(statistics.mean(row["e2e"]), 2),
            "tg_ratio": round(geomean(row["tg_ratio"]), 3) if row["tg_ratio"] else 1.0,
            "e2e_ratio": round(geomean(row["e2e_ratio"]), 3) if row["e2e_ratio"] else 1.0,
            "tg_ratio_median": round(statistics.median(row["tg_ratio"]), 3) if row["tg_ratio"] else 1.0,
            "tg_ratios": [round(x, 3) for x in row["tg_ratio"]],
            "acceptance_rate": round(tot["accepted"] / max(tot["drafted"], 1), 3) if s else None,
            "mean_accepted_length": round(tot["emitted"] / max(tot["cycles"], 1), 3) if s else None,
            "draft_fraction": round(tot["draft_s"] / (tot["draft_s"] + tot["verify_s"]), 3) if s else None,
        })
    # cost analysis
    costs = measure_costs(lm.engine, 9, None, repeats=5)
    t1, head, L = costs["layer_s"][1], costs["head_s"], lm.engine.num_layers
    ids = [list(lm.tokenizer(p)["input_ids"]) for p in sets["wiki"]]
    depths = [8, 15, 20, 24, 26, 28]
    traces = greedy_traces(lm.engine, ids, 48, depths, None)
    agreement = {d: round(statistics.mean(float(tr["agree"][i].float().mean()) for tr in traces), 3)
                 for i, d in enumerate(depths)}
    analysis = [{"draft_layers": d, "k": k, "top1_agreement": agreement[d],
                 "break_even_alpha": round(break_even_alpha(d, L, k, t1, costs["layer_s"][k + 1], head), 3)}
                for d in depths for k in (1, 2, 4)]
    result = {
        "model": args.model, "tokens": args.tokens, "prompts_per_set": args.prompts, "reps": args.reps,
        "threads": args.threads, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "command": "python " + " ".join(sys.argv), "summary": summary, "lossless_mismatches": mismatches,
        "costs_ms": {"layer_by_tokens": {t: round(v * 1e3, 3) for t, v in costs["layer_s"].items()},
                     "exit_head": round(head * 1e3, 3), "full_step_model": round((L * t1 + head) * 1e3, 3)},
        "analysis": analysis, "calibration": calibration,
        "load_avg": os.getloadavg(),
    }
    print("| mode | tg t/s | e2e t/s | tg ratio (geomean) | tg ratio (median) | e2e ratio | acceptance | tokens/verify | draft time share |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in summary:
        print(f"| {r['mode']} | {r['tg_tps']} | {r['e2e_tps']} | {r['tg_ratio']} | {r['tg_ratio_median']} | {r['e2e_ratio']} | "
              f"{r['acceptance_rate']} | {r['mean_accepted_length']} | {r['draft_fraction']} |")
    print(json.dumps({k: result[k] for k in ("costs_ms", "analysis", "lossless_mismatches", "load_avg")}))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
