"""Speculative requests decoding together: draft + verify cycles one request at a time, or plain batched steps.

``SelfSpeculative.step_batch`` runs each request's own draft + verify cycle while at most ``batch_above``
speculative requests decode together, and one plain batched full-depth step for all of them beyond that. Which
is faster depends on what a multi-row step costs (the verify cost table) against how many tokens a verify
accepts, so ``batch_above`` is chosen from this measurement. For ``B`` concurrent requests of one prompt class
(chat template, greedy, ``--tokens`` new tokens, EOS ignored) every arm runs the same requests through the
scheduler; arms are interleaved ``--repeats`` times and the median wall time is reported, with outputs checked
against plain batched full depth.

Usage::

    PYTHONPATH=. python benchmarks/bench_spec_batch.py --weights native --classes rewrite chat --batches 2,4 \
        --batch-above 1,2,16 --out benchmarks/out/spec_batch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ngram import build_prompts  # noqa: E402


def run(lm, prompts, mode, new):
    from laserlm.runtime.sampling import SamplingParams

    sched = lm.scheduler("512MiB", max_batch=16)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    t = time.perf_counter()
    rids = [sched.submit(p, params, mode) for p in prompts]
    while sched.has_unfinished:
        sched.step()
    dt = time.perf_counter() - t
    return dt, [[e.token_id for e in sched.get(r).events] for r in rids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="native")
    ap.add_argument("--classes", nargs="+", default=["rewrite", "chat"])
    ap.add_argument("--batches", default="2,4", help="concurrent requests, comma separated")
    ap.add_argument("--batch-above", default="1,2,16", help="batch_above values to compare, comma separated")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import laserlm  # noqa: PLC0415
    from laserlm.runtime.generate import encode_prompt  # noqa: PLC0415

    lm = laserlm.load(args.model, weights=args.weights)
    batches = [int(b) for b in args.batches.split(",")]
    aboves = [int(b) for b in args.batch_above.split(",")]
    prompts = build_prompts(max(batches))
    arms = {"full": lm.mode("full")}
    for a in aboves:
        arms[f"batch_above={a}"] = lm.mode(f"speculative:draft=ngram,batch_above={a}")
    rows = []
    for cls in args.classes:
        ids = [encode_prompt(lm.tokenizer, [{"role": "user", "content": p}], True, lm.engine.max_seq_len)
               for p in prompts[cls]]
        for b in batches:
            times = {k: [] for k in arms}
            outs = {}
            for _ in range(args.repeats):
                for name, mode in arms.items():
                    dt, out = run(lm, ids[:b], mode, args.tokens)
                    times[name].append(dt)
                    outs[name] = out
            full = statistics.median(times["full"])
            for name in arms:
                med = statistics.median(times[name])
                row = {"class": cls, "batch": b, "arm": name, "seconds": med, "tok_s": b * args.tokens / med,
                       "vs_full": full / med, "equal_full": outs[name] == outs["full"]}
                rows.append(row)
                print(f"{cls:8s} B={b:2d} {name:16s} {med:6.2f} s  {row['tok_s']:6.1f} tok/s  "
                      f"{row['vs_full']:.2f}x full  equal={row['equal_full']}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                       indent=1))


if __name__ == "__main__":
    main()
