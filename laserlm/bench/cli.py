"""``laserlm bench``: throughput, latency and memory of decoding modes beside transformers ``generate``
(and llama.cpp when ``llama_cpp`` is importable)."""

from __future__ import annotations

import importlib.util
import json
import sys

from ..cli_common import (
    add_config_args,
    add_model_args,
    apply_threads,
    check_output_path,
    config_specs,
    global_attention_config,
    load_from_args,
)
from ..errors import InvalidArgumentError, LaserLMError

TESTS = ("pp", "tg", "gen")


def add_parser(sub) -> None:
    """Register ``bench``."""
    p = sub.add_parser(
        "bench", help="measure speed: pp/tg tokens/s, TTFT, TPOT, ITL, memory, layers per token",
        description="Benchmark decoding-mode configurations side by side (interleaved repetitions) with the "
                    "transformers `generate` baseline on the same model and dtype, llama-bench style: pp512 "
                    "and tg128 tokens/s as mean ± std over --reps repetitions after --warmup rounds.")
    add_model_args(p)
    for a in p._actions:  # bench measures several weight formats side by side: --weights native,int4,fp32
        if a.dest == "weights":
            a.choices, a.metavar = None, "W[,W...]"
            a.help = ("weight formats to measure side by side, comma-separated, from auto, fp32, bf16, int8, int4, "
                      "native (each loads the model once; the first also drives the transformers baseline); "
                      "default: %(default)s")
    add_config_args(p)
    p.add_argument("--n-prompt", "-p", type=int, default=512, help="pp test prompt tokens (default: %(default)s)")
    p.add_argument("--n-gen", "-n", type=int, default=128, help="tg / generation-run tokens (default: %(default)s)")
    p.add_argument("--reps", "-r", type=int, default=5, help="measured repetitions (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up rounds (default: %(default)s)")
    p.add_argument("--tests", default="pp,tg,gen", help="subset of pp,tg,gen (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random pp prompt (default: %(default)s)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers generate baseline")
    p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"],
                   help="attention implementation of the transformers baseline (default: %(default)s)")
    p.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp even when llama_cpp is importable")
    p.add_argument("--backend", choices=["torch", "onnxruntime"], default="torch",
                   help="torch: laserlm's engine; onnxruntime: --model is a `laserlm export onnx` directory and only "
                        "its graphs are measured (modes full and adaptive; no transformers / llama.cpp baseline) "
                        "(default: %(default)s)")
    p.add_argument("--onnx", action="append", default=[], metavar="DIR",
                   help="also measure this `laserlm export onnx` directory on onnxruntime, next to the engine, for "
                        "each --config it can run (full, adaptive); repeatable")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write results as JSON to PATH ('-' or no value: stdout, table goes to stderr)")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="write a PNG plot")
    p.add_argument("--quality", default=None, metavar="EVAL.json",
                   help="a `laserlm eval --json` file: the plot becomes quality vs speed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


def _gguf_path(model: str):
    from pathlib import Path  # noqa: PLC0415

    from ..models.registry import BUNDLED  # noqa: PLC0415

    if model in BUNDLED:
        try:
            return BUNDLED[model].locate()
        except LaserLMError:
            return None
    return Path(model) if model.endswith(".gguf") and Path(model).is_file() else None


def _validate(args) -> list[str]:
    tests = [t.strip() for t in args.tests.split(",") if t.strip()]
    bad = [t for t in tests if t not in TESTS]
    if bad or not tests:
        raise InvalidArgumentError(f"unknown test(s) {', '.join(bad) or '(none)'}; choose from {', '.join(TESTS)}")
    for name, v, lo in (("--n-prompt", args.n_prompt, 1), ("--n-gen", args.n_gen, 2), ("--reps", args.reps, 1),
                        ("--warmup", args.warmup, 0)):
        if v < lo:
            raise InvalidArgumentError(f"{name} must be >= {lo}, got {v}")
    check_output_path(args.json, "--json")  # output files fail now, not after the measurements
    check_output_path(args.plot, "--plot")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise InvalidArgumentError("--plot needs matplotlib: pip install 'laserlm[bench]'")
    if args.quality:
        try:
            with open(args.quality) as f:
                args.quality_doc = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidArgumentError(f"cannot read --quality file {args.quality}: {exc}") from exc
        from .report import quality_metric  # noqa: PLC0415

        quality_metric(args.quality_doc)
    else:
        args.quality_doc = None
    return tests


def _weight_list(args) -> list[str]:
    from ..models.quant import WEIGHT_FORMATS  # noqa: PLC0415

    ws = [w.strip() for w in (args.weights or "auto").split(",")]
    bad = [w or "(empty)" for w in ws if w not in WEIGHT_FORMATS]
    if bad or not ws or len(set(ws)) != len(ws):
        raise InvalidArgumentError(f"--weights: unknown or repeated format(s) {', '.join(bad) or args.weights!r}; "
                                   f"choose from {', '.join(WEIGHT_FORMATS)}")
    return ws


def cmd_bench(args) -> int:
    tests = _validate(args)
    weights = _weight_list(args)
    specs = global_attention_config(args, config_specs(args))
    from ..defaults import check_before_load  # noqa: PLC0415

    onnx_dirs = list(args.onnx)
    if args.backend == "onnxruntime":
        apply_threads(args)
        onnx_dirs.insert(0, args.model)
        args.no_hf = args.no_llamacpp = True
        lms = []
    else:
        check_before_load(args.model, specs)  # bare adaptive/speculative on a non-bundled model: refuse before loading
        lms, prefill = [], args.prefill_dtype
        for w in weights:  # --prefill-dtype concerns the quantized formats of the list; float ones keep their own
            args.weights, args.prefill_dtype = w, ("auto" if w in ("fp32", "bf16") else prefill)
            lms.append(load_from_args(args))
        args.weights, args.prefill_dtype = ",".join(weights), prefill
        resolved = [one.weights for one in lms]
        if len(set(resolved)) != len(resolved):
            raise InvalidArgumentError(f"--weights {args.weights} resolves to the same format twice "
                                       f"({', '.join(resolved)})")
    import torch  # noqa: PLC0415

    from ..runtime.generate import encode_prompt  # noqa: PLC0415
    from .measure import GEN_PROMPT, EngineTarget, HFTarget, LlamaCppTarget, random_prompt, run_bench, summarize  # noqa: PLC0415
    from .report import markdown, plot  # noqa: PLC0415

    onnx_targets, onnx_notes, onnx_source = _onnx_targets(args, onnx_dirs, specs)
    lm = lms[0] if lms else None
    tokenizer, max_len, vocab = ((lm.tokenizer, lm.engine.max_seq_len, lm.engine.config.vocab_size) if lm else
                                 onnx_source)
    if lm is not None and onnx_source is not None and onnx_source[2] != vocab:
        raise InvalidArgumentError(f"--onnx: the export has a vocabulary of {onnx_source[2]} tokens, {args.model} "
                                   f"{vocab}: not the same model")
    chat = bool(getattr(tokenizer, "chat_template", None))
    gen_ids = encode_prompt(tokenizer, GEN_PROMPT, chat, max_len)
    need = max(args.n_prompt + 1, gen_ids.shape[0] + args.n_gen, args.n_gen + 1)
    max_len = min([max_len] + [t.lm.engine.max_seq_len for t in onnx_targets])
    if need > max_len:
        raise InvalidArgumentError(f"the tests need {need} positions but the context size is {max_len}; "
                                   "lower --n-prompt/--n-gen or raise --ctx-size (or the export's --max-len)")
    prompt_ids = random_prompt(vocab, args.n_prompt, args.seed)
    targets = []
    for spec, one in [(spec, one) for one in lms for spec in specs]:
        t = EngineTarget(one, one.resolve_spec(spec))  # bare adaptive/speculative: the calibrated default
        t.name = f"{spec} [{one.weights}]" if len(lms) > 1 else spec
        try:  # an unrunnable configuration fails here with one line, before any measurement
            t.tg(prompt_ids[:1], 2)
        except LaserLMError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise LaserLMError(f"configuration '{spec}' cannot run on this model: {type(exc).__name__}: {exc}") from exc
        targets.append(t)
    targets += onnx_targets
    notes = onnx_notes
    if args.backend == "onnxruntime":
        notes.append("--backend onnxruntime: no transformers / llama.cpp baseline (run bench on the source model "
                     "with --onnx DIR for them side by side)")
    if not args.no_hf:
        targets.append(HFTarget(lm, args.hf_attn))
    if not args.no_llamacpp:
        gguf = _gguf_path(args.model)
        if importlib.util.find_spec("llama_cpp") is None:
            notes.append("llama.cpp: llama_cpp (llama-cpp-python) not installed, skipped")
        elif gguf is None:
            notes.append("llama.cpp: no GGUF file for this model, skipped")
        else:
            try:
                lc = LlamaCppTarget(gguf, torch.get_num_threads(), max(need + 8, 1024))
                lc.optional = True
                targets.append(lc)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"llama.cpp: could not load {gguf}: {type(exc).__name__}: {exc}")
    from .utilization import bytes_per_token, read_bandwidth, utilization  # noqa: PLC0415

    bandwidth = read_bandwidth()
    samples = run_bench(targets, prompt_ids, gen_ids, args.n_gen, args.reps, args.warmup, tests,
                        progress=not args.no_progress)
    rows = [summarize(name, s, args.n_prompt, args.n_gen) for name, s in samples.items()]
    # bytes per token are counted on laserlm's engine's own modules (an export's graphs are not inspected)
    engines = {t.name: t.lm.engine for t in targets if isinstance(t, EngineTarget) and t.lm.loaded is not None}
    for r in rows:  # tg: n_gen tokens after 1, mean context n_gen / 2
        eng = engines.get(r["config"])
        layers = r["layers_per_token"]
        if eng is None or layers != layers:
            r["bytes_per_token"] = r["utilization"] = float("nan")
            continue
        b = bytes_per_token(eng, layers, args.n_gen / 2)
        r["bytes_per_token"] = b["total"]
        r["utilization"] = utilization(b["total"], r["tg_tokens_per_s"], bandwidth)
    from ..reports import machine, now, write_json  # noqa: PLC0415

    described = [one.describe() for one in lms] + [f"{t.name}: {t.export}" for t in onnx_targets]
    header = (f"model {args.model}, {'; '.join(described)}, {torch.get_num_threads()} threads, reps {args.reps} after "
              f"{args.warmup} warm-up; pp: {args.n_prompt} random tokens; tg: {args.n_gen} tokens after 1; "
              f"read bandwidth {bandwidth / 1e9:.1f} GB/s (torch sum over 512 MiB, best of 5; util = tg bytes/token "
              f"x tok/s / bandwidth); "
              f"generation run: {gen_ids.shape[0]}-token {'chat ' if chat else ''}prompt + {args.n_gen} greedy tokens; "
              f"{machine()}; {now()}")
    out = sys.stderr if args.json == "-" else sys.stdout
    print(markdown(rows, args.n_prompt, args.n_gen), file=out)
    print("\n" + header, file=out)
    for n in notes:
        print(n, file=out)
    if args.plot:
        plot(rows, args.plot, f"{args.model} {args.weights} weights, {torch.get_num_threads()} threads", args.n_prompt,
             args.n_gen, args.quality_doc)
        print(f"plot written to {args.plot}", file=out)
    if args.json:
        doc = {"command": "bench", "model": args.model, "backend": args.backend,
               "weights": [one.weights for one in lms] + [t.weights for t in onnx_targets],
               "onnx": [str(t.export) for t in onnx_targets],
               "dtype": str(lm.engine.dtype).replace("torch.", "") if lm else "float32", "threads": torch.get_num_threads(),
               "n_prompt": args.n_prompt, "n_gen": args.n_gen, "reps": args.reps, "warmup": args.warmup,
               "tests": tests, "read_bandwidth_bytes_per_s": bandwidth, "machine": machine(), "date": now(), "argv": sys.argv[1:], "notes": notes,
               "rows": rows, "raw": {n: vars(s) for n, s in samples.items()}}
        write_json(doc, args.json)
    return 0


def _onnx_targets(args, dirs: list[str], specs: list[str]):
    """``(targets, notes, (tokenizer, max_len, vocab) of the first export or None)``: an
    :class:`~laserlm.bench.measure.EngineTarget` on the onnxruntime engine (:func:`laserlm.api.load_onnx`) per export
    directory and spec that its graphs run (``full``, ``adaptive[...]``); a spec they cannot run is skipped with a
    note, unless none runs.

    Raises:
        InvalidArgumentError: :func:`~laserlm.cli_common.check_onnx_args` (``--backend onnxruntime``), or no spec runs
            on a directory.
        ModelNotFoundError / CorruptModelError: not an export directory, or it has no tokenizer.
    """
    if not dirs:
        return [], [], None
    import torch  # noqa: PLC0415

    from ..api import load_onnx  # noqa: PLC0415
    from ..cli_common import check_onnx_args  # noqa: PLC0415
    from .measure import EngineTarget  # noqa: PLC0415

    if args.backend == "onnxruntime":
        check_onnx_args(args)
    targets, notes, source = [], [], None
    for d in dirs:
        lm = load_onnx(d, threads=torch.get_num_threads())
        if source is None:
            source = (lm.tokenizer, lm.engine.max_seq_len, lm.engine.config.vocab_size)
        weights = f"onnxruntime {lm.weights}"
        errors = []
        for spec in specs:
            try:
                t = EngineTarget(lm, spec)
            except InvalidArgumentError as exc:
                errors.append(f"{spec}: {exc}")
                continue
            t.name = f"{spec} [{weights}]"
            if any(x.name == t.name for x in targets):
                t.name = f"{spec} [{weights}: {d}]"
            t.weights, t.export = weights, d
            targets.append(t)
        if len(errors) == len(specs):
            raise InvalidArgumentError(f"--onnx {d}: no configuration runs on onnxruntime ({'; '.join(errors)})")
        notes += [f"onnxruntime {d}: skipped {e}" for e in errors]
        lm.engine.onnx.warm()
    return targets, notes, source

