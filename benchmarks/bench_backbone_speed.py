"""Decode speed of an adapted model (issue 33) against the *original* at full depth, interleaved in one run.

Loads the original model and the model adapted by ``--delta`` (both ``--weights``, default native) and, for every
prompt, runs back to back: the original at full depth, the adapted model at full depth, and each ``--config`` on the
adapted model (e.g. ``adaptive:laser=F,patience=0`` for a laser file calibrated on it, or a speculative spec).
Greedy, ``--tokens`` new tokens, EOS ignored. Reported per configuration: decode tokens/s (sum of generated tokens
after the first / sum of inter-token latencies), its ratio to the original's full depth and to the adapted model's
full depth, mean layers per token, and the fraction of generated tokens equal to the original's (position by position,
up to the first difference's influence: a diverged continuation counts its later tokens as they come).

Usage::

    PYTHONPATH=. python benchmarks/bench_backbone_speed.py --delta smol.delta.safetensors \\
        --config "adaptive:laser=smol.laser.safetensors,patience=0" --out out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ngram import CHAT, CHAT_HELDOUT  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--delta", required=True)
    ap.add_argument("--weights", default="native")
    ap.add_argument("--config", action="append", default=[], help="mode spec run on the adapted model (repeatable)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=24, help="chat prompts (the 16 chat + 8 held-out ones)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import laserlm  # noqa: PLC0415

    orig = laserlm.load(args.model, weights=args.weights)
    adapted = laserlm.load(args.model, weights=args.weights, lora=args.delta)
    runs = [("original", orig, "full"), ("adapted", adapted, "full")] + [(c, adapted, c) for c in args.config]
    for _, lm, spec in runs:  # build modes (laser files read) and warm up
        lm.generate("Hello", chat=True, mode=spec, max_new_tokens=4, ignore_eos=True)
    prompts = (CHAT + CHAT_HELDOUT)[: args.prompts]
    acc = {name: {"tokens": 0, "seconds": 0.0, "layers": [], "same": 0, "n": 0} for name, _, _ in runs}
    t0 = time.time()
    for p in prompts:
        ref = None
        for name, lm, spec in runs:
            r = lm.generate(p, chat=True, mode=spec, max_new_tokens=args.tokens, ignore_eos=True)
            a = acc[name]
            a["tokens"] += len(r.itl_s)
            a["seconds"] += sum(r.itl_s)
            a["layers"].extend(r.layers_per_token)
            if ref is None:
                ref = r.token_ids
            a["same"] += sum(int(x == y) for x, y in zip(r.token_ids, ref))
            a["n"] += len(ref)
    out = {"model": args.model, "weights": args.weights, "delta": args.delta, "tokens": args.tokens,
           "prompts": len(prompts), "threads": args.threads, "wall_s": round(time.time() - t0, 1), "configs": {}}
    base = acc["original"]["tokens"] / acc["original"]["seconds"]
    own = acc["adapted"]["tokens"] / acc["adapted"]["seconds"]
    for name, a in acc.items():
        tps = a["tokens"] / a["seconds"]
        out["configs"][name] = {"decode_tok_s": round(tps, 2), "vs_original_full": round(tps / base, 3),
                                "vs_adapted_full": round(tps / own, 3),
                                "layers_per_token": round(sum(a["layers"]) / max(1, len(a["layers"])), 3),
                                "same_tokens_as_original": round(a["same"] / max(1, a["n"]), 4)}
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
