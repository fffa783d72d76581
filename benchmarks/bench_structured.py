"""Structured output cost: decode tokens/s under a JSON schema (llguidance masks in the sampler) against free decoding,
same prompts, interleaved, one engine (issue 38).

    python benchmarks/bench_structured.py [--threads 1] [--repeats 3] [--out benchmarks/out/structured.json]

Each repeat runs every prompt free, then under the schema (both greedy, 64 tokens at most); tokens/s counts
generated tokens over decode time (TTFT excluded), and the per-token mask time is measured around the sampler.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 32}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 150},
                         "city": {"type": "string", "maxLength": 32},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3}}}
PEOPLE = ["a baker", "a pilot", "a poet", "a nurse", "a farmer", "a chess player", "a sailor", "a teacher"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/out/structured.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import laserlm
    from laserlm.runtime import structured

    lm = laserlm.load(args.model)
    vocab = lm.engine.config.vocab_size
    mask_s: list[float] = []
    orig = structured.GrammarConstraint.mask

    def timed(self, logits):
        t = time.perf_counter()
        out = orig(self, logits)
        mask_s.append(time.perf_counter() - t)
        return out
    structured.GrammarConstraint.mask = timed
    rows = {"free": [], "json_schema": []}
    valid = 0
    for _ in range(args.repeats):
        for who in PEOPLE:
            msgs = [{"role": "user", "content": f"Invent {who}. Give name, age, city and hobbies as JSON."}]
            for kind in ("free", "json_schema"):
                extra = {} if kind == "free" else {"constraint": structured.json_constraint(lm.tokenizer, vocab, SCHEMA)}
                r = lm.generate(msgs, chat=True, max_new_tokens=args.max_tokens, **extra)
                rows[kind].append({"tokens": r.generated_tokens, "tok_s": r.stats()["decode_tokens_per_s"]})
                if kind == "json_schema":
                    try:
                        json.loads(r.text)
                        valid += 1
                    except json.JSONDecodeError:
                        pass
    out = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "model": args.model,
           "weights": lm.describe(), "date": time.strftime("%Y-%m-%d"), "prompts": len(PEOPLE), "repeats": args.repeats}
    for kind, rs in rows.items():
        out[kind] = {"median_tok_s": statistics.median(r["tok_s"] for r in rs),
                     "mean_tokens": statistics.mean(r["tokens"] for r in rs)}
    out["json_schema"]["parsed"] = f"{valid}/{len(rows['json_schema'])}"
    out["mask_us"] = {"median": statistics.median(mask_s) * 1e6, "p99": sorted(mask_s)[int(0.99 * len(mask_s))] * 1e6}
    out["ratio"] = out["json_schema"]["median_tok_s"] / out["free"]["median_tok_s"]
    print(json.dumps(out, indent=1))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
