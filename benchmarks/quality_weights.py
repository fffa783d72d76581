"""Quality of each weight format against the dequantized-fp32 reference on WikiText-2 *test*: perplexity
(non-overlapping windows, teacher-forced, prefill path = BLAS over the packed matrices), greedy top-1
agreement per position, and decode-path agreement (token by token through the compiled decode step, T=1),
plus load time and peak RSS of a fresh process per format. Prints a markdown table.

    python benchmarks/quality_weights.py --model smollm2-135m --weights native,int4,int8,bf16 --windows 20
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import torch

CHILD = r"""
import json, resource, sys, time, torch
import laserlm
torch.set_num_threads(1)
t = time.perf_counter()
lm = laserlm.load(sys.argv[1], weights=sys.argv[2])
load = time.perf_counter() - t
lm.generate("Hello", max_new_tokens=4)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"load_s": load, "peak_rss_mib": int(hwm) / 1024,
                  "describe": lm.describe()}))
"""


def windows(tok, n, length):
    from laserlm.evaluation.data import read_wikitext, task_paths

    text = read_wikitext(task_paths("wikitext")[0])
    ids = torch.tensor(tok(text[: 400 * n * length // 80])["input_ids"])
    return [ids[i * length:(i + 1) * length] for i in range(n) if (i + 1) * length <= len(ids)]


def main() -> None:
    import laserlm

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="native,int4,int8,bf16")
    p.add_argument("--windows", type=int, default=20)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--prefill-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="prefill dtype of the quantized formats (default: auto)")
    a = p.parse_args()
    torch.set_num_threads(1)
    ref = laserlm.load(a.model, weights="fp32")
    ws = windows(ref.tokenizer, a.windows, a.length)
    with torch.inference_mode():
        ref_logits = [ref.engine.forward(w.unsqueeze(0), logits="all", use_cache=False).logits[0, :-1] for w in ws]
    nll = sum(torch.nn.functional.cross_entropy(l, w[1:], reduction="sum").item() for l, w in zip(ref_logits, ws))
    n = sum(w.numel() - 1 for w in ws)
    ref_ppl = math.exp(nll / n)
    stream = torch.cat(ws)[: a.decode_tokens + 1]
    ref_next = []
    with torch.inference_mode():
        ref.engine.reset()
        for tok in stream[:-1]:
            ref_next.append(int(ref.engine.decode_step(tok.view(1)).logits.argmax()))
    print(f"{a.model}: WikiText-2 test, {len(ws)} x {a.length}-token windows ({n} scored positions); decode "
          f"agreement over {a.decode_tokens} teacher-forced single-token steps")
    print("| weights | perplexity | vs fp32 | top-1 agreement (prefill) | agreement (decode) | load s | peak RSS MiB | storage |")
    print("|---|---|---|---|---|---|---|---|")
    for w in ["fp32"] + [x for x in a.weights.split(",") if x != "fp32"]:
        proc = json.loads(subprocess.run([sys.executable, "-c", CHILD, a.model, w], capture_output=True, text=True,
                                         check=True).stdout.strip().splitlines()[-1])
        if w == "fp32":
            ppl, agree, dec = ref_ppl, 1.0, 1.0
        else:
            lm = laserlm.load(a.model, weights=w, prefill_dtype=a.prefill_dtype)
            nll_q, same = 0.0, 0
            with torch.inference_mode():
                for lr, win in zip(ref_logits, ws):
                    lq = lm.engine.forward(win.unsqueeze(0), logits="all", use_cache=False).logits[0, :-1]
                    nll_q += torch.nn.functional.cross_entropy(lq, win[1:], reduction="sum").item()
                    same += (lq.argmax(-1) == lr.argmax(-1)).sum().item()
                lm.engine.reset()
                dsame = sum(int(lm.engine.decode_step(tok.view(1)).logits.argmax()) == r
                            for tok, r in zip(stream[:-1], ref_next))
            ppl, agree, dec = math.exp(nll_q / n), same / n, dsame / len(ref_next)
            del lm
        print(f"| {w} | {ppl:.3f} | {100 * (ppl / ref_ppl - 1):+.2f} % | {agree:.4f} | {dec:.4f} | "
              f"{proc['load_s']:.2f} | {proc['peak_rss_mib']:.0f} | {proc['describe']} |", flush=True)


if __name__ == "__main__":
    main()
