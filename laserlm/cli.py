"""The ``laserlm`` command.

``generate``, ``batch`` and ``models`` live here; ``eval`` / ``bench`` / ``calibrate`` in their packages, each adding
itself through ``add_parser(subparsers)`` (called by :func:`build_parser`). Helpers they share (model
arguments, loading, output-path checks) are in :mod:`laserlm.cli_common`. Every user error is a
:class:`~laserlm.errors.LaserLMError`: printed as one ``laserlm: error: ...`` line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .cli_common import add_batch_args, add_mode_args, add_model_args, laser_mode_spec, load_from_args  # noqa: F401 (re-export)
from .errors import InvalidArgumentError, LaserLMError

EXIT_USAGE = 2



def check_chat_template(args) -> None:
    """``generate --chat``: fail before the weights load when the model's tokenizer files (the cached
    converted copy of a GGUF, or a model directory) show it has no chat template (e.g. the gemma3-270m base
    model). Models whose tokenizer files are not on disk yet are checked after loading instead.

    Raises:
        InvalidArgumentError: the model has no chat template.
    """
    if not getattr(args, "chat", False):
        return
    from .models.loader import chat_template_available  # noqa: PLC0415

    if chat_template_available(args.model) is False:
        raise InvalidArgumentError(f"model '{args.model}' has no chat template (a base model?); drop --chat "
                                   "to continue the prompt as plain text")


# -- generate -----------------------------------------------------------------------------------
def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streams to the terminal)",
                       description="Generate a continuation of PROMPT and stream it to stdout.")
    p.add_argument("prompt", nargs="?", help="the prompt; '-' or omitted reads standard input")
    add_model_args(p)
    add_mode_args(p)
    p.add_argument("--laser", default=None, metavar="PATH",
                   help="calibration artifact from `laserlm calibrate`: runs the adaptive mode with its trained exit "
                        "heads, gates and calibrated threshold (adds laser=PATH to an adaptive or speculative --mode)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--monitor-ranges", action="store_true",
                   help="record every decoder layer's max |output| and NaN/inf counts; print the table on stderr (and "
                        "add it to --json)")
    p.add_argument("--backend", choices=["torch", "onnxruntime"], default="torch",
                   help="torch: laserlm's engine; onnxruntime: the graphs of `laserlm export onnx` (--model is then "
                        "the export directory; modes full and adaptive) (default: %(default)s)")
    _add_sampling_args(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with the text and stats instead of streaming")
    p.set_defaults(func=cmd_generate)


def _add_sampling_args(p) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=128, dest="max_new_tokens",
                   help="maximum new tokens (default: %(default)s)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="top-k filter, 0 = off (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus filter in (0, 1] (default: %(default)s)")
    p.add_argument("--seed", "-s", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after end-of-sequence")


def _sampling_from_args(args) -> dict:
    from .runtime.sampling import SamplingParams  # noqa: PLC0415

    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    SamplingParams(**sampling).validate()  # fail before the model loads
    return sampling


# -- batch --------------------------------------------------------------------------------------
def _add_batch(sub) -> None:
    p = sub.add_parser(
        "batch", help="generate for many prompts with continuous batching (offline)",
        description="Generate a continuation for every prompt of INPUT with continuous batching over a paged KV "
                    "pool, and write one JSON line per prompt (in input order). INPUT: a text file with one prompt "
                    "per line, or a .jsonl file of {\"prompt\": TEXT} or {\"messages\": [...]} objects; '-' reads "
                    "standard input.")
    p.add_argument("input", help="prompt file (.txt: one per line; .jsonl: prompt / messages objects) or '-'")
    p.add_argument("--output", "-o", default="-", help="JSON-lines output file ('-': standard output, the default)")
    add_model_args(p)
    add_mode_args(p)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to every prompt")
    _add_sampling_args(p)
    add_batch_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_batch)


def _read_prompts(path: str) -> list:
    if path == "-":
        text = sys.stdin.read()
        name = "standard input"
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise LaserLMError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None
        name = path
    numbered = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]  # file line numbers
    if not numbered:
        raise LaserLMError(f"no prompts in {name}")
    if not path.lower().endswith(".jsonl"):
        return [ln for _, ln in numbered]
    prompts = []
    for i, ln in numbered:
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as exc:
            raise LaserLMError(f"{name} line {i}: not JSON ({exc.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            prompts.append(obj["messages"])
        else:
            raise LaserLMError(f'{name} line {i}: expected {{"prompt": TEXT}} or {{"messages": [...]}}')
    return prompts


def cmd_batch(args) -> int:
    sampling = _sampling_from_args(args)
    prompts = _read_prompts(args.input)
    from .cli_common import check_output_path  # noqa: PLC0415

    if args.output != "-":
        check_output_path(args.output, "--output")
    check_chat_template(args)
    from .defaults import check_before_load  # noqa: PLC0415

    check_before_load(args.model, [args.mode])
    options = {"max_batch": args.max_batch, "page_size": args.page_size, "prefill_chunk": args.prefill_chunk,
               "eviction": args.eviction, "prefix_cache": not args.no_prefix_cache, "kv_prealloc": args.kv_prealloc,
               "kv_groups": args.kv_groups}
    from .runtime.scheduler import BatchConfig  # noqa: PLC0415

    BatchConfig(kv_budget=args.kv_budget, **options).validate()  # fail before the model loads
    lm = load_from_args(args)
    import time  # noqa: PLC0415

    t0 = time.perf_counter()
    results = lm.generate_batch(prompts, chat=args.chat, mode=args.mode, kv_budget=args.kv_budget,
                                batch_options=options, progress=not args.no_progress, **sampling)
    seconds = time.perf_counter() - t0
    out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    try:
        for i, r in enumerate(results):
            out.write(json.dumps({"index": i, "text": r.text, **r.stats()}) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    n = sum(r.generated_tokens for r in results)
    s = lm.last_batch_summary
    seconds = s.get("run_s", seconds)  # the scheduler's loop, without building the KV arena (setup_s)
    print(f"[{len(results)} requests, {n} tokens in {seconds:.1f} s: {n / seconds:.1f} tok/s, "
          f"{60 * len(results) / seconds:.1f} requests/min (KV arena built in {s.get('setup_s', 0.0):.1f} s before); "
          f"prefix hits {s['prefix_hit_tokens']} tokens, "
          f"{s['evicted_pages']} pages evicted"
          + (f", {s['skipped_pages']} pages of skipped layers returned" if s.get("skipped_pages") else "") + "]",
          file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise LaserLMError("no prompt given (pass it as an argument or on standard input)")
        prompt = sys.stdin.read()
    sampling = _sampling_from_args(args)
    if getattr(args, "laser", None) is not None:
        args.mode = laser_mode_spec(args.mode, args.laser)
    if not prompt.strip():
        raise LaserLMError("empty prompt: give some text to continue")
    if args.ctx_size is not None and args.ctx_size <= 0:
        raise LaserLMError(f"--ctx-size must be a positive integer, got {args.ctx_size}")
    backend = getattr(args, "backend", "torch")
    if backend == "torch":
        check_chat_template(args)
        from .defaults import check_before_load  # noqa: PLC0415

        check_before_load(args.model, [args.mode])  # bare adaptive/speculative on a non-bundled model: refuse now
    lm = load_from_args(args)
    monitor = None
    if getattr(args, "monitor_ranges", False):
        from .runtime.ranges import RangeMonitor  # noqa: PLC0415

        monitor = RangeMonitor(lm.engine)
    gen = lm.stream(prompt, chat=args.chat, mode=args.mode, **sampling)
    if args.json:
        result = gen.run()
        out = {"model": args.model, "backend": backend, "weights": lm.weights, "dtype": str(lm.engine.dtype).replace("torch.", ""),
               "prefill_dtype": lm.prefill_dtype, "mode": args.mode, "text": result.text,
               **result.stats()}
        if monitor is not None:
            out["ranges"] = monitor.report()
        print(json.dumps(out))
        return 0
    from .cli_common import stream_to_stdout  # noqa: PLC0415

    r = stream_to_stdout(gen)
    if r.finish_reason == "context":
        print(f"laserlm: warning: stopped at the context size ({lm.engine.max_seq_len} tokens); "
              "raise --ctx-size for longer output", file=sys.stderr)
    print(f"[{r.prompt_tokens} prompt tokens, {r.generated_tokens} generated, TTFT {r.ttft_s * 1000:.0f} ms, "
          f"{r.decode_tokens_per_s:.1f} tok/s, {r.mean_layers_per_token:.1f} layers/token, "
          f"finish: {r.finish_reason}]", file=sys.stderr)
    if monitor is not None:
        monitor.print_table()
    return 0


# -- models -------------------------------------------------------------------------------------
def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list the bundled model names",
                       description="List bundled model names and whether their package is installed.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    from .models.loader import SUPPORTED_MODEL_TYPES  # noqa: PLC0415
    from .models.registry import BUNDLED, is_installed  # noqa: PLC0415

    rows = [{"name": m.name, "installed": is_installed(m.name), "description": m.description,
             "install": m.install_hint} for m in BUNDLED.values()]
    if args.json:
        print(json.dumps({"bundled": rows, "supported_families": list(SUPPORTED_MODEL_TYPES.values())}))
        return 0
    for r in rows:
        mark = "installed" if r["installed"] else f"not installed: {r['install']}"
        print(f"{r['name']:<14} {r['description']}  [{mark}]")
    print("\nAlso accepted: a .gguf file, a local model directory, or a locally cached hub id.")
    print("Supported families: " + ", ".join(SUPPORTED_MODEL_TYPES.values()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="laserlm", description="Adaptive-compute inference for causal LMs.")
    parser.add_argument("--version", action="version", version=f"laserlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_batch(sub)
    _add_models(sub)
    from .bench import cli as bench_cli  # noqa: PLC0415  (the tools' subcommands; they never import this module)
    from .evaluation import cli as eval_cli  # noqa: PLC0415
    from .export import cli as export_cli  # noqa: PLC0415
    from .profiling import cli as profile_cli  # noqa: PLC0415
    from .report import cli as report_cli  # noqa: PLC0415
    from .serve import cli as serve_cli  # noqa: PLC0415
    from .training import cli as training_cli  # noqa: PLC0415

    eval_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    report_cli.add_parser(sub)
    for module in (training_cli, profile_cli, serve_cli, export_cli):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    from .defaults import set_adaptive_builder  # noqa: PLC0415
    from .training.defaults import build_adaptive_default  # noqa: PLC0415

    set_adaptive_builder(build_adaptive_default)  # bare `adaptive` on a bundled model builds its artifact once
    try:
        return args.func(args) or 0
    except LaserLMError as exc:
        print(f"laserlm: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nlaserlm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
