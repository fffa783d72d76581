"""What log-probabilities cost a server (issue 38): the same 24 chat requests (ARC-Easy dev stems, 48 tokens each,
``ignore_eos``) sent all at once to one ``laserlm serve``, without and with ``logprobs`` (``top_logprobs`` 5),
alternated, non-streaming (logprobs are not on streams yet). Reports output tokens/s over the batch, the mean
request latency, and TPOT = (latency - TTFT) / (tokens - 1) with the server's own ``timings.prompt_ms`` as TTFT
(so the scoring pass at the end counts in TPOT).

    python benchmarks/bench_serve_logprobs.py --data ../shared/data/arc/ARC-Easy-Dev.jsonl [--threads 1]

Writes ``benchmarks/out/serve_logprobs.json``. Run alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the ServerProcess helper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/out/serve_logprobs.json")
    args = ap.parse_args()
    from server_helpers import ServerProcess, http

    stems = [json.loads(x)["question"]["stem"] for x in args.data.read_text().splitlines()[:args.requests]]
    srv = ServerProcess(["--model", "smollm2-135m", "--threads", str(args.threads), "--ctx-size", "1024",
                         "--max-batch", "16"])
    results = {"off": [], "on": []}
    try:
        for _ in range(args.repeats):
            for kind in ("off", "on"):
                extra = {"logprobs": True, "top_logprobs": 5} if kind == "on" else {}
                got = []

                def one(q: str) -> None:
                    t = time.perf_counter()
                    status, out = http("POST", srv.url + "/v1/chat/completions", {
                        "model": "smollm2-135m", "messages": [{"role": "user", "content": q}], "temperature": 0,
                        "max_tokens": args.max_tokens, "ignore_eos": True, **extra}, timeout=600)
                    assert status == 200, out
                    got.append((time.perf_counter() - t, out["timings"]["prompt_ms"] / 1e3,
                                out["usage"]["completion_tokens"]))
                t0 = time.perf_counter()
                threads = [threading.Thread(target=one, args=(q,)) for q in stems]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                wall = time.perf_counter() - t0
                results[kind].append({"wall_s": wall, "tok_s": sum(g[2] for g in got) / wall,
                                      "latency_s": statistics.mean(g[0] for g in got),
                                      "tpot_ms": statistics.mean((g[0] - g[1]) / (g[2] - 1) for g in got) * 1e3})
    finally:
        srv.stop()
    out = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "requests": args.requests,
           "max_tokens": args.max_tokens}
    for kind, rs in results.items():
        out[kind] = {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
    out["throughput_ratio_on_off"] = round(out["on"]["tok_s"] / out["off"]["tok_s"], 3)
    print(json.dumps(out, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
