"""Cost of one token drafted by a draft head (issue 39), in plain full-depth steps of the same engine.

Times ``draft_chain`` drafting ``m`` tokens after a prompt (its first call also feeds the pending pairs) against a
plain decode step, interleaved, medians over ``--reps``. The speculative policy prices a head draft of ``m`` tokens
as ``m * head_cost + verify(m + 1)``; this measures ``head_cost``.

Usage::

    PYTHONPATH=. python benchmarks/bench_draft_head.py --head laserlm/speculative/heads/smollm2-135m.safetensors
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="native")
    ap.add_argument("--head", default=None, help="draft head file (default: the shipped one)")
    ap.add_argument("--tokens", type=int, default=8, help="drafted tokens per chain")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import laserlm  # noqa: PLC0415
    from laserlm.speculative.draft_head import HeadState, draft_chain, load_draft_head, shipped_head_path  # noqa

    lm = laserlm.load(args.model, weights=args.weights)
    eng = lm.engine
    dm, _ = load_draft_head(args.head or shipped_head_path(eng), eng)
    ids = lm.tokenizer("Tell me a short story about a dragon who learned to fly over the mountains.",
                       return_tensors="pt").input_ids
    with torch.inference_mode():
        cache = eng.new_cache(max_len=ids.shape[1] + 8)
        h, st = eng.begin(ids, cache=cache)
        h = eng.run_layers(0, eng.num_layers, h, st).float()
        eng.commit(st)
    plain, chain, first = [], [], []
    for _ in range(args.reps):
        with torch.inference_mode():
            t = time.perf_counter()
            eng.decode_step(torch.tensor([1]), cache=cache)
            plain.append(time.perf_counter() - t)
            eng.truncate(ids.shape[1], cache=cache)
        hs = HeadState()
        hs.add(h[0, :-1], ids[0, 1:].tolist(), 0)
        draft_chain(dm, hs, 0, 0.0)  # the prompt's pairs: part of the prefill, not of a draft
        hs.add(h[0, -1:], [1], ids.shape[1] - 1)
        t = time.perf_counter()
        drafts, _ = draft_chain(dm, hs, args.tokens, 0.0)
        chain.append(time.perf_counter() - t)
        hs.add(h[0, -1:], [1], ids.shape[1] - 1)
        t = time.perf_counter()
        draft_chain(dm, hs, 1, 0.0)
        first.append(time.perf_counter() - t)
    p, c, f = statistics.median(plain), statistics.median(chain), statistics.median(first)
    out = {"plain_ms": round(p * 1e3, 3), "chain_ms": round(c * 1e3, 3), "tokens": args.tokens,
           "per_token_steps": round(c / args.tokens / p, 4), "one_token_steps": round(f / p, 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
