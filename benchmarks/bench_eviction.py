"""Quality cost of KV eviction past the budget: WikiText-2 perplexity and passkey retrieval.

Perplexity: ``--length``-token windows of WikiText-2 test (``--seqs`` of them, consecutive), scored through a
:class:`~laserlm.runtime.kv_pool.PagedCache` in chunks of ``--chunk`` tokens (the policy evicts after every chunk,
so a token sees the kept pages plus the earlier tokens of its own chunk), for: no eviction, StreamingLLM
(``streaming:sinks=S,window=W``) and the seed's depth-aware LRU (``depth_lru:budget=W+S,sinks=S,recent=W/2``), with
``W = --window``. Passkey: the Landmark-Attention passkey prompt (:mod:`laserlm.attention.passkey`) of
``--passkey-tokens`` tokens, key at depths 0.1 / 0.5 / 0.9, through the scheduler with each policy (prefill chunks
of ``--chunk``), greedy, 10 tokens; correct when the first integer is the key.

Usage (run alone)::

    PYTHONPATH=. python benchmarks/bench_eviction.py --length 1536 --window 256 --out benchmarks/history/results_eviction.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def perplexity(lm, ids: torch.Tensor, eviction, chunk: int) -> tuple[float, int]:
    from laserlm.runtime.eviction import parse_eviction
    from laserlm.runtime.kv_pool import KVPool, PagedCache

    eng = lm.engine
    pool = KVPool.for_engine(eng, "256MiB")
    cache = PagedCache(pool, ids.numel(), parse_eviction(eviction))
    nll, n = 0.0, 0
    with torch.inference_mode():
        for s in range(0, ids.numel() - 1, chunk):
            part = ids[s:min(s + chunk, ids.numel() - 1)]
            h, st = eng.begin(part.unsqueeze(0), start=s, cache=cache)
            h = eng.run_layers(0, eng.num_layers, h, st)
            eng.commit(st)
            logp = torch.log_softmax(eng.head(h)[0].double(), -1)
            target = ids[s + 1:s + 1 + part.numel()]
            nll -= float(logp.gather(-1, target[:, None]).sum())
            n += part.numel()
    evicted = cache.evicted
    cache.free()
    return math.exp(nll / n), evicted


def passkey(lm, tokens: int, eviction, chunk: int, cases) -> list[bool]:
    from laserlm.attention.passkey import first_integer, passkey_prompt
    from laserlm.runtime.sampling import SamplingParams

    ok = []
    for key, depth in cases:
        prompt = passkey_prompt(lm.tokenizer, tokens, key, depth)
        ids = torch.tensor(lm.tokenizer(prompt)["input_ids"])
        sched = lm.scheduler("256MiB", eviction=eviction, prefill_chunk=chunk)
        rid = sched.submit(ids, SamplingParams(max_new_tokens=10), lm.mode("full"))
        sched.run()
        text = lm.tokenizer.decode([e.token_id for e in sched.get(rid).events])
        ok.append(first_integer(text) == key)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--length", type=int, default=1536)
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--passkey-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default="../shared/data/wikitext-2/test.txt")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import laserlm

    lm = laserlm.load(args.model, weights=args.weights, max_seq_len=max(args.length, args.passkey_tokens) + 64)
    text = Path(args.data).read_text(encoding="utf-8")
    all_ids = lm.tokenizer(text[:400_000])["input_ids"]
    W, S = args.window, args.sinks
    policies = {"none": None, "streaming": f"streaming:sinks={S},window={W}",
                "depth_lru": f"depth_lru:budget={W + S},sinks={S},recent={W // 2}"}
    res = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "weights": lm.describe(), "length": args.length,
           "window": W, "sinks": S, "chunk": args.chunk, "policies": policies, "perplexity": {}, "passkey": {}}
    for name, spec in policies.items():
        ppl = []
        for k in range(args.seqs):
            ids = torch.tensor(all_ids[k * args.length:(k + 1) * args.length])
            p, ev = perplexity(lm, ids, spec, args.chunk)
            ppl.append(p)
        res["perplexity"][name] = {"ppl_per_seq": [round(p, 3) for p in ppl], "evicted_pages_last_seq": ev}
        print(name, res["perplexity"][name], flush=True)
    cases = [(31337, 0.1), (4242, 0.5), (27182, 0.9)]
    for name, spec in policies.items():
        ok = passkey(lm, args.passkey_tokens, spec, max(args.chunk, 64), cases)
        res["passkey"][name] = {"correct": sum(ok), "of": len(ok), "per_depth": dict(zip(["0.1", "0.5", "0.9"], ok))}
        print(name, res["passkey"][name], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
