"""``laserlm report seeds``: both seeds' result tables with laserlm's figure beside every row, from one run on one
model.

The seeds (the design articles laserlm is built from) report:

- **seed 004 §4** (GLUE and internal data): speed, memory saved and accuracy change of the dynamic compute path,
  sparse attention, memory-pool pre-allocation and all combined; and scenario figures (dialogue response latency,
  batch documents per minute, P99 latency from the memory strategies, compute on simple code completions);
- **seed 000 §2.2**: latency per token, peak memory, long-text consistency and hardware utilization of traditional
  against Laser execution, and the inter-layer feature decay past 2,048 tokens.

:func:`run_seeds` measures each row on the loaded model in one process and returns :class:`Row` s; every row is
present in the output, measured or with the reason it is not comparable. Configurations:

- *traditional* / *full*: mode ``full``;
- *dynamic compute path* / *Laser*: mode ``adaptive:laser=FILE`` (certified gates, the propagate bridge) and, for the
  dynamic-path rows, also mode ``routed:laser=FILE`` (seed 004's router);
- *sparse attention*: ``@sparse`` (progressive block-sparse attention, :mod:`laserlm.attention`);
- *memory-pool pre-allocation*: the continuous-batching scheduler on the paged pool pre-allocated in steps
  (``kv_prealloc="staged"``) against plain per-request allocation (``"request"``: each request's own contiguous
  cache, allocated when admitted, freed when done), the seed's baseline; the fully pre-allocated pool (``"full"``)
  is reported beside them;
- *all combined*: ``adaptive:laser=FILE@sparse`` on the staged pool.

The dialogue scenario is measured over HTTP: chat requests sent one at a time to the app of ``laserlm serve`` on
127.0.0.1 (uvicorn in a thread of the report's process, sharing its model; :meth:`_Runs.dialogue`).

Our definitions, where they differ from the seeds' (also in each row's ``definition``): speed = wall time of the same
work at full depth over the configuration's (GLUE: scoring the dev items zero-shot with lm-eval's prompts; decode:
generated tokens); memory saved = KV bytes the configuration keeps (or allocates, for the pool) against full depth,
since one process cannot separate per-configuration RSS; long-text consistency = top-1 agreement with full depth past
position 2,048 of the long novel (the seed's 0.82 for *traditional* is its own score; full depth scores 1.0 against
itself); decay per 1k = the fall of that agreement per 1,000 tokens of context past 2,048; utilization = bytes a
decode step reads times tokens/s over the measured read bandwidth.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..errors import InvalidArgumentError

SEED_004 = {  # seed 004 §4: speed (x), memory saved (fraction), accuracy change (fraction)
    "dynamic compute path": (1.8, 0.22, -0.003),
    "sparse attention": (2.1, 0.35, -0.007),
    "memory-pool pre-allocation": (1.4, 0.18, 0.0),
    "all combined": (3.2, 0.41, -0.009),
}
SEED_000 = {  # seed 000 §2.2: (traditional, Laser)
    "latency per token (ms)": (58.0, 33.0),
    "peak memory (GB)": (24.0, 18.0),
    "long-text consistency": (0.82, 0.85),
    "hardware utilization": (0.71, 0.89),
    "feature decay per 1k tokens past 2,048": (0.15, 0.07),
}
SEED_SCENARIOS = {  # seed 004 §4: (before, after)
    "dialogue response latency (ms)": (650.0, 210.0),
    "batch documents (docs/min)": (120.0, 340.0),
    "P99 latency, memory strategies (ms)": (387.0, 213.0),
    "simple code completions: compute": (1.0, 0.4),
}
# a small set of syntax-completion prompts (the seed's "simple code completions"), written for this report
CODE_PROMPTS = (
    "def add(a, b):\n    return",
    "for i in range(10):\n    print(",
    "import numpy as",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y =",
    "if __name__ == \"__main__\":\n    main(",
    "def is_even(n):\n    return n %",
    "with open(\"data.txt\") as f:\n    lines = f.",
    "numbers = [1, 2, 3]\ntotal = sum(",
    "try:\n    x = int(s)\nexcept ValueError:\n    x =",
    "SELECT name FROM users WHERE id =",
    "const xs = [1, 2, 3].map(x =>",
    "#include <stdio.h>\nint main() {\n    printf(",
)


@dataclass
class SeedsConfig:
    """What :func:`run_seeds` measures and how much.

    Attributes:
        laser: a laser file for the model (``laserlm calibrate``; its router serves the routed rows); ``None``: the
            rows that need one say so.
        glue_task / glue_limit: the GLUE task (``sst2``, ``rte``, ``mrpc``, ``qnli``) and items scored (None: all).
        long_tokens: tokens of the long document (the long-text rows need more than 2,048).
        decode_tokens / decode_prompts: greedy tokens per request and chat prompts for the latency rows.
        docs / doc_tokens: documents and their prompt tokens in the batch rows; ``doc_new_tokens`` generated each.
        kv_budget / max_batch: the batch rows' pool budget and running requests.
        data: the data directory (GLUE, the long novel, WikiText-2); None: the default.
        attention: the sparse-attention spec (``sparse`` or ``sparse:...``).
        bandwidth_mib: the buffer the read-bandwidth probe streams (utilization).
    """

    laser: str | None = None
    glue_task: str = "sst2"
    glue_limit: int | None = 100
    long_tokens: int = 4096
    decode_tokens: int = 48
    decode_prompts: int = 8
    docs: int = 16
    doc_tokens: int = 96
    doc_new_tokens: int = 32
    kv_budget: object = "256MiB"
    max_batch: int = 8
    data: str | None = None
    attention: str = "sparse"
    bandwidth_mib: int = 512
    progress: bool = True

    def validate(self) -> SeedsConfig:
        for name in ("long_tokens", "decode_tokens", "decode_prompts", "docs", "doc_tokens", "doc_new_tokens",
                     "max_batch", "bandwidth_mib"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name.replace('_', ' ')} must be a positive integer, got {v!r}")
        if self.bandwidth_mib < 64:
            raise InvalidArgumentError(f"bandwidth mib must be >= 64 (a smaller buffer fits in cache), got "
                                       f"{self.bandwidth_mib}")
        if self.decode_tokens < 2:
            raise InvalidArgumentError("decode tokens must be >= 2 (a decode rate needs a token after the first)")
        if self.long_tokens < 3:
            raise InvalidArgumentError(f"long tokens must be >= 3, got {self.long_tokens}")
        if self.glue_limit is not None and self.glue_limit < 1:
            raise InvalidArgumentError(f"glue limit must be >= 1 (or 0 / None for every item), got {self.glue_limit}")
        if self.glue_task not in ("sst2", "rte", "mrpc", "qnli"):
            raise InvalidArgumentError(f"glue task must be sst2, rte, mrpc or qnli, got {self.glue_task!r}")
        return self


@dataclass
class Row:
    """One figure of a seed table beside ours.

    Attributes:
        table: ``seed 004 §4``, ``seed 000 §2.2`` or ``seed 004 scenarios``.
        row / metric: the seed's row and column.
        seed: the seed's figure; ``baseline``: the seed's *before* figure where the row is a before/after pair.
        ours / ours_baseline: our figures (``None``: not comparable; ``note`` says why).
        config: the configurations compared; ``definition``: what our figure is.
        compute: the compute the row saved (layers per token, attention density, pages), beside the wall clock.
    """

    table: str
    row: str
    metric: str
    seed: float
    ours: float | None
    definition: str
    config: str
    baseline: float | None = None
    ours_baseline: float | None = None
    compute: dict = field(default_factory=dict)
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


class _Runs:
    """Shared measurements of one report run (each computed once)."""

    def __init__(self, lm, cfg: SeedsConfig):
        self.lm, self.cfg, self.engine = lm, cfg, lm.engine
        self.L = self.engine.num_layers
        self.long_n = min(cfg.long_tokens, self.engine.max_seq_len - 1)  # the long-text evaluation's own cap
        self._memo = {}
        self.adaptive = f"adaptive:laser={cfg.laser}" if cfg.laser else None
        self.routed, self.router_note = None, NO_ROUTER
        if cfg.laser:
            from ..depth.laser_file import load_laser_file  # noqa: PLC0415

            art = load_laser_file(cfg.laser, lm)
            if art.router is not None:
                self.routed = f"routed:laser={cfg.laser}"
            self.router_note = art.router_note or NO_ROUTER

    def once(self, key, fn):
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def bar(self, it, desc, total=None):
        from tqdm.auto import tqdm  # noqa: PLC0415

        return tqdm(it, desc=desc, total=total, disable=not self.cfg.progress, leave=False, dynamic_ncols=True)

    # -- GLUE ----------------------------------------------------------------------------------------
    def glue(self) -> dict:
        from ..evaluation.tasks import EvalSettings, Evaluator  # noqa: PLC0415

        specs = [s for s in ("full@" + self.cfg.attention, self.adaptive, self.routed,
                             self.adaptive and f"{self.adaptive}@{self.cfg.attention}") if s]
        saved = self.engine.kernel
        try:  # each configuration installs its attention kernel; put the engine's back after
            ev = Evaluator(self.lm, specs, EvalSettings(data=self.cfg.data, limit=self.cfg.glue_limit,
                                                        progress=self.cfg.progress))
            return ev.run(self.cfg.glue_task)
        finally:
            self.engine.kernel = saved

    # -- decode ----------------------------------------------------------------------------------------
    def decode(self, specs, texts=None, chat: bool = True) -> dict:
        """Per spec: median ms per generated token (after the first) over ``texts`` (default: the bundled chat
        prompts, in the chat template), configurations interleaved per prompt; every response's latency (ms); the
        mean decoder layers per generated token."""
        from ..evaluation.tasks import load_prompts  # noqa: PLC0415
        from ..runtime.loop import generate_tokens  # noqa: PLC0415
        from ..runtime.sampling import SamplingParams  # noqa: PLC0415

        texts = load_prompts()[:self.cfg.decode_prompts] if texts is None else texts
        prompts = [self._chat_ids(p) if chat else torch.tensor(self.lm.tokenizer(p)["input_ids"]) for p in texts]
        modes = {s: self.lm.mode(s) for s in specs}
        params = SamplingParams(max_new_tokens=self.cfg.decode_tokens, temperature=0.0, ignore_eos=True)
        ms = {s: [] for s in specs}
        response = {s: [] for s in specs}
        layers = {s: [] for s in specs}
        for ids in self.bar(prompts, "decode"):
            for s, mode in modes.items():
                t0 = time.perf_counter()
                t_first = None
                for ev in generate_tokens(self.engine, mode, ids, params, self.cfg.decode_tokens):
                    if t_first is None:
                        t_first = time.perf_counter()
                    else:
                        layers[s].append(ev.layers)
                t_end = time.perf_counter()
                ms[s].append(1e3 * (t_end - t_first) / (self.cfg.decode_tokens - 1))
                response[s].append(1e3 * (t_end - t0))
        context = statistics.fmean(len(p) for p in prompts) + self.cfg.decode_tokens / 2  # mean cached positions
        return {s: {"ms_per_token": statistics.median(ms[s]), "response_ms": sorted(response[s]), "context": context,
                    "mean_layers": statistics.fmean(layers[s]) if layers[s] else float(self.L)} for s in specs}

    def dialogue(self, specs) -> dict | None:
        """Per spec: every chat answer's response latency over HTTP (ms, sorted): the bundled chat prompts sent one at
        a time (a dialogue: one user waiting for each answer) as non-streaming ``/v1/chat/completions`` requests of
        ``decode_tokens`` greedy tokens (EOS ignored) to the app of ``laserlm serve``, served by uvicorn on
        127.0.0.1 in a thread of this process and sharing the loaded model; the request's ``mode`` names the spec.
        Configurations are interleaved per prompt. ``None`` when the ``serve`` extra (FastAPI, uvicorn) is not
        installed.

        Raises:
            InvalidArgumentError: the server did not start, or answered a request with an error.
        """
        import json as _json  # noqa: PLC0415
        import threading  # noqa: PLC0415
        import urllib.error  # noqa: PLC0415
        import urllib.request  # noqa: PLC0415

        try:
            import uvicorn  # noqa: PLC0415

            from ..serve.app import ServerSettings, build_app  # noqa: PLC0415
        except ImportError:
            return None
        from ..evaluation.tasks import load_prompts  # noqa: PLC0415

        settings = ServerSettings(model="report-seeds", mode=specs[0], allowed_modes=list(specs[1:]),
                                  kv_budget=self.cfg.kv_budget, max_batch=self.cfg.max_batch)
        app = build_app(settings, lm=self.lm)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            t0 = time.monotonic()
            while not server.started:
                if not thread.is_alive() or time.monotonic() - t0 > 60:
                    raise InvalidArgumentError("the dialogue rows' server on 127.0.0.1 did not start")
                time.sleep(0.02)
            port = server.servers[0].sockets[0].getsockname()[1]
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            response = {s: [] for s in specs}
            for text in self.bar(load_prompts()[:self.cfg.decode_prompts], "dialogue over HTTP"):
                for spec in specs:
                    body = {"model": settings.name, "messages": [{"role": "user", "content": text}],
                            "max_tokens": self.cfg.decode_tokens, "temperature": 0, "ignore_eos": True, "mode": spec}
                    req = urllib.request.Request(url, _json.dumps(body).encode(), {"Content-Type": "application/json"})
                    t = time.perf_counter()
                    try:
                        with urllib.request.urlopen(req, timeout=600) as r:
                            out = _json.loads(r.read())
                    except urllib.error.HTTPError as e:
                        raise InvalidArgumentError(f"the server answered {e.code}: {e.read()[:500]!r}") from e
                    response[spec].append(1e3 * (time.perf_counter() - t))
                    if out["usage"]["completion_tokens"] != self.cfg.decode_tokens:
                        raise InvalidArgumentError(f"the server generated {out['usage']['completion_tokens']} tokens, "
                                                   f"not {self.cfg.decode_tokens}")
            return {s: sorted(v) for s, v in response.items()}
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            app.state.laserlm.close()

    def _chat_ids(self, text: str) -> torch.Tensor:
        from ..runtime.generate import encode_prompt  # noqa: PLC0415

        chat = bool(getattr(self.lm.tokenizer, "chat_template", None))
        return encode_prompt(self.lm.tokenizer, text, chat, self.engine.max_seq_len)

    # -- long text -------------------------------------------------------------------------------------
    def longtext(self) -> dict:
        from ..evaluation.tasks import EvalSettings, Evaluator  # noqa: PLC0415

        specs = [s for s in (self.adaptive, "full@" + self.cfg.attention) if s]
        saved = self.engine.kernel
        try:
            ev = Evaluator(self.lm, specs, EvalSettings(data=self.cfg.data, long_tokens=self.cfg.long_tokens,
                                                        progress=self.cfg.progress))
            return ev.run("longtext")
        finally:
            self.engine.kernel = saved

    def prefill_ms(self, spec: str, n: int) -> float:
        """Median of 3 prefill times of ``n`` tokens of the long document under the configuration ``spec``
        (``MODE[@ATTENTION]``), in ms."""
        from ..evaluation.data import load_task  # noqa: PLC0415

        ids = torch.tensor(self.lm.tokenizer(load_task("longtext", self.cfg.data))["input_ids"][:n])
        from ..runtime.loop import generate_tokens  # noqa: PLC0415
        from ..runtime.sampling import SamplingParams  # noqa: PLC0415

        from ..mode_table import config_kernel, split_config  # noqa: PLC0415

        mode = self.lm.mode(split_config(spec)[0])
        saved, self.engine.kernel = self.engine.kernel, config_kernel(self.engine, spec)
        out = []
        try:
            for _ in range(3):
                t0 = time.perf_counter()
                for _ev in generate_tokens(self.engine, mode, ids, SamplingParams(max_new_tokens=1), 1):
                    break
                out.append(1e3 * (time.perf_counter() - t0))
        finally:
            self.engine.kernel = saved
        return statistics.median(out)

    # -- batch -----------------------------------------------------------------------------------------
    def batch(self, spec: str, prealloc: str, one_at_a_time: bool = False) -> dict:
        """The document workload through the scheduler: wall time, docs/min, P50/P99 step time, the largest KV
        bytes held (the pool's arena, or the running requests' own caches under per-request allocation)."""
        from ..evaluation.data import load_task  # noqa: PLC0415
        from ..runtime.sampling import SamplingParams  # noqa: PLC0415
        from ..runtime.scheduler import BatchConfig, Scheduler  # noqa: PLC0415

        docs = []
        for line in load_task("wikitext", self.cfg.data).splitlines():
            line = line.strip()
            if line and not line.startswith("="):
                ids = self.lm.tokenizer(line)["input_ids"]
                if len(ids) >= self.cfg.doc_tokens:
                    docs.append(torch.tensor(ids[:self.cfg.doc_tokens]))
            if len(docs) == self.cfg.docs:
                break
        if len(docs) < self.cfg.docs:
            raise InvalidArgumentError(f"the batch rows need {self.cfg.docs} WikiText-2 paragraphs of "
                                       f"{self.cfg.doc_tokens} tokens; the text has {len(docs)}")
        sched = Scheduler(self.engine, BatchConfig(kv_budget=self.cfg.kv_budget, max_batch=self.cfg.max_batch,
                                                   kv_prealloc=prealloc, prefix_cache=False))
        params = SamplingParams(max_new_tokens=self.cfg.doc_new_tokens, temperature=0.0, ignore_eos=True)
        mode = self.lm.mode(spec)
        steps, peak = [], 0
        t0 = time.perf_counter()
        for group in ([[d] for d in docs] if one_at_a_time else [docs]):
            for d in group:
                sched.submit(d, params, mode=mode)
            while sched.has_unfinished:
                s = time.perf_counter()
                sched.step()
                steps.append(time.perf_counter() - s)
                peak = max(peak, sched.kv_bytes)
        wall = time.perf_counter() - t0
        steps.sort()
        return {"wall_s": wall, "docs_per_min": 60 * len(docs) / wall, "step_p50_ms": 1e3 * steps[len(steps) // 2],
                "step_p99_ms": 1e3 * steps[min(len(steps) - 1, int(0.99 * len(steps)))], "kv_bytes": peak,
                "budget_bytes": sched.pool.num_pages * sched.pool.page_bytes}


def run_seeds(lm, cfg: SeedsConfig) -> list[Row]:
    """Every row of both seed tables and the scenarios, measured on ``lm`` (a :class:`laserlm.LaserLM`).

    Raises:
        InvalidArgumentError: bad settings; DataFileError: a data file (GLUE, the long novel, WikiText-2) is missing.
    """
    cfg.validate()
    r = _Runs(lm, cfg)
    rows: list[Row] = []
    rows += _table_004(r)
    rows += _table_000(r)
    rows += _scenarios(r)
    return rows


NO_LASER = "no laser file given (--laser, from `laserlm calibrate`)"
NO_ROUTER = "the laser file has no router (calibrate with --router-prompts > 0)"


def _table_004(r: _Runs) -> list[Row]:
    cfg, L, T = r.cfg, r.L, "seed 004 §4"
    glue = r.once("glue", r.glue)
    task = f"GLUE {cfg.glue_task} dev ({glue['full']['n']} of {glue['full']['of']} items, zero-shot)"
    full = glue["full"]
    sparse_spec = "full@" + cfg.attention
    pool_full = r.once("batch_full", lambda: r.batch("full", "full"))
    pool_staged = r.once("batch_staged", lambda: r.batch("full", "staged"))
    pool_request = r.once("batch_request", lambda: r.batch("full", "request"))
    rows = []

    def glue_rows(name, spec, kv_saved, kv_def, note=""):
        seed = SEED_004[name.split(" (")[0]]
        if spec is None or spec not in glue:
            why = note or NO_LASER
            return [Row(T, name, m, v, None, "", spec or "-", note=why)
                    for m, v in zip(("speed (x)", "memory saved", "accuracy change"), seed)]
        g = glue[spec]
        comp = {"layers_per_scored_token": round(g["mean_layers"], 3), "of_layers": L,
                "answers_changed": round(1 - g["choice_agreement"], 4)}
        return [
            Row(T, name, "speed (x)", seed[0], _ratio(full["seconds"], g["seconds"]),
                f"scoring time of {task}, full over this configuration", f"full vs {spec}", compute=comp, note=note),
            Row(T, name, "memory saved", seed[1], kv_saved, kv_def, f"full vs {spec}", compute=comp, note=note),
            Row(T, name, "accuracy change", seed[2], g["acc"] - full["acc"], f"accuracy on {task} minus full depth's "
                f"({full['acc']:.3f})", f"full vs {spec}", compute=comp, note=note),
        ]

    keeps_all = "K/V bytes per token kept, against full depth (the propagate bridge writes every layer's K/V)"
    rows += glue_rows("dynamic compute path (exit gates)", r.adaptive, 0.0 if r.adaptive else None, keeps_all)
    routed_layers = glue.get(r.routed, {}).get("mean_layers") if r.routed else None
    rows += glue_rows("dynamic compute path (router)", r.routed,
                      None if routed_layers is None else 1 - routed_layers / L,
                      "K/V bytes written per token, against full depth (a route's dropped layers write none; the "
                      "KV cache still allocates every layer's slots)",
                      "routed scores one sequence at a time, full depth in batches: the speed ratio includes the "
                      "scorer's batching" if r.routed else (r.router_note if r.adaptive else NO_LASER))
    rows += glue_rows("sparse attention", sparse_spec, 0.0,
                      "K/V bytes kept, against full depth (block-sparse attention reads fewer blocks, stores all)",
                      "GLUE prompts are short: the attention is dense below the sparse kernel's block count; the long-"
                      "prompt row below measures it where it applies")
    long_n = r.long_n
    pf, ps = r.once("prefill_full", lambda: r.prefill_ms("full", long_n)), \
        r.once("prefill_sparse", lambda: r.prefill_ms(sparse_spec, long_n))
    lt = r.once("longtext", r.longtext)
    rows.append(Row(T, "sparse attention (long prompt)", "speed (x)", SEED_004["sparse attention"][0],
                    _ratio(pf, ps), f"prefill time of {long_n} tokens of the long novel, full over sparse",
                    f"full vs {sparse_spec}", compute={"prefill_ms_full": round(pf, 1), "prefill_ms_sparse": round(ps, 1)}))
    rows.append(Row(T, "sparse attention (long prompt)", "accuracy change", SEED_004["sparse attention"][2],
                    lt[sparse_spec]["agreement"] - 1.0, f"top-1 agreement with full depth over {long_n} tokens of "
                    "the long novel, minus 1", f"full vs {sparse_spec}",
                    compute={"nll_gap_nats": round(lt[sparse_spec]["nll_gap"], 4)}))
    seed = SEED_004["memory-pool pre-allocation"]
    pool_def = (f"{cfg.docs} WikiText-2 documents ({cfg.doc_tokens} prompt + {cfg.doc_new_tokens} new tokens), "
                f"{cfg.max_batch} running, {cfg.kv_budget} budget: the pool pre-allocated in steps against per-request "
                "allocation")
    cfg_name = "kv_prealloc request vs staged"
    pages = {"kv_mib_request": round(pool_request["kv_bytes"] / 2**20, 3),
             "kv_mib_staged": round(pool_staged["kv_bytes"] / 2**20, 3),
             "kv_mib_full": round(pool_full["kv_bytes"] / 2**20, 3),
             "wall_s_request": round(pool_request["wall_s"], 2), "wall_s_staged": round(pool_staged["wall_s"], 2),
             "wall_s_full": round(pool_full["wall_s"], 2)}
    saved = 1 - pool_staged["kv_bytes"] / pool_request["kv_bytes"]
    rows += [
        Row(T, "memory-pool pre-allocation", "speed (x)", seed[0],
            _ratio(pool_request["wall_s"], pool_staged["wall_s"]), "wall time of " + pool_def, cfg_name,
            compute=pages),
        Row(T, "memory-pool pre-allocation", "memory saved", seed[1], saved,
            "largest KV bytes held (arena, or the requests' own caches) of " + pool_def, cfg_name, compute=pages,
            note="" if saved >= 0 else "a pool holds whole pages and grows by doubling; per-request caches hold "
            "exactly prompt + max_tokens positions, so the pool cannot hold less"),
        Row(T, "memory-pool pre-allocation", "accuracy change", seed[2], 0.0,
            "the pool changes no arithmetic: identical tokens (tests/test_scheduler.py)", cfg_name),
    ]
    comb = f"{r.adaptive}@{cfg.attention}" if r.adaptive else None
    comb_rows = glue_rows("all combined", comb, None, "")
    if comb and comb in glue:
        comb_rows[1].ours = saved
        comb_rows[1].definition = ("largest KV bytes of the batch workload (full depth) on the staged pool against "
                                   "per-request allocation: the exits keep all K/V, so the pool's saving is the "
                                   "combination's")
        comb_rows[1].config = cfg_name
        comb_rows[1].compute = pages
    rows += comb_rows
    return rows


def _decay_past(bins: list, start: int = 2048) -> float | None:
    """Fall of agreement per 1k tokens over the bins at or past ``start`` (None: fewer than 2 such bins)."""
    from ..evaluation.longtext import slope_per_1k  # noqa: PLC0415

    late = [b for b in bins if b["start"] >= start]
    if len(late) < 2:
        return None
    return -slope_per_1k(torch.tensor([b["agreement"] for b in late]), torch.tensor([b["start"] for b in late]))


def _table_000(r: _Runs) -> list[Row]:
    from ..bench.utilization import bytes_per_token, read_bandwidth  # noqa: PLC0415

    cfg, L, T, ad = r.cfg, r.L, "seed 000 §2.2", r.adaptive
    specs = ["full"] + ([ad] if ad else [])
    dec = r.once("decode", lambda: r.decode(specs))
    lt = r.once("longtext", r.longtext)
    rows = []
    s = SEED_000["latency per token (ms)"]
    f = dec["full"]
    a = dec.get(ad) if ad else None
    comp = {"layers_per_token_full": L, "layers_per_token_laser": round(a["mean_layers"], 3) if a else None}
    cfgs = f"full vs {ad}" if ad else "full"
    rows.append(Row(T, "latency per token (ms)", "Laser", s[1], a["ms_per_token"] if a else None,
                    f"median decode ms per token, {cfg.decode_prompts} chat prompts x {cfg.decode_tokens} tokens",
                    cfgs, baseline=s[0], ours_baseline=f["ms_per_token"], compute=comp, note="" if a else NO_LASER))
    ctx = r.long_n
    weights = bytes_per_token(r.engine, L, 0)["weights"]
    kv_full = bytes_per_token(r.engine, L, ctx)["kv"]
    import resource  # noqa: PLC0415

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB
    s = SEED_000["peak memory (GB)"]
    rows.append(Row(T, "peak memory (GB)", "Laser", s[1], (weights + kv_full) / 1e9 if ad else None,
                    f"weight bytes + KV cache at {ctx} positions (the propagate bridge keeps every layer's K/V, so "
                    "Laser equals full)", cfgs, baseline=s[0], ours_baseline=(weights + kv_full) / 1e9,
                    compute={"process_peak_rss_gib": round(rss, 3)}, note="" if ad else NO_LASER))
    s = SEED_000["long-text consistency"]
    la = lt.get(ad) if ad else None
    rows.append(Row(T, "long-text consistency", "Laser", s[1], la["consistency"] if la else None,
                    f"top-1 agreement with full depth past position 2,048 of the long novel ({ctx} tokens); full "
                    "scores 1.0 against itself, the seed's traditional 0.82 is its own score", cfgs, baseline=s[0],
                    ours_baseline=1.0 if la and la["consistency"] is not None else None,
                    compute={"layers_per_token": round(la["mean_layers"], 3) if la else None},
                    note=NO_LASER if not la else ("" if la["consistency"] is not None else
                                                  "the document has no position past 2,048 (--long-tokens, "
                                                  "--ctx-size)")))
    bw = r.once("bandwidth", lambda: read_bandwidth(cfg.bandwidth_mib))
    def util(d):
        return bytes_per_token(r.engine, d["mean_layers"], d["context"])["total"] * 1e3 / d["ms_per_token"] / bw

    s = SEED_000["hardware utilization"]
    rows.append(Row(T, "hardware utilization", "Laser", s[1], util(a) if a else None,
                    "bytes a decode step reads x tokens/s over the measured read bandwidth "
                    f"({bw / 1e9:.1f} GB/s)", cfgs, baseline=s[0], ours_baseline=util(f), note="" if a else NO_LASER))
    s = SEED_000["feature decay per 1k tokens past 2,048"]
    d = _decay_past(la["bins"]) if la else None
    rows.append(Row(T, "feature decay per 1k tokens past 2,048", "Laser", s[1], d,
                    "fall of top-1 agreement with full depth per 1,000 tokens past 2,048 (the seed measures "
                    "inter-layer feature decay); full depth: 0 by definition", cfgs, baseline=s[0],
                    ours_baseline=0.0 if d is not None else None,
                    note="" if d is not None else (NO_LASER if not la else
                                                   "the document needs two 512-token bins past 2,048: more than "
                                                   "2,560 tokens (--long-tokens, --ctx-size)")))
    return rows


def _scenarios(r: _Runs) -> list[Row]:
    cfg, L, T, ad = r.cfg, r.L, "seed 004 scenarios", r.adaptive
    specs = ["full"] + ([ad] if ad else [])
    dec = r.once("decode", lambda: r.decode(specs))
    rows = []
    s = SEED_SCENARIOS["dialogue response latency (ms)"]

    def p(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    http = r.once("dialogue", lambda: r.dialogue(specs))
    src = http if http is not None else {x: dec[x]["response_ms"] for x in specs}
    where = "over HTTP (laserlm serve's app, one request at a time)" if http is not None else "in process"
    f, a = src["full"], (src[ad] if ad else None)
    compute = {"p50_ms_full": round(statistics.median(f), 1), "p99_ms_full": round(p(f, 0.99), 1),
               "p99_ms_laser": round(p(a, 0.99), 1) if a else None,
               "in_process_p50_ms_full": round(statistics.median(dec["full"]["response_ms"]), 1),
               "in_process_p50_ms_laser": round(statistics.median(dec[ad]["response_ms"]), 1) if ad else None}
    notes = ([] if a else [NO_LASER]) + ([] if http is not None else
                                         ["the serve extra (FastAPI, uvicorn) is not installed: measured in process"])
    rows.append(Row(T, "dialogue response latency (ms)", "after", s[1], statistics.median(a) if a else None,
                    f"median time to a whole {cfg.decode_tokens}-token answer to a chat prompt, {where}",
                    f"full vs {ad}" if ad else "full", baseline=s[0], ours_baseline=statistics.median(f),
                    compute=compute, note="; ".join(notes)))
    one = r.once("batch_one", lambda: r.batch("full", "full", one_at_a_time=True))
    many = r.once("batch_full", lambda: r.batch("full", "full"))
    s = SEED_SCENARIOS["batch documents (docs/min)"]
    rows.append(Row(T, "batch documents (docs/min)", "after", s[1], many["docs_per_min"],
                    f"{cfg.docs} documents ({cfg.doc_tokens} + {cfg.doc_new_tokens} tokens) with continuous batching "
                    f"({cfg.max_batch} running) against one at a time", "scheduler, full depth", baseline=s[0],
                    ours_baseline=one["docs_per_min"]))
    staged = r.once("batch_staged", lambda: r.batch("full", "staged"))
    own = r.once("batch_request", lambda: r.batch("full", "request"))
    s = SEED_SCENARIOS["P99 latency, memory strategies (ms)"]
    rows.append(Row(T, "P99 latency, memory strategies (ms)", "after", s[1], staged["step_p99_ms"],
                    "P99 scheduler step time of the batch workload on the pool pre-allocated in steps, against "
                    "per-request allocation", "kv_prealloc request vs staged", baseline=s[0],
                    ours_baseline=own["step_p99_ms"],
                    compute={"p50_ms_request": round(own["step_p50_ms"], 1), "p50_ms_staged": round(staged["step_p50_ms"], 1),
                             "p99_ms_full": round(many["step_p99_ms"], 1)}))
    s = SEED_SCENARIOS["simple code completions: compute"]
    code_specs = [x for x in (ad, r.routed) if x]
    code = r.once("code", lambda: r.decode(["full"] + code_specs, list(CODE_PROMPTS), chat=False)) \
        if code_specs else {}
    best = min((code[x]["mean_layers"] for x in code_specs), default=None)
    rows.append(Row(T, "simple code completions: compute", "after", s[1], None if best is None else best / L,
                    f"decoder layers per generated token over full depth's {L} (the lower of the configurations), "
                    f"{len(CODE_PROMPTS)} syntax-completion prompts (CODE_PROMPTS)", " / ".join(["full"] + code_specs), baseline=s[0], ours_baseline=1.0,
                    compute={x: round(code[x]["mean_layers"], 3) for x in code_specs}, note="" if code_specs else NO_LASER))
    return rows


def format_markdown(rows: list[Row], header: str = "") -> str:
    """The rows as Markdown tables, one per seed table: the seed's figure beside ours, with definitions."""
    out = [header] if header else []
    for table in dict.fromkeys(r.table for r in rows):
        out.append(f"\n### {table}\n")
        out.append("| row | metric | seed | ours | seed before | ours before | compute | definition / note |")
        out.append("|---|---|---:|---:|---:|---:|---|---|")
        for r in (x for x in rows if x.table == table):
            def fmt(v):
                return "—" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))
            comp = ", ".join(f"{k} {v}" for k, v in r.compute.items() if v is not None)
            text = r.definition + (f" **{r.note}**" if r.note else "")
            out.append(f"| {r.row} | {r.metric} | {fmt(r.seed)} | {fmt(r.ours)} | {fmt(r.baseline)} | "
                       f"{fmt(r.ours_baseline)} | {comp} | {text} |")
    return "\n".join(out) + "\n"
