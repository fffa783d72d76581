"""onnxruntime (laserlm export onnx) vs laserlm's PyTorch engine, float32, full depth: pp / tg tokens/s.

pp: a random prompt of --n-prompt tokens prefilled from an empty cache; tg: --n-gen greedy decode steps after a
16-token prompt (llama-bench style; mean ± std over --reps, interleaved, after one warm-up). Also the export time
and graph sizes. Run under /work/bin/alone on the shared machine:

    PYTHONPATH=. python benchmarks/bench_onnx.py --out /tmp/onnx_bench --threads 1 --reps 3 --json bench_onnx.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import laserlm
    from laserlm.export.onnx import export_onnx
    from laserlm.runtime.ort_engine import OnnxEngine, OnnxModel

    lm = laserlm.load(args.model, dtype="float32", weights="fp32", max_seq_len=1024)
    eng = lm.engine
    t0 = time.perf_counter()
    man = export_onnx(eng, args.out, max_len=1024, progress=False, tokenizer=lm.tokenizer)
    export_s = time.perf_counter() - t0
    dec = OnnxEngine(OnnxModel(args.out, threads=args.threads))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, eng.config.vocab_size, (args.n_prompt,), generator=g)
    short = prompt[:16]

    def torch_pp():
        eng.reset()
        t = time.perf_counter()
        eng.prefill(prompt.unsqueeze(0))
        return args.n_prompt / (time.perf_counter() - t)

    def ort_pp():
        dec.reset()
        t = time.perf_counter()
        dec.prefill(prompt.unsqueeze(0))
        return args.n_prompt / (time.perf_counter() - t)

    def torch_tg():
        eng.reset()
        tok = int(eng.prefill(short.unsqueeze(0)).logits[0, 0].argmax())
        t = time.perf_counter()
        for _ in range(args.n_gen):
            tok = int(eng.decode_step(torch.tensor([tok])).logits[0, 0].argmax())
        return args.n_gen / (time.perf_counter() - t)

    def ort_tg():
        dec.reset()
        tok = int(dec.prefill(short.unsqueeze(0)).logits[0, 0].argmax())
        t = time.perf_counter()
        for _ in range(args.n_gen):
            tok = int(dec.decode_step(torch.tensor([tok])).logits[0, 0].argmax())
        return args.n_gen / (time.perf_counter() - t)

    tests = {"torch pp": torch_pp, "onnxruntime pp": ort_pp, "torch tg": torch_tg, "onnxruntime tg": ort_tg}
    for fn in tests.values():  # warm-up
        fn()
    runs = {k: [] for k in tests}
    for _ in range(args.reps):
        for k, fn in tests.items():
            runs[k].append(fn())
    res = {k: {"mean": statistics.mean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0, "runs": v}
           for k, v in runs.items()}
    sizes = {n: g["bytes"] for n, g in man["graphs"].items()}
    report = {"model": args.model, "threads": args.threads, "n_prompt": args.n_prompt, "n_gen": args.n_gen,
              "reps": args.reps, "export_s": export_s, "graph_bytes_total": sum(sizes.values()),
              "graph_bytes": sizes, "results": res, "cpu": platform.processor(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for k, v in res.items():
        print(f"{k:16s} {v['mean']:8.1f} ± {v['std']:.1f} t/s")
    print(f"export {export_s:.1f} s, {sum(sizes.values()) / 2**20:.0f} MiB in {len(sizes)} graphs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
