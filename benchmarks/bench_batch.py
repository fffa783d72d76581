"""Batch-document workload: continuous batching over the paged KV pool vs one request at a time.

Workload: ``--docs`` WikiText-2 test paragraphs (the first ``--prompt-tokens`` tokens of each paragraph of at least
that length, in file order), each continued greedily for ``--new-tokens`` tokens (EOS ignored, so every
implementation does the same work). Side by side in one run, same weights, same thread count:

- ``laserlm one-at-a-time``: ``LaserLM.generate`` per document (its own contiguous KV cache, the single-request
  fast path);
- ``laserlm batched``: :class:`laserlm.runtime.scheduler.Scheduler` with ``--max-batch`` rows (what
  ``LaserLM.generate_batch`` runs); peak pool pages sampled every step;
- ``transformers batched``: ``model.generate`` on left-padded batches of ``--max-batch`` (same converted weights,
  ``min_new_tokens = max_new_tokens``);
- ``llama.cpp``: its own ``llama-batched-bench`` on the bundled GGUF (``--llama-batched-bench PATH``), one document
  at a time and ``--max-batch`` at a time; Q4 weights, so a reference point, not the same weights.
  (llama-cpp-python's ``Llama.generate`` spent ~8 s on every 96-token prompt here, so it is not used.)

Also: memory of the paged pool at that batch against a contiguous cache per request (prompt + new tokens, and
the full context as a static cache would), fragmentation before/after compaction after a churn of requests of
random lengths, P50/P99 latency under Poisson arrivals at two rates, and adaptive-depth requests in a batch.

Usage (run alone; record ``uptime`` before and after)::

    PYTHONPATH=. python benchmarks/bench_batch.py --weights fp32 --docs 32 --new-tokens 64 --max-batch 16 \
        --out benchmarks/history/results_batch_fp32.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return platform.processor()


def load_docs(tok, path: Path, n: int, prompt_tokens: int) -> list[list[int]]:
    docs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        ids = tok(line)["input_ids"]
        if len(ids) >= prompt_tokens:
            docs.append(ids[:prompt_tokens])
        if len(docs) == n:
            return docs
    raise SystemExit(f"only {len(docs)} paragraphs of >= {prompt_tokens} tokens in {path}")


def run_sequential(lm, docs, new):
    """One request at a time through the one generation loop (LaserLM.generate minus detokenization)."""
    from laserlm.runtime.loop import greedy_ids

    mode = lm.mode("full")
    t = time.perf_counter()
    outs = [greedy_ids(lm.engine, mode, torch.tensor(d), new) for d in docs]
    return time.perf_counter() - t, outs


def run_batched(lm, docs, new, max_batch, budget, mode="full"):
    from laserlm.runtime.sampling import SamplingParams

    sched = lm.scheduler(budget, max_batch=max_batch)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    m = lm.mode(mode)
    t = time.perf_counter()
    rids = [sched.submit(torch.tensor(d), params, m) for d in docs]
    peak = 0
    while sched.has_unfinished:
        sched.step()
        peak = max(peak, sched.pool.used_pages)
    dt = time.perf_counter() - t
    outs = [[e.token_id for e in sched.get(r).events] for r in rids]
    layers = [statistics.mean(e.layers for e in sched.get(r).events) for r in rids]
    return dt, outs, peak, sched, layers


def run_hf(lm, docs, new, max_batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lm.loaded.path, dtype=lm.engine.dtype,
                                                 attn_implementation="sdpa").eval()
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    t = time.perf_counter()
    outs = []
    for i in range(0, len(docs), max_batch):
        chunk = docs[i:i + max_batch]
        width = max(len(d) for d in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, d in enumerate(chunk):
            ids[r, width - len(d):] = torch.tensor(d)
            mask[r, width - len(d):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
        outs += out[:, width:].tolist()
    return time.perf_counter() - t, outs


def run_llama_batched_bench(binary: str, gguf: str, prompt_tokens: int, new: int, batches: list[int], threads: int):
    """llama.cpp's own ``llama-batched-bench`` (``-npp P -ntg N -npl 1,B``): seconds for ``B`` documents of ``P``
    prompt + ``N`` generated tokens, for each ``B`` (its ``T s`` column)."""
    cmd = [binary, "-m", gguf, "-c", str(max(batches) * (prompt_tokens + new) + 16), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_tokens), "-ntg", str(new), "-npl", ",".join(map(str, batches)), "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = {}
    for ln in out.splitlines():
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            rows[int(cells[2])] = float(cells[8])
    return rows


def poisson(lm, docs, new, max_batch, budget, rate, seed=0):
    """Requests arrive at ``rate`` per second (exponential gaps); latency = finish - arrival."""
    from laserlm.runtime.sampling import SamplingParams

    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in docs:
        t += rng.expovariate(rate)
        arrivals.append(t)
    sched = lm.scheduler(budget, max_batch=max_batch)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    m = lm.mode("full")
    t0 = time.perf_counter()
    submitted, rids = 0, []
    while submitted < len(docs) or sched.has_unfinished:
        now = time.perf_counter() - t0
        while submitted < len(docs) and arrivals[submitted] <= now:
            rids.append(sched.submit(torch.tensor(docs[submitted]), params, m))
            submitted += 1
        if sched.has_unfinished:
            sched.step()
        else:
            time.sleep(min(0.01, max(0.0, arrivals[submitted] - now)))
    lat = sorted(sched.get(r).t_finish - t0 - a for r, a in zip(rids, arrivals))
    ttft = sorted(sched.get(r).events[0].seconds for r in rids)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]

    return {"rate_req_s": rate, "requests": len(docs), "p50_latency_s": pct(lat, 0.5), "p99_latency_s": pct(lat, 0.99),
            "p50_ttft_s": pct(ttft, 0.5), "p99_ttft_s": pct(ttft, 0.99)}


def churn_fragmentation(lm, budget, seed=0, reps=3):
    """Requests of random lengths, half finishing early: fragmentation and a decode step's time (median of ``reps``)
    before and after compaction, and the compaction's own time."""
    from laserlm.runtime.kv_pool import PagedBatch
    from laserlm.runtime.sampling import SamplingParams

    rng = random.Random(seed)
    sched = lm.scheduler(budget, max_batch=32, compact_every=10**9)
    rids = []
    for _ in range(32):
        n = rng.randrange(8, 120)
        rids.append(sched.submit(torch.randint(10, 20000, (n,)), SamplingParams(max_new_tokens=64, ignore_eos=True)))
    while sched.waiting or any(s.status == "prefill" for s in sched.running):
        sched.step()
    for r in rids[::2]:
        sched.cancel(r)
    for _ in range(3):
        sched.step()

    def step_ms():
        rows = [s for s in sched.running if s.status == "decode"]
        eng = lm.engine
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            with torch.inference_mode():
                h, st = eng.begin(torch.tensor([[s.request.last_token] for s in rows]),
                                  cache=PagedBatch([s.request.cache for s in rows]))
                eng.run_layers(0, eng.num_layers, h, st)
            times.append(time.perf_counter() - t)  # not committed: the same positions are rewritten
        return 1000 * statistics.median(times), len(rows)

    before = sched.pool.fragmentation()
    ms_before, rows = step_ms()
    t = time.perf_counter()
    moved = sched.pool.compact()
    compact_ms = 1000 * (time.perf_counter() - t)
    after = sched.pool.fragmentation()
    ms_after, _ = step_ms()
    for r in rids:
        sched.cancel(r)
    return {"rows": rows, "before": before, "after": after, "moved_pages": moved, "compact_ms": round(compact_ms, 2),
            "step_ms_before": round(ms_before, 2), "step_ms_after": round(ms_after, 2),
            "pool_mib": round(sched.pool.nbytes / 2**20, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--kv-budget", default="256MiB")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default="../shared/data/wikitext-2/test.txt")
    ap.add_argument("--skip", nargs="*", default=[], help="parts to skip: seq hf llama poisson churn adaptive")
    ap.add_argument("--rates", type=float, nargs=2, default=[0.3, 0.6])
    ap.add_argument("--adaptive", default="adaptive:policy=confidence,threshold=0.9,patience=1")
    ap.add_argument("--llama-batched-bench", help="path of llama.cpp's llama-batched-bench binary")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import laserlm

    lm = laserlm.load(args.model, weights=args.weights)
    docs = load_docs(lm.tokenizer, Path(args.data), args.docs, args.prompt_tokens)
    new, nd = args.new_tokens, len(docs)
    res = {"machine": lscpu_model(), "date": time.strftime("%Y-%m-%d"), "threads": args.threads,
           "model": args.model, "weights": lm.describe(), "docs": nd, "prompt_tokens": args.prompt_tokens,
           "new_tokens": new, "max_batch": args.max_batch, "kv_budget": args.kv_budget}
    rows = []

    def add(name, seconds, note=""):
        rows.append({"impl": name, "seconds": round(seconds, 2), "docs_per_min": round(60 * nd / seconds, 1),
                     "out_tok_s": round(nd * new / seconds, 1), "note": note})
        print(rows[-1], flush=True)

    # warm-up (kernels, rope tables, allocator)
    run_batched(lm, docs[:2], 4, 2, args.kv_budget)
    t_b, out_b, peak, sched, _ = run_batched(lm, docs, new, args.max_batch, args.kv_budget)
    pool = sched.pool
    add("laserlm batched", t_b, f"max_batch {args.max_batch}")
    if "seq" not in args.skip:
        t_s, out_s = run_sequential(lm, docs, new)
        same = sum(a == b for a, b in zip(out_s, out_b))
        add("laserlm one-at-a-time", t_s, f"batched outputs identical for {same}/{nd} docs")
        res["batched_vs_one_at_a_time"] = round(t_s / t_b, 2)
    if "hf" not in args.skip:
        t_h, out_h = run_hf(lm, docs, new, args.max_batch)
        add("transformers batched generate", t_h, f"batch {args.max_batch}, left padding")
    if "llama" not in args.skip and args.llama_batched_bench:
        from laserlm.models.registry import BUNDLED

        gguf = str(BUNDLED[args.model].locate())
        secs = run_llama_batched_bench(args.llama_batched_bench, gguf, args.prompt_tokens, new, [1, args.max_batch],
                                       args.threads)
        for b, t in sorted(secs.items()):  # llama-batched-bench times b documents; scale to the workload
            add(f"llama.cpp llama-batched-bench, {b} at a time (its Q4 GGUF)", t * nd / b,
                f"measured {b} docs in {t:.2f} s, scaled to {nd}")
    res["throughput"] = rows
    per_pos = pool.page_bytes * pool.num_layers / pool.page_size
    res["memory"] = {"pool_arena_mib": round(pool.nbytes / 2**20, 1),
                     "peak_pages_used": peak, "peak_used_mib": round(peak * pool.page_bytes / 2**20, 2),
                     "contiguous_per_request_mib": round(min(args.max_batch, nd) * (args.prompt_tokens + new) * per_pos / 2**20, 2),
                     "static_context_per_request_mib": round(min(args.max_batch, nd) * lm.engine.max_seq_len * per_pos / 2**20, 2)}
    print(res["memory"], flush=True)
    if "churn" not in args.skip:
        res["fragmentation"] = churn_fragmentation(lm, args.kv_budget)
        print(res["fragmentation"], flush=True)
    if "poisson" not in args.skip:
        res["poisson"] = [poisson(lm, docs[:16], 32, args.max_batch, args.kv_budget, r) for r in args.rates]
        print(res["poisson"], flush=True)
    if "adaptive" not in args.skip:
        k = min(8, nd)
        t_f, _, _, _, _ = run_batched(lm, docs[:k], new, args.max_batch, args.kv_budget)
        t_a, _, _, _, layers = run_batched(lm, docs[:k], new, args.max_batch, args.kv_budget, args.adaptive)
        res["adaptive_in_batch"] = {"docs": k, "spec": args.adaptive, "full_batch_s": round(t_f, 2),
                                    "adaptive_batch_s": round(t_a, 2), "mean_layers_per_row": [round(x, 2) for x in layers],
                                    "full_layers": lm.engine.num_layers}
        print(res["adaptive_in_batch"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
