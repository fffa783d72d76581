"""Engine vs transformers ``generate``: prefill (pp512) and decode (tg128) throughput, memory.

llama-bench style (DESIGN.md): pp512 = one forward over 512 prompt tokens, tg128 = 128 greedy decode
steps after a 1-token prompt; mean ± std over ``--reps`` repetitions after one warm-up. The
implementations are interleaved inside every repetition (engine, generate, engine, generate, ...), so
load from other jobs on the machine hits both alike; the ratio is the robust number.

Implementations:
- ``engine``: laserlm's :class:`~laserlm.runtime.engine.Engine` primitives (``prefill`` /
  ``decode_step`` + argmax), full depth.
- ``base``: the same engine with the optimisations of this benchmark's round switched off
  (``engine.fast_layers = False``: every layer called as a transformers module; prefill with a
  boolean causal mask instead of SDPA ``is_causal``), i.e. the engine before them.
- ``laserlm``: ``LaserLM.generate`` end to end (adds sampling, detokenization, stop handling).
- ``hf``: an unmodified transformers model instance loaded from the same converted weights,
  ``model.generate(do_sample=False)`` with its default dynamic cache, eager PyTorch, SDPA attention.
  pp512 = ``generate(max_new_tokens=1)``; tg128 timed from the first to the last generated token
  (a streamer timestamps tokens), i.e. 127 decode steps, the same for every implementation.

Peak memory: each (implementation, dtype) runs pp512 + tg128 once in a fresh subprocess that reports
its peak RSS (``resource.getrusage``); KV-cache bytes: the engine's preallocated cache and
transformers' dynamic cache after tg128.

Usage::

    python benchmarks/bench_engine.py --model smollm2-135m --dtypes float32 bfloat16 --reps 5 \
        --out benchmarks/results_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import torch

PP, TG = 512, 128


class _Clock:
    """A transformers streamer that timestamps every generated token."""

    def __init__(self):
        self.times: list[float] = []
        self.calls = 0

    def put(self, value):
        self.calls += 1
        if self.calls > 1:  # the first call carries the prompt
            self.times.append(time.perf_counter())

    def end(self):
        pass


def _prompt(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (1, n), generator=g)


class Runner:
    """Loads one model in one dtype and times the implementations on it."""

    def __init__(self, model_name: str, dtype: str, impls: list[str]):
        import laserlm
        from transformers import AutoModelForCausalLM

        self.lm = laserlm.load(model_name, dtype=dtype, max_seq_len=PP + TG + 16)
        self.engine = self.lm.engine
        self.vocab = self.engine.config.vocab_size
        self.hf = None
        if "hf" in impls:
            self.hf = AutoModelForCausalLM.from_pretrained(
                self.lm.loaded.path, dtype=self.lm.loaded.dtype, attn_implementation="sdpa").eval()
        self.pp_ids = _prompt(self.vocab, PP)
        self.tg_ids = _prompt(self.vocab, 1, seed=1)
        self.hf_cache_bytes = None

    # -- engine primitives ------------------------------------------------------------------
    @torch.inference_mode()
    def engine_pp(self) -> float:
        self.engine.reset()
        t0 = time.perf_counter()
        self.engine.prefill(self.pp_ids)
        return PP / (time.perf_counter() - t0)

    @torch.inference_mode()
    def engine_tg(self) -> float:
        e = self.engine
        e.reset()
        token = e.prefill(self.tg_ids).logits[:, -1].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(TG - 1):
            token = e.decode_step(token).logits[:, -1].argmax(-1)
        return (TG - 1) / (time.perf_counter() - t0)

    # -- the engine before the optimisations (transformers layer modules, boolean prefill mask) --
    def _baseline(self, fn):
        from laserlm.runtime import attention as attn

        saved = attn.AttentionContext.plain_causal
        attn.AttentionContext.plain_causal = lambda *args, **kwargs: False
        self.engine.fast_layers = False
        try:
            return fn()
        finally:
            self.engine.fast_layers = True
            attn.AttentionContext.plain_causal = saved

    def base_pp(self) -> float:
        return self._baseline(self.engine_pp)

    def base_tg(self) -> float:
        return self._baseline(self.engine_tg)

    # -- LaserLM.generate -------------------------------------------------------------------
    def laserlm_tg(self) -> float:
        from laserlm.runtime.generate import Generation
        from laserlm.runtime.sampling import SamplingParams

        params = SamplingParams(max_new_tokens=TG, ignore_eos=True).validate()
        gen = Generation(self.lm.tokenizer, self.tg_ids[0], self.lm._token_source("full"), params,
                         self.lm.eos_ids, self.engine.max_seq_len)
        r = gen.run()
        assert r.generated_tokens == TG
        return (TG - 1) / sum(r.itl_s)

    # -- transformers generate --------------------------------------------------------------
    @torch.inference_mode()
    def hf_pp(self) -> float:
        t0 = time.perf_counter()
        self.hf.generate(self.pp_ids, attention_mask=torch.ones_like(self.pp_ids), do_sample=False,
                         max_new_tokens=1)
        return PP / (time.perf_counter() - t0)

    @torch.inference_mode()
    def hf_tg(self) -> float:
        clock = _Clock()
        out = self.hf.generate(self.tg_ids, attention_mask=torch.ones_like(self.tg_ids), do_sample=False,
                               max_new_tokens=TG, min_new_tokens=TG, streamer=clock,
                               return_dict_in_generate=True)
        assert len(clock.times) == TG
        cache = out.past_key_values
        self.hf_cache_bytes = _cache_bytes(cache)
        return (TG - 1) / (clock.times[-1] - clock.times[0])


def _cache_bytes(cache) -> int | None:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total or None


def _stats(xs: list[float]) -> dict:
    return {"mean": statistics.mean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "runs": xs}


def bench_throughput(model: str, dtype: str, reps: int, impls: list[str]) -> dict:
    r = Runner(model, dtype, impls)
    tests = []
    for impl in impls:
        if impl in ("engine", "base", "hf"):
            tests.append((f"{impl}/pp{PP}", getattr(r, f"{impl}_pp")))
        tests.append((f"{impl}/tg{TG}", getattr(r, f"{impl}_tg")))
    for name, fn in tests:  # warm-up
        fn()
    runs: dict[str, list[float]] = {name: [] for name, _ in tests}
    for rep in range(reps):
        for name, fn in tests:
            runs[name].append(fn())
        print(f"  rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()), file=sys.stderr)
    return {"tokens_per_s": {k: _stats(v) for k, v in runs.items()},
            "kv_cache_bytes": {"engine_preallocated": r.engine.cache.nbytes,
                               "engine_max_seq_len": r.engine.max_seq_len,
                               "engine_per_token": r.engine.cache.nbytes // r.engine.max_seq_len,
                               f"hf_after_tg{TG}": r.hf_cache_bytes}}


def child_memory(model: str, dtype: str, impl: str) -> None:
    """One pp512 + tg128 run of one implementation in this (fresh) process; prints JSON with the peak RSS
    of the whole process (``ru_maxrss``, includes loading), the RSS after loading and the highest RSS
    sampled every 5 ms while pp512 + tg128 ran (bytes)."""
    import threading

    import psutil

    torch.set_num_threads(1)
    proc = psutil.Process()
    if impl == "hf":
        from transformers import AutoModelForCausalLM

        from laserlm.models.loader import DTYPES, resolve

        r = Runner.__new__(Runner)
        r.hf = AutoModelForCausalLM.from_pretrained(resolve(model), dtype=DTYPES[dtype],
                                                    attn_implementation="sdpa").eval()
        r.vocab = r.hf.config.vocab_size
        r.pp_ids, r.tg_ids = _prompt(r.vocab, PP), _prompt(r.vocab, 1, seed=1)
        run = lambda: (r.hf_pp(), r.hf_tg())  # noqa: E731
    else:
        r = Runner(model, dtype, [])
        run = lambda: (r.engine_pp(), r.engine_tg())  # noqa: E731
    after_load = proc.memory_info().rss
    peak = [after_load]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    run()
    done.set()
    t.join()
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rss_bytes": rss_kib * 1024, "rss_after_load_bytes": after_load,
                      "peak_rss_during_run_bytes": peak[0]}))


def peak_memory(model: str, dtype: str, impl: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child-memory", impl, "--model", model, "--dtypes", dtype],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)
        flags = next((ln for ln in lines if ln.startswith("flags")), "")
        cpu += " (" + ", ".join(f for f in ("avx512f", "amx_bf16", "amx_tile") if f in flags.split()) + ")"
    except OSError:
        pass
    import transformers

    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "loadavg_start": os.getloadavg()}


def markdown(results: list[dict]) -> str:
    """A Markdown table of pp/tg tokens/s (mean ± std) and per-repetition ratios vs transformers."""
    rows = ["| model | dtype | test | engine | engine before (base) | LaserLM.generate | transformers generate "
            "| engine / generate (median of per-rep ratios) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for dtype, res in r["by_dtype"].items():
            tps = res.get("tokens_per_s")
            if not tps:
                continue
            for test in (f"pp{PP}", f"tg{TG}"):
                def cell(impl):
                    v = tps.get(f"{impl}/{test}")
                    return f"{v['mean']:.1f} ± {v['std']:.1f}" if v else "–"
                ratio = "–"
                if f"engine/{test}" in tps and f"hf/{test}" in tps:
                    ratios = [a / b for a, b in zip(tps[f"engine/{test}"]["runs"], tps[f"hf/{test}"]["runs"])]
                    ratio = f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})"
                rows.append(f"| {r['model']} | {dtype} | {test} | {cell('engine')} | {cell('base')} | "
                            f"{cell('laserlm')} | {cell('hf')} | {ratio} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--impls", nargs="+", default=["engine", "base", "laserlm", "hf"])
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="append the JSON result to this file")
    p.add_argument("--child-memory", default=None, help=argparse.SUPPRESS)
    p.add_argument("--markdown", default=None, metavar="JSONL", help="print a table from an --out file and exit")
    args = p.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown([json.loads(line) for line in f if line.strip()]))
        return 0
    if args.child_memory:
        child_memory(args.model, args.dtypes[0], args.child_memory)
        return 0
    torch.set_num_threads(args.threads)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": args.model,
              "command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
              "machine": machine(), "reps": args.reps, "by_dtype": {}}
    for dtype in args.dtypes:
        print(f"{args.model} {dtype}", file=sys.stderr)
        res = bench_throughput(args.model, dtype, args.reps, args.impls) if args.reps > 0 else {}
        if args.reps == 0:  # memory only
            res["peak_rss_bytes"] = {impl: peak_memory(args.model, dtype, impl) for impl in ("engine", "hf")}
        if not args.no_memory and args.reps > 0:
            res["peak_rss_bytes"] = {impl: peak_memory(args.model, dtype, impl) for impl in ("engine", "hf")}
        result["by_dtype"][dtype] = res
    result["machine"]["loadavg_end"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
