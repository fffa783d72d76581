"""The Python API: ``laserlm.load(name)`` returns a :class:`LaserLM` with ``generate`` and ``stream``.

Example::

    import laserlm
    lm = laserlm.load("smollm2-135m")
    print(lm.generate("The capital of France is", max_new_tokens=20).text)
    for piece in lm.stream("Tell me a joke", chat=True, temperature=0.7, seed=0):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from .errors import InvalidArgumentError
from .models.loader import LoadedModel, load_model
from .mode_table import make_mode, split_config
from .runtime.engine import Engine
from .runtime.generate import Generation, GenerationResult, IncrementalDecoder, encode_prompt, eos_token_ids
from .runtime.loop import generate_tokens, summarize
from .runtime.options import is_int
from .runtime.ort_engine import is_export_dir
from .runtime.sampling import SamplingParams
from .runtime.scheduler import BatchConfig, Scheduler


class LaserLM:
    """A loaded model with its engine.

    Attributes:
        loaded: the :class:`~laserlm.models.loader.LoadedModel` (transformers model + tokenizer); ``None`` on
            another engine (:meth:`on_engine`).
        engine: the :class:`~laserlm.runtime.engine.Engine` (layer loop + KV cache), or the onnxruntime engine of
            an export directory (:class:`~laserlm.runtime.ort_engine.OnnxEngine`, :func:`load` of such a directory).
    """

    def __init__(self, loaded: LoadedModel, max_seq_len: int | None = None, attention=None,
                 **attention_options):
        self.loaded = loaded
        self.engine = Engine(loaded, max_seq_len=max_seq_len)
        self.tokenizer = loaded.tokenizer
        self.eos_ids = eos_token_ids(loaded.model, loaded.tokenizer)
        self._modes: dict[str, object] = {}  # spec -> built mode (laser files read, auto-tuning run once)
        if attention is not None or attention_options:
            self.set_attention(attention or "sparse", **attention_options)

    @classmethod
    def on_engine(cls, engine, tokenizer, eos_ids) -> LaserLM:
        """A :class:`LaserLM` over an engine that is not built from a loaded model (the onnxruntime engine of an
        export): the same modes, generation, streaming and scoring; no continuous batching (:meth:`scheduler`)."""
        lm = cls.__new__(cls)
        lm.loaded, lm.engine, lm.tokenizer, lm.eos_ids = None, engine, tokenizer, set(eos_ids)
        lm._modes = {}
        return lm

    def set_attention(self, attention="dense", **options):
        """Choose the attention kernel: ``"dense"`` (SDPA) or ``"sparse[:key=value,...]"`` (block-sparse,
        see :func:`laserlm.attention.parse_attention`; ``options`` such as ``threshold``, ``block_size``,
        ``dense_layers`` override the spec). Works with every decoding mode. Returns the kernel or ``None``.

        Raises:
            InvalidArgumentError: unknown attention or bad sparse settings.
        """
        if self.loaded is None:
            if attention != "dense" or options:
                raise InvalidArgumentError(f"{self.engine.describe()} has dense attention only")
            return None
        from .attention import configure  # noqa: PLC0415

        return configure(self.engine, attention, **options)

    @property
    def model(self):
        return None if self.loaded is None else self.loaded.model

    @property
    def weights(self) -> str:
        """The weight format in use (``fp32``, ``bf16``, ``int8``, ``int4`` or ``native``)."""
        return self.engine.weights

    @property
    def prefill_dtype(self) -> str | None:
        """Name of the arithmetic in which the quantized weights multiply prompt chunks (``"int16"``: the block
        kernels, ``"float32"`` or ``"bfloat16"``: a GEMM); ``None`` for float weights, which multiply in their own
        dtype."""
        if self.loaded is None or self.loaded.pack_report is None:
            return None
        return str(self.loaded.prefill_dtype).replace("torch.", "")

    def describe(self) -> str:
        """One line: weight format (with the block formats of packed weights) and activation dtype."""
        if self.loaded is None:
            return self.engine.describe()
        dtype = str(self.engine.dtype).replace("torch.", "")
        rep = self.loaded.pack_report
        if rep is None:
            return f"weights {self.weights}, activations {dtype}"
        fmts = ", ".join(f"{k} x{v}" for k, v in sorted(rep.formats.items()))
        return (f"weights {self.weights} ({fmts}; {rep.nbytes / 2**20:.1f} MiB), activations {dtype}, prefill "
                f"matmuls {self.prefill_dtype}")

    def resolve_spec(self, config: str, progress: bool = True) -> str:
        """The spec that runs for ``config`` (``MODE_SPEC[@ATTENTION]``): unchanged, except that a spec naming no
        exit rule (bare ``adaptive``) or no draft settings (bare ``speculative``) becomes the calibrated default
        of a bundled model, read from the cache or built once there by the installed builder (see
        :mod:`laserlm.defaults` for the exact rule; the ``laserlm`` command installs the builder).

        Raises:
            InvalidArgumentError: a bare ``adaptive`` / ``speculative`` on a model that is not bundled (the message
                says how to calibrate and which explicit thresholds to pass); a bare ``adaptive`` whose artifact is
                not built yet while no builder is installed (the message says how to build it).
            DataFileError: a first build finds no calibration text.
        """
        from .defaults import needs_default, resolve_spec  # noqa: PLC0415

        if self.loaded is None:  # an export: a bare adaptive is its own laser file
            manifest = self.engine.onnx.manifest
            if (isinstance(config, str) and not manifest.get("laser")
                    and needs_default(split_config(config)[0]) == "adaptive"):
                raise InvalidArgumentError(
                    f"bare '{config}' runs the export's certified laser file, and {self.engine.onnx.path} was exported "
                    "without one: export with `laserlm export onnx --laser FILE`, or name an exit rule to run "
                    "untrained exits (e.g. adaptive:threshold=0.99)")
            return config

        return resolve_spec(self, config, progress=progress)

    def mode(self, spec="full"):
        """The decoding mode of a spec string such as ``"full"`` (see :mod:`laserlm.runtime.modes`), or a mode
        object unchanged. The spec goes through :meth:`resolve_spec` first (bare ``adaptive`` / ``speculative``
        take the calibrated default on bundled models and are refused on others). Modes are stateless, so each
        spec is built once per :class:`LaserLM` and reused: a laser file is read and checked once,
        ``speculative:auto=1`` searches once.

        Raises:
            InvalidArgumentError: unknown mode, bad options, or a bare ``adaptive`` / ``speculative`` on a model
                that is not bundled.
        """
        if not isinstance(spec, str):
            return spec
        key = spec.strip()
        if key not in self._modes:
            self._modes[key] = make_mode(self.resolve_spec(key), self.engine)
        return self._modes[key]

    def _token_source(self, mode) -> Callable:
        m = self.mode(mode)
        return lambda ids, params, n: generate_tokens(self.engine, m, ids, params, n)

    def stream(self, prompt, *, chat: bool = False, mode: str = "full", on_token: Callable | None = None,
               **sampling) -> Generation:
        """Start generating; iterate the returned :class:`Generation` for text pieces, then read ``.result``.

        Args:
            prompt: text, or a list of chat messages.
            chat: apply the model's chat template.
            mode: decoding mode spec (``"full"``, ``"adaptive:..."``, ``"speculative:..."``) or a mode object.
            **sampling: fields of :class:`~laserlm.runtime.sampling.SamplingParams`
                (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``ignore_eos``).

        A string prompt is encoded with the tokenizer's special tokens, but a BOS the text already starts
        with (a rendered chat prompt) is not added a second time.

        Raises:
            InvalidArgumentError: bad sampling values or empty prompt.
            ContextLengthError: prompt longer than the context.
            NonFiniteLogitsError: while iterating, when the model's logits contain NaN or +inf.
        """
        params = SamplingParams(**sampling).validate()
        source = self._token_source(mode)
        ids = encode_prompt(self.tokenizer, prompt, chat, self.engine.max_seq_len)
        return Generation(self.tokenizer, ids, source, params, self.eos_ids,
                          self.engine.max_seq_len, on_token=on_token)

    def generate(self, prompt, *, chat: bool = False, mode: str = "full", **sampling) -> GenerationResult:
        """Generate to completion; returns a :class:`~laserlm.runtime.generate.GenerationResult`."""
        return self.stream(prompt, chat=chat, mode=mode, **sampling).run()

    def scheduler(self, kv_budget=None, **batch_options) -> Scheduler:
        """A continuous-batching :class:`~laserlm.runtime.scheduler.Scheduler` on this model's engine, with a
        paged KV pool of ``kv_budget`` (MiB or ``"8192t"`` tokens; default 512 MiB). ``batch_options``: the other
        fields of :class:`~laserlm.runtime.scheduler.BatchConfig` (``max_batch``, ``page_size``, ``eviction`` ...).

        Raises:
            InvalidArgumentError: bad settings.
        """
        if self.loaded is None:
            raise InvalidArgumentError(f"continuous batching needs laserlm's own engine (a paged KV pool); "
                                       f"{self.engine.describe()} runs one request at a time")
        known = [f.name for f in dataclasses.fields(BatchConfig)]
        unknown = sorted(set(batch_options) - set(known))
        if unknown:
            raise InvalidArgumentError(f"unknown batch option(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return Scheduler(self.engine, BatchConfig(kv_budget=kv_budget, **batch_options), self.eos_ids)

    def generate_batch(self, prompts, *, chat: bool = False, mode: str = "full", kv_budget=None,
                       batch_options: dict | None = None, progress: bool = False,
                       **sampling) -> list[GenerationResult]:
        """Generate for every prompt with continuous batching (:mod:`laserlm.runtime.scheduler`); returns one
        :class:`~laserlm.runtime.generate.GenerationResult` per prompt, in order. Each result is what
        :meth:`generate` gives for that prompt alone (same mode, same seed), up to float rounding of batched
        matmuls; ``ttft_s`` includes the time the request waited for a slot.

        Args:
            prompts: texts or chat message lists.
            mode: decoding mode spec for every request.
            kv_budget, batch_options: see :meth:`scheduler`.
            progress: a tqdm bar over finished requests.
            **sampling: fields of :class:`~laserlm.runtime.sampling.SamplingParams`, shared by all requests.

        Raises:
            InvalidArgumentError, ContextLengthError: as :meth:`generate`, before anything runs.
            PoolFullError: a request that could never fit ``kv_budget``.
        """
        if isinstance(prompts, (str, dict)) or not hasattr(prompts, "__iter__"):
            raise InvalidArgumentError("prompts must be a list of texts or chat message lists "
                                       "(use generate() for one prompt)")
        params = SamplingParams(**sampling).validate()
        if self.loaded is None:
            self.scheduler()  # refuses, before anything runs
        m = self.mode(mode)
        ids = [encode_prompt(self.tokenizer, p, chat, self.engine.max_seq_len) for p in prompts]
        options = dict(batch_options or {})
        if kv_budget is not None:
            options["kv_budget"] = kv_budget
        t_setup = time.perf_counter()
        sched = self.scheduler(**options)
        setup_s = time.perf_counter() - t_setup  # the KV arena's allocation (seconds for a large full budget)
        tok = self.tokenizer
        stop_check = None
        if params.stop:
            decoders: dict[str, IncrementalDecoder] = {}
            longest = max(len(s) for s in params.stop)

            def stop_check(req):
                """Whether a stop string appeared in the text the newest tokens added (incremental decode)."""
                dec = decoders.setdefault(req.request_id, IncrementalDecoder(tok))
                before = len(dec.text)
                text = dec.text
                for t in req.output_ids[len(dec.ids):]:
                    text = dec.push(t)
                start = max(0, before - longest)
                return any(text.find(s, start) >= 0 for s in params.stop)
        for i in ids:  # every request must fit before any runs
            sched.check(i, params, m)
        bar = None
        if progress:
            from tqdm import tqdm  # noqa: PLC0415

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        queue = list(range(len(ids)))
        rid_of: dict[int, str] = {}
        t_run = time.perf_counter()
        while queue or sched.has_unfinished:
            while queue and len(sched.waiting) < sched.config.max_queue:
                i = queue.pop(0)
                rid_of[i] = sched.submit(ids[i], params, m, stop_check=stop_check)
            for out in sched.step():
                if out.finished and bar is not None:
                    bar.update(1)
        run_s = time.perf_counter() - t_run
        if bar is not None:
            bar.close()
        rids = [rid_of[i] for i in range(len(ids))]
        results = []
        for i, rid in enumerate(rids):
            seq = sched.get(rid)
            gen = Generation(tok, ids[i], _Replay(seq), params, self.eos_ids, self.engine.max_seq_len)
            result = gen.run()
            result.total_s = seq.t_finish - seq.t_submit  # the request's time in the scheduler, queue included
            results.append(result)
        self.last_batch_summary = sched.summary() | {"setup_s": setup_s, "run_s": run_s}
        return results


class _Replay:
    """A finished scheduler request's events as a token source for :class:`Generation` (text, stop strings,
    finish reason and statistics are computed exactly as for :meth:`LaserLM.generate`)."""

    def __init__(self, seq):
        self.seq = seq

    def __call__(self, prompt_ids, params, max_tokens):
        return self

    def __iter__(self):
        return iter(self.seq.events)

    def summary(self) -> dict:
        return summarize(self.seq.mode, self.seq.request)


def load(name: str = "smollm2-135m", dtype: str | None = None, max_seq_len: int | None = None,
         attention=None, weights: str = "auto", prefill_dtype: str = "auto", lora=None, threads: int | None = None,
         **attention_options) -> LaserLM:
    """Load a model by bundled name, ``.gguf`` file, local directory or cached hub id, or the export directory of
    ``laserlm export onnx`` (:func:`load_onnx`; the other arguments are then fixed by the export and refused).

    ``weights``: ``"auto"`` (default: ``native`` for a GGUF file when ``dtype`` is not given, else dense
    float weights in ``dtype``), ``"fp32"`` (the exact reference, logits equal to transformers'),
    ``"bf16"``, ``"int8"``, ``"int4"`` or ``"native"`` (see :mod:`laserlm.models.quant`). ``dtype``:
    ``"float32"`` (default) or ``"bfloat16"`` activations. ``prefill_dtype``: ``"auto"`` (default: int16 where the
    block kernels are built, else bfloat16 on a CPU with AMX-BF16, else float32), ``"int16"`` (the kernels of a decode
    step: a prompt position is computed exactly as when decoding), ``"float32"`` or ``"bfloat16"`` (a GEMM over the
    dequantized matrix): how quantized weights multiply prompt chunks of more than 16 positions
    (:func:`laserlm.models.quant.resolve_prefill_dtype`).

    ``lora``: a LoRA delta file from ``laserlm train-backbone`` (LoRA factors bound to this base model), merged into the
    weights before packing (:mod:`laserlm.models.delta`); a laser file calibrated on the adapted model needs it.

    ``attention``: ``None``/``"dense"`` or ``"sparse[:key=value,...]"``; ``attention_options`` (e.g.
    ``threshold=0.5, block_size=64, dense_layers=2``) configure block-sparse attention
    (:func:`laserlm.attention.parse_attention`).

    ``dtype``: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"`` (runs under the float16 guard: norms in
    float32, float32 fallback for a layer that would overflow, :mod:`laserlm.runtime.ranges`).

    ``threads``: CPU threads; ``None`` keeps ``torch.get_num_threads()``. laserlm's engine runs on torch's
    process-wide setting (``torch.set_num_threads``, which this sets); an export's onnxruntime sessions take it as
    their intra-op threads.

    Raises:
        ModelNotFoundError, CorruptModelError, UnsupportedArchitectureError,
        InvalidArgumentError (bad dtype, threads or attention options).
    """
    if threads is not None:
        if not is_int(threads) or threads < 1:
            raise InvalidArgumentError(f"threads must be a positive integer, got {threads!r}")
        torch.set_num_threads(threads)
    if is_export_dir(name):
        given = [k for k, v in (("dtype", dtype), ("max_seq_len", max_seq_len), ("attention", attention),
                                ("lora", lora)) if v is not None] + [k for k, v in (("weights", weights),
                                ("prefill_dtype", prefill_dtype)) if v != "auto"] + sorted(attention_options)
        if given:
            raise InvalidArgumentError(f"{name} is an ONNX export: its graphs fix {', '.join(given)} (set them with "
                                       "`laserlm export onnx`)")
        return load_onnx(name, threads=threads)
    loaded = load_model(name, dtype=dtype, weights=weights, prefill_dtype=prefill_dtype, lora=lora)
    return LaserLM(loaded, max_seq_len=max_seq_len, attention=attention, **attention_options)


def load_onnx(path, threads: int | None = None) -> LaserLM:
    """A :class:`LaserLM` on the onnxruntime engine of an export directory of ``laserlm export onnx``
    (:class:`~laserlm.runtime.ort_engine.OnnxEngine`): modes ``full`` and ``adaptive`` (its exported laser file),
    generation, streaming and scoring as on laserlm's engine. ``threads``: onnxruntime intra-op threads (default:
    ``torch.get_num_threads()``, the setting laserlm's engine runs on).

    Raises:
        ModelNotFoundError / CorruptModelError: no valid export at ``path``, or it has no readable tokenizer.
    """
    from .runtime.ort_engine import OnnxEngine, OnnxModel, load_tokenizer  # noqa: PLC0415

    if threads is None:
        threads = torch.get_num_threads()
    model = OnnxModel(path, threads=threads).warm()  # open every session now, not inside the first token's time
    return LaserLM.on_engine(OnnxEngine(model), load_tokenizer(model),
                             model.manifest["model"].get("eos_token_ids", []))
