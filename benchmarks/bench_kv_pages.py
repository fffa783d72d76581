"""KV pool page studies (issue 13): page size, pages released under the ``none`` bridge, and compaction's cost.

Three parts, each on the batch-document workload of ``bench_batch.py`` (WikiText-2 test paragraphs, the first
``--prompt-tokens`` tokens of each, continued greedily for ``--new-tokens`` tokens, EOS ignored):

- ``pages``: the batched run (``--max-batch`` rows) at each ``--page-sizes``: seconds, peak pages in use and their
  MiB, the internal fragmentation at the end of the prompts (part-filled last pages). Interleaved over ``--reps``
  rounds (the VM drifts), so compare the sizes within one round. Timing: run alone.
- ``none``: the same documents one request at a time through the scheduler under an adaptive mode with
  ``bridge=none`` and with ``bridge=propagate`` (same exits: the bridge changes later tokens' K/V, so the exits
  differ slightly), for each page size: layers per token, pages released because every position in them skipped
  their layer (``PagedCache.release_skipped``), pages held at the end of each request against the pages it
  reserved. Counts, not timing.
- ``compact``: a churn of requests of random lengths with every other one cancelled after its prefill (as in
  ``bench_batch.py``), then ``KVPool.compact`` timed, and one 16-row decode step before and after: what a
  compaction costs against what it saves per step.

Usage (record ``uptime`` before and after; the ``pages`` part is a timing)::

    PYTHONPATH=. python benchmarks/bench_kv_pages.py --weights native --out benchmarks/out/kv_pages/results.json
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
from bench_batch import churn_fragmentation, load_docs, lscpu_model  # noqa: E402


def batched_run(lm, docs, new, max_batch, budget, page_size, mode="full"):
    """The documents through one scheduler; returns seconds, peak pages in use, the pool, internal fragmentation
    right after the last prompt was prefilled, and the scheduler."""
    from laserlm.runtime.sampling import SamplingParams

    sched = lm.scheduler(budget, max_batch=max_batch, page_size=page_size)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    m = lm.mode(mode)
    t = time.perf_counter()
    for d in docs:
        sched.submit(torch.tensor(d), params, m)
    peak, internal = 0, None
    while sched.has_unfinished:
        sched.step()
        peak = max(peak, sched.pool.used_pages)
        if internal is None and not sched.waiting and all(s.status == "decode" for s in sched.running):
            internal = sched.pool.fragmentation()["internal"]
    return time.perf_counter() - t, peak, sched.pool, internal, sched


def part_pages(lm, docs, args):
    rows = {ps: [] for ps in args.page_sizes}
    for r in range(args.reps):
        order = args.page_sizes if r % 2 == 0 else list(reversed(args.page_sizes))
        for ps in order:
            dt, peak, pool, internal, _ = batched_run(lm, docs, args.new_tokens, args.max_batch, args.kv_budget, ps)
            rows[ps].append({"seconds": dt, "peak_pages": peak, "peak_mib": peak * pool.page_bytes / 2**20,
                             "internal_frag_after_prompts": internal})
            print({"page_size": ps, "round": r, **rows[ps][-1]}, flush=True)
    out = []
    for ps in args.page_sizes:
        rs = rows[ps]
        out.append({"page_size": ps, "seconds_median": round(statistics.median(x["seconds"] for x in rs), 2),
                    "seconds": [round(x["seconds"], 2) for x in rs], "peak_mib": round(rs[0]["peak_mib"], 2),
                    "peak_pages": rs[0]["peak_pages"],
                    "internal_frag_after_prompts": round(rs[0]["internal_frag_after_prompts"] or 0.0, 4)})
    return out


def part_none(lm, docs, args):
    from laserlm.runtime.sampling import SamplingParams

    out = []
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for spec in args.adaptive:
        for bridge in ("none", "propagate"):
            full_spec = f"{spec},bridge={bridge}"
            mode = lm.mode(full_spec)
            for ps in args.page_sizes:
                sched = lm.scheduler(args.kv_budget, max_batch=1, page_size=ps)
                layers, held, reserved, released = [], [], [], 0
                for d in docs:
                    rid = sched.submit(torch.tensor(d), params, mode)
                    want = sched.get(rid).reserved
                    while sched.get(rid).status != "finished":
                        sched.step()
                        seq = sched.get(rid)
                        if seq.status == "decode" and seq.request.remaining == 1:  # last step: pages still held
                            held.append(seq.request.cache.owned_pages())
                    seq = sched.get(rid)
                    layers += [e.layers for e in seq.events[1:]]
                    reserved.append(want)
                    released += seq.request.cache.skipped if seq.request.cache is not None else 0
                released = sched.pool.stats["skipped_pages"]
                row = {"spec": full_spec, "page_size": ps, "layers_per_token": round(statistics.mean(layers), 2),
                       "pages_released": released, "pages_reserved_per_request": statistics.mean(reserved),
                       "pages_held_at_end_mean": round(statistics.mean(held), 1) if held else None,
                       "saved_share": round(released / sum(reserved), 4)}
                out.append(row)
                print(row, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="native")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--none-docs", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--kv-budget", default="256MiB")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--adaptive", nargs="+", default=["adaptive:policy=confidence,threshold=0.9,patience=1"],
                    help="adaptive mode specs for the none-bridge part (',bridge=...' is appended)")
    ap.add_argument("--data", default="../shared/data/wikitext-2/test.txt")
    ap.add_argument("--skip", nargs="*", default=[], help="parts to skip: pages none compact")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import laserlm

    lm = laserlm.load(args.model, weights=args.weights)
    docs = load_docs(lm.tokenizer, Path(args.data), max(args.docs, args.none_docs), args.prompt_tokens)
    res = {"machine": lscpu_model(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "threads": args.threads, "model": args.model, "weights": lm.describe(), "docs": args.docs,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "max_batch": args.max_batch,
           "kv_budget": args.kv_budget, "argv": sys.argv[1:]}
    batched_run(lm, docs[:2], 4, 2, args.kv_budget, 16)  # warm-up
    if "pages" not in args.skip:
        res["page_sizes"] = part_pages(lm, docs[:args.docs], args)
    if "none" not in args.skip:
        res["none_bridge"] = part_none(lm, docs[:args.none_docs], args)
    if "compact" not in args.skip:
        res["compaction"] = churn_fragmentation(lm, args.kv_budget, reps=5)
        print(res["compaction"], flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
