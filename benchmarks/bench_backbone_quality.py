"""Quality of a backbone delta (issue 33) at full depth: the adapted model against the original it was trained from.

Measures, on WikiText-2 *test* (reporting only; never a training split) in chunks of ``--chunk`` tokens:

- perplexity of the original and of the adapted model, each in float32 (``--weights fp32``) and in the GGUF's own
  formats (``native``; the adapted matrices merged in float and re-quantized into the original's format);
- greedy (top-1) agreement of the adapted model with the original, native against native;
- the re-quantization error: merged-then-packed (native) against merged-in-float (fp32) of the adapted model, beside
  the same comparison for the original (native against fp32), so the delta's own packing cost is the difference.

Usage::

    PYTHONPATH=. python benchmarks/bench_backbone_quality.py --delta smol.delta.safetensors --out out.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


@torch.inference_mode()
def run(lm, ids: torch.Tensor, chunk: int):
    """``(top1 [N], nll [N])`` over ``ids`` cut into chunks (each chunk a fresh forward)."""
    tops, nll = [], []
    for s in range(0, ids.numel() - 1, chunk):
        x = ids[s:s + chunk + 1]
        if x.numel() < 2:
            break
        logits = lm.engine.forward(x[:-1].unsqueeze(0), logits="all", use_cache=False).logits[0].float()
        tops.append(logits.argmax(-1))
        nll.append(torch.nn.functional.cross_entropy(logits, x[1:], reduction="none"))
    return torch.cat(tops), torch.cat(nll)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--delta", required=True)
    ap.add_argument("--data", default=None, help="data directory (default: $LASERLM_DATA or ../shared/data)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import laserlm  # noqa: PLC0415
    from laserlm.data import resolve  # noqa: PLC0415

    tok = laserlm.load(args.model, weights="native").tokenizer
    test = resolve(args.data, "wikitext-2/test.txt", what="WikiText-2 test")
    text = open(test, encoding="utf-8", errors="replace").read()[: args.tokens * 8]
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][: args.tokens + 1])
    res = {}
    for name, weights, delta in (("original_fp32", "fp32", None), ("original_native", "native", None),
                                 ("adapted_fp32", "fp32", args.delta), ("adapted_native", "native", args.delta)):
        t = time.perf_counter()
        lm = laserlm.load(args.model, weights=weights, lora=delta)
        top, nll = run(lm, ids, args.chunk)
        res[name] = {"top1": top, "ppl": math.exp(float(nll.double().mean())), "seconds": time.perf_counter() - t}
        del lm
    agree = lambda a, b: round(float((res[a]["top1"] == res[b]["top1"]).double().mean()), 4)  # noqa: E731
    out = {
        "tokens": int(ids.numel() - 1), "chunk": args.chunk, "delta": args.delta,
        "ppl": {k: round(v["ppl"], 3) for k, v in res.items()},
        "ppl_change_native": round(res["adapted_native"]["ppl"] / res["original_native"]["ppl"] - 1, 4),
        "ppl_change_fp32": round(res["adapted_fp32"]["ppl"] / res["original_fp32"]["ppl"] - 1, 4),
        "agreement_adapted_vs_original_native": agree("adapted_native", "original_native"),
        "agreement_adapted_vs_original_fp32": agree("adapted_fp32", "original_fp32"),
        "requantization": {"adapted_native_vs_adapted_fp32": agree("adapted_native", "adapted_fp32"),
                           "original_native_vs_original_fp32": agree("original_native", "original_fp32")},
    }
    print(json.dumps(out, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
