"""Serving benchmark in vLLM's terms (``benchmark_serving.py``): request throughput, output token throughput, and
TTFT / TPOT / ITL / E2EL (mean, median, P99) under Poisson arrivals, for laserlm modes and llama.cpp's server on
the same prompts; then the seed's real-time dialogue case (multi-turn chat sessions, latency per turn).

Workload (local data, never a test split): chat requests built from ARC-Easy dev question stems
(``../shared/data/arc/ARC-Easy-Dev.jsonl``), in file order, through the model's chat template. Throughput runs
generate exactly ``--max-tokens`` tokens per request (``ignore_eos``, so every engine and mode does the same work);
dialogue turns stop at EOS or ``--turn-tokens``. Every request streams (``stream: true`` with
``include_usage``): TTFT = first content chunk, ITL = gaps between content chunks, TPOT = (E2EL - TTFT) /
(tokens - 1), E2EL = request start to the last chunk.

Each timed run starts after a warm-up of three short requests of the same mode (not counted). Servers, one at a
time on the same port range, each started and stopped by this script:

- ``laserlm serve`` with every ``--mode`` allowed (requests name their mode), ``--weights`` (default native: the
  bundled GGUF's own Q4_1 blocks);
- ``llama-server`` (llama.cpp's own OpenAI-compatible server, ``--llama-server PATH``) on the same GGUF with
  ``--parallel`` slots and continuous batching. llama-cpp-python's ``llama_cpp.server`` wraps the same library
  one request at a time; llama-server is what llama.cpp users deploy.

Usage (run alone; record ``uptime`` before and after)::

    PYTHONPATH=. python benchmarks/bench_serve.py --modes full 'speculative:draft=ngram' \
        --llama-server PATH/llama-server --out benchmarks/history/results_serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_batch import lscpu_model  # benchmarks/ is on sys.path when this script runs

FOLLOW_UPS = ["Explain your answer in one sentence.", "Give an example from everyday life.",
              "Repeat your first answer word for word.", "Summarize our conversation in ten words."]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def questions(data_dir: Path, n: int) -> list[str]:
    out = []
    for line in (data_dir / "arc" / "ARC-Easy-Dev.jsonl").read_text(encoding="utf-8").splitlines():
        stem = (json.loads(line).get("question") or {}).get("stem")
        if stem:
            out.append(stem)
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} questions in {data_dir}/arc/ARC-Easy-Dev.jsonl")


class Server:
    def __init__(self, cmd: list[str], port: int, timeout: float = 600):
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: {' '.join(cmd)}\n{Path(self.log.name).read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit("server did not start")
            time.sleep(0.5)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def log_tail(self, n: int = 3000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        os.unlink(self.log.name)


async def one_request(client, model: str, messages: list, max_tokens: int, ignore_eos: bool, mode: str | None):
    extra = {"ignore_eos": True} if ignore_eos else {}
    if mode is not None:
        extra["mode"] = mode
    t0 = time.perf_counter()
    stamps, text, usage = [], [], None
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True},
                                                  extra_body=extra)
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text.append(ch.choices[0].delta.content)
        if ch.usage is not None:
            usage = ch.usage
    end = time.perf_counter()
    n = usage.completion_tokens if usage is not None else len(stamps)
    ttft = stamps[0] - t0 if stamps else float("nan")
    return {"ttft": ttft, "e2el": end - t0, "tokens": n, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tpot": (end - t0 - ttft) / (n - 1) if n > 1 else float("nan"), "text": "".join(text), "start": t0,
            "end": end}


def stats(xs: list[float]) -> dict:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    p99 = xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
    return {"mean": round(statistics.fmean(xs) * 1e3, 2), "median": round(statistics.median(xs) * 1e3, 2),
            "p99": round(p99 * 1e3, 2)}


async def warm_up(url: str, model: str, mode: str | None) -> None:
    """Two short requests (one to fill caches and kernels, one batched pair), not measured."""
    from openai import AsyncOpenAI  # noqa: PLC0415

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1200)
    msgs = [{"role": "user", "content": "Say something."}]
    await one_request(client, model, msgs, 8, True, mode)
    await asyncio.gather(*(one_request(client, model, msgs, 8, True, mode) for _ in range(2)))
    await client.close()


async def throughput_run(url: str, model: str, prompts: list[str], rate: float, max_tokens: int,
                         mode: str | None, seed: int = 0) -> dict:
    from openai import AsyncOpenAI  # noqa: PLC0415

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1200)
    rng = random.Random(seed)
    tasks = []
    t0 = time.perf_counter()
    for p in prompts:
        tasks.append(asyncio.create_task(one_request(client, model, [{"role": "user", "content": p}], max_tokens,
                                                     True, mode)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    res = await asyncio.gather(*tasks)
    span = max(r["end"] for r in res) - t0
    out_tokens = sum(r["tokens"] for r in res)
    await client.close()
    return {"requests": len(res), "duration_s": round(span, 2), "request_throughput": round(len(res) / span, 3),
            "output_token_throughput": round(out_tokens / span, 2), "output_tokens": out_tokens,
            "ttft_ms": stats([r["ttft"] for r in res]), "tpot_ms": stats([r["tpot"] for r in res]),
            "itl_ms": stats([x for r in res for x in r["itl"]]), "e2el_ms": stats([r["e2el"] for r in res])}


async def dialogue_run(url: str, model: str, first: list[str], turns: int, max_tokens: int, mode: str | None) -> dict:
    from openai import AsyncOpenAI  # noqa: PLC0415

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1200)

    async def session(q: str):
        messages, lat = [], []
        for t in range(turns):
            messages.append({"role": "user", "content": q if t == 0 else FOLLOW_UPS[(t - 1) % len(FOLLOW_UPS)]})
            r = await one_request(client, model, messages, max_tokens, False, mode)
            messages.append({"role": "assistant", "content": r["text"]})
            lat.append(r)
        return lat

    t0 = time.perf_counter()
    res = await asyncio.gather(*(session(q) for q in first))
    span = time.perf_counter() - t0
    turns_flat = [r for s in res for r in s]
    await client.close()
    return {"sessions": len(first), "turns": turns, "duration_s": round(span, 2),
            "turn_latency_ms": stats([r["e2el"] for r in turns_flat]), "ttft_ms": stats([r["ttft"] for r in turns_flat]),
            "tokens_per_turn": round(statistics.fmean(r["tokens"] for r in turns_flat), 2),
            "texts": [[r["text"] for r in s] for s in res]}


def spec_counters(text: str) -> dict:
    out = {}
    for ln in text.splitlines():
        for name in ("laserlm:spec_decode_num_draft_tokens_total", "laserlm:spec_decode_num_accepted_tokens_total",
                     "laserlm:layers_per_token_sum", "laserlm:layers_per_token_count"):
            if ln.startswith(name + " "):
                out[name.removeprefix("laserlm:")] = float(ln.split()[1])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="native")
    ap.add_argument("--modes", nargs="+", default=["full", "speculative:draft=ngram"])
    ap.add_argument("--rates", nargs="+", type=float, default=[0.5, 2.0], help="requests per second (inf = all at once)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server binary")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parent.parent.parent / "shared" / "data"))
    ap.add_argument("--out", default="benchmarks/out/serve.json")
    args = ap.parse_args()

    prompts = questions(Path(args.data), args.num_prompts + args.sessions)
    bench, dialog = prompts[:args.num_prompts], prompts[args.num_prompts:]
    results = {"machine": lscpu_model(), "date": time.strftime("%Y-%m-%d"), "uptime_before": uptime(),
               "argv": sys.argv, "runs": [], "dialogue": []}

    port = free_port()
    cmd = [sys.executable, "-m", "laserlm.cli", "serve", "--model", args.model, "--weights", args.weights,
           "--threads", str(args.threads), "--port", str(port), "--log-level", "warning", "--max-batch",
           str(args.max_batch), "--mode", args.modes[0], "--ctx-size", "2048", "--kv-budget", "256"]
    for m in args.modes[1:]:
        cmd += ["--allow-mode", m]
    srv = Server(cmd, port)
    try:
        for mode in args.modes:
            for rate in args.rates:
                asyncio.run(warm_up(srv.url, args.model, mode))
                before = spec_counters(srv.metrics_text())
                r = asyncio.run(throughput_run(srv.url, args.model, bench, rate, args.max_tokens, mode))
                after = spec_counters(srv.metrics_text())
                d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                r.update(engine="laserlm", mode=mode, rate=rate,
                         layers_per_token=round(d["layers_per_token_sum"] / max(d["layers_per_token_count"], 1), 2),
                         acceptance=(round(d["spec_decode_num_accepted_tokens_total"]
                                           / d["spec_decode_num_draft_tokens_total"], 3)
                                     if d.get("spec_decode_num_draft_tokens_total") else None))
                print(json.dumps(r), flush=True)
                results["runs"].append(r)
                save(results, args.out)
            dr = asyncio.run(dialogue_run(srv.url, args.model, dialog, args.turns, args.turn_tokens, mode))
            dr.update(engine="laserlm", mode=mode)
            print(json.dumps({k: v for k, v in dr.items() if k != "texts"}), flush=True)
            results["dialogue"].append(dr)
    finally:
        srv.stop()

    if args.llama_server:
        from laserlm.models.registry import BUNDLED  # noqa: PLC0415

        gguf = str(BUNDLED[args.model].locate())
        port = free_port()
        slots = args.max_batch
        srv = Server([args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t",
                      str(args.threads), "-c", str(2048 * slots), "-np", str(slots), "--cont-batching",
                      "--no-webui", "--log-disable"], port)
        try:
            for rate in args.rates:
                asyncio.run(warm_up(srv.url, args.model, None))
                save(results, args.out)
                r = asyncio.run(throughput_run(srv.url, args.model, bench, rate, args.max_tokens, None))
                r.update(engine="llama-server", mode="full (Q4_1 GGUF)", rate=rate)
                print(json.dumps(r), flush=True)
                results["runs"].append(r)
            dr = asyncio.run(dialogue_run(srv.url, args.model, dialog, args.turns, args.turn_tokens, None))
            dr.update(engine="llama-server", mode="full (Q4_1 GGUF)")
            print(json.dumps({k: v for k, v in dr.items() if k != "texts"}), flush=True)
            results["dialogue"].append(dr)
        except Exception as exc:  # noqa: BLE001 - keep the laserlm rows; say what happened
            results["llama_server_error"] = f"{type(exc).__name__}: {exc}; server log: {srv.log_tail()}"
            print("llama-server run failed:", results["llama_server_error"], file=sys.stderr)
        finally:
            srv.stop()
    results["uptime_after"] = uptime()
    save(results, args.out)
    print(f"wrote {args.out}")


def save(results: dict, path: str) -> None:
    Path(path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
