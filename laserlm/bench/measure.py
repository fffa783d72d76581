"""Throughput and latency measurements (llama-bench and vLLM-benchmark conventions).

- ``pp{N}``: prompt processing, N random tokens (seeded) in one prefill; tokens/s = N / time to the
  first token (TTFT of an N-token prompt).
- ``tg{N}``: token generation, N tokens decoded one at a time after a 1-token prompt (llama-bench
  starts from an empty context); tokens/s = N / total decode time.
- generation run: a chat prompt, ``n_gen`` greedy tokens (EOS ignored): TTFT, TPOT (mean inter-token
  latency), P50 / P99 inter-token latency (ITL), average decoder layers per generated token.
- memory: peak resident set size (RSS) of the process while the configuration ran (sampled every
  5 ms with psutil; the process holds every loaded model), and KV-cache bytes (allocated / in use).

Each repetition measures every configuration in turn (A, B, A, B, ...) so that load from other
processes affects all of them alike; ``warmup`` unmeasured rounds come first. Results are
``mean ± std`` over repetitions.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch

from ..mode_table import make_mode
from ..runtime.loop import generate_tokens
from ..runtime.sampling import SamplingParams

GEN_PROMPT = "Explain in a few paragraphs how a steam engine works and why it mattered for the industrial revolution."


@dataclass
class Samples:
    """Raw samples of one configuration; times in seconds."""

    pp: list[float] = field(default_factory=list)  # tokens/s per repetition
    tg: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # pooled over repetitions
    layers: list[float] = field(default_factory=list)
    peak_rss: int = 0
    kv_alloc_bytes: int | None = None
    kv_used_bytes: int | None = None
    note: str = ""


def mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] (NaN for no samples)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def summarize(name: str, s: Samples, n_prompt: int, n_gen: int) -> dict:
    """Summary row of one configuration (tokens/s, milliseconds, MiB)."""
    pp_m, pp_s = mean_std(s.pp)
    tg_m, tg_s = mean_std(s.tg)
    return {
        "config": name, f"pp{n_prompt}": pp_m, f"pp{n_prompt}_std": pp_s, f"tg{n_gen}": tg_m, f"tg{n_gen}_std": tg_s,
        "pp_tokens_per_s": pp_m, "pp_std": pp_s, "tg_tokens_per_s": tg_m, "tg_std": tg_s,
        "ttft_ms": mean_std(s.ttft)[0] * 1e3, "tpot_ms": (statistics.fmean(s.itl) * 1e3 if s.itl else float("nan")),
        "itl_p50_ms": percentile(s.itl, 50) * 1e3, "itl_p99_ms": percentile(s.itl, 99) * 1e3,
        "layers_per_token": statistics.fmean(s.layers) if s.layers else float("nan"),
        "peak_rss_mib": s.peak_rss / 2**20 if s.peak_rss else float("nan"),
        "kv_alloc_mib": s.kv_alloc_bytes / 2**20 if s.kv_alloc_bytes is not None else float("nan"),
        "kv_used_mib": s.kv_used_bytes / 2**20 if s.kv_used_bytes is not None else float("nan"),
        "reps": len(s.tg) or len(s.pp), "note": s.note,
    }


class PeakRSS:
    """Context manager sampling this process's resident set size every ``interval`` s; ``.peak`` in bytes."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()

    def _poll(self):
        import psutil  # noqa: PLC0415

        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self):
        try:
            import psutil  # noqa: F401, PLC0415
        except ImportError:
            return self
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if hasattr(self, "_t"):
            self._t.join()


def random_prompt(vocab: int, n: int, seed: int) -> torch.Tensor:
    """``[n]`` random token ids (llama-bench uses random tokens), avoiding the first 100 ids (special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab - 1), vocab, (n,), generator=g)


class _TokenTarget:
    """pp / tg / gen from a ``_events(ids, n) -> [TokenEvent]`` greedy run (laserlm's engine and the onnxruntime
    engine both emit :class:`~laserlm.runtime.generate.TokenEvent`)."""

    def pp(self, ids) -> float:
        ev = self._events(ids, 1)
        return ids.shape[0] / ev[0].seconds

    def tg(self, first_token, n) -> tuple[float, list[float]]:
        ev = self._events(first_token, n)
        return n / sum(e.seconds for e in ev), [e.layers for e in ev]

    def gen(self, ids, n) -> tuple[float, list[float], list[float]]:
        ev = self._events(ids, n)
        return ev[0].seconds, [e.seconds for e in ev[1:]], [e.layers for e in ev]


class EngineTarget(_TokenTarget):
    """A laserlm decoding mode on the shared engine (laserlm's, or the onnxruntime engine of an export), measured
    through the one decode loop."""

    def __init__(self, lm, spec: str):
        from ..mode_table import config_kernel, split_config  # noqa: PLC0415

        self.lm, self.name = lm, spec
        self.kernel = config_kernel(lm.engine, spec)
        self.mode = make_mode(split_config(spec)[0], lm.engine)

    def _events(self, ids, n):
        self.lm.engine.kernel = self.kernel
        greedy = SamplingParams(max_new_tokens=n, temperature=0.0)
        with torch.inference_mode():
            return list(generate_tokens(self.lm.engine, self.mode, ids, greedy, n))

    def kv_bytes(self, tokens: int) -> tuple[int, int]:
        """A request allocates its own KV cache of prompt + max_new_tokens positions (``Engine.new_cache``), so
        for the generation run allocated = used = ``tokens`` positions."""
        cache = self.lm.engine.new_cache(tokens)
        return cache.nbytes, cache.nbytes


class _Clock:
    """A transformers streamer recording when each batch of tokens arrives."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


class HFTarget:
    """The unmodified transformers model (a separate instance) measured through ``generate``."""

    def __init__(self, lm, attn_implementation: str = "sdpa"):
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        from ..models.loader import reference_dir  # noqa: PLC0415

        self.name = f"transformers generate ({attn_implementation})"
        self.model = AutoModelForCausalLM.from_pretrained(reference_dir(lm.loaded), dtype=lm.engine.dtype,
                                                          attn_implementation=attn_implementation).eval()
        self.pad = lm.tokenizer.eos_token_id
        self.num_layers = lm.engine.num_layers
        self.last_kv = None

    def _generate(self, ids, n):
        from transformers.generation.streamers import BaseStreamer  # noqa: PLC0415

        clock = type("Clock", (_Clock, BaseStreamer), {})()
        x = ids.unsqueeze(0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=self.pad, streamer=clock,
                                      return_dict_in_generate=True)
        self.last_kv = out.past_key_values
        # put() is called once with the prompt (at the start) and then once per new token
        stamps = [t0] + clock.times[1:]
        return [b - a for a, b in zip(stamps, stamps[1:])]

    def pp(self, ids) -> float:
        return ids.shape[0] / self._generate(ids, 1)[0]

    def tg(self, first_token, n):
        d = self._generate(first_token, n)
        return n / sum(d), [self.num_layers] * n

    def gen(self, ids, n):
        d = self._generate(ids, n)
        return d[0], d[1:], [self.num_layers] * n

    def kv_bytes(self, tokens: int):
        kv = self.last_kv
        try:
            used = sum(layer.keys.nbytes + layer.values.nbytes for layer in kv.layers)
        except AttributeError:
            return None, None
        return used, used  # a dynamic cache allocates what it holds


class LlamaCppTarget:
    """llama.cpp through ``llama_cpp`` (llama-cpp-python) on the model's GGUF file, when importable."""

    def __init__(self, gguf_path: str, threads: int, n_ctx: int):
        from llama_cpp import Llama  # noqa: PLC0415

        self.name = "llama.cpp (GGUF)"
        self.llm = Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=512, verbose=False)
        self.vocab = self.llm.n_vocab()

    def _ids(self, ids):
        return [int(i) % self.vocab for i in ids]

    def pp(self, ids) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(self._ids(ids))
        return ids.shape[0] / (time.perf_counter() - t0)

    def tg(self, first_token, n):
        self.llm.reset()
        tok, t0 = self._ids(first_token), time.perf_counter()
        for _ in range(n):
            self.llm.eval(tok)
        return n / (time.perf_counter() - t0), [float("nan")] * n

    def gen(self, ids, n):
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(self._ids(ids))
        tok = [int(self.llm.scores[self.llm.n_tokens - 1].argmax())]
        stamps = [t0, time.perf_counter()]
        for _ in range(n - 1):
            self.llm.eval(tok)
            tok = [int(self.llm.scores[self.llm.n_tokens - 1].argmax())]
            stamps.append(time.perf_counter())
        d = [b - a for a, b in zip(stamps, stamps[1:])]
        return d[0], d[1:], [float("nan")] * n

    def kv_bytes(self, tokens: int):
        return None, None


def run_bench(targets: list, prompt_ids: torch.Tensor, gen_ids: torch.Tensor, n_gen: int, reps: int,
              warmup: int, tests=("pp", "tg", "gen"), progress: bool = True) -> dict[str, Samples]:
    """Measure every target ``reps`` times, interleaved, after ``warmup`` unmeasured rounds.

    Args:
        targets: objects with ``name``, ``pp(ids)``, ``tg(first_token, n)``, ``gen(ids, n)``, ``kv_bytes(tokens)``.
        prompt_ids: ``[n_prompt]`` tokens for ``pp``; its first token starts ``tg``.
        gen_ids: ``[T]`` prompt of the generation run.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    samples = {t.name: Samples() for t in targets}
    total = (warmup + reps) * len(targets)
    bar = tqdm(total=total, desc="bench", disable=not progress, leave=False, dynamic_ncols=True)
    for r in range(warmup + reps):
        measured = r >= warmup
        for t in targets:
            s = samples[t.name]
            bar.set_postfix_str(f"{t.name} rep {r - warmup + 1 if measured else 'warm-up'}")
            try:
                with PeakRSS() as mem:
                    if "pp" in tests:
                        v = t.pp(prompt_ids)
                        if measured:
                            s.pp.append(v)
                    if "tg" in tests:
                        v, layers = t.tg(prompt_ids[:1], n_gen)
                        if measured:
                            s.tg.append(v)
                            s.layers.extend(layers)
                    if "gen" in tests:
                        ttft, itl, _layers = t.gen(gen_ids, n_gen)
                        if measured:
                            s.ttft.append(ttft)
                            s.itl.extend(itl)
                            if "tg" not in tests:
                                s.layers.extend(_layers)
                        s.kv_alloc_bytes, s.kv_used_bytes = t.kv_bytes(gen_ids.shape[0] + n_gen)
                s.peak_rss = max(s.peak_rss, mem.peak)
            except Exception as exc:  # noqa: BLE001 - an optional baseline failing is reported, not fatal
                if not getattr(t, "optional", False):
                    raise
                s.note = f"failed: {type(exc).__name__}: {exc}"
            bar.update(1)
    bar.close()
    return samples
