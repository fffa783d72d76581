"""``laserlm eval``: perplexity, zero-shot tasks and agreement for decoding modes, next to full depth."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..cli_common import (
    add_config_args,
    add_model_args,
    check_output_path,
    config_specs,
    global_attention_config,
    load_from_args,
)
from ..errors import InvalidArgumentError
from .data import task_source
from .tasks import TASKS, EvalSettings, Evaluator, load_prompts

DEFAULT_TASKS = "wikitext,lambada,hellaswag,arc_easy,piqa,agreement"


def add_parser(sub) -> None:
    """Register ``eval``."""
    p = sub.add_parser(
        "eval", help="measure quality: perplexity, zero-shot tasks, agreement with full depth",
        description="Evaluate decoding-mode configurations on WikiText-2 perplexity, LAMBADA, HellaSwag, "
                    "ARC-Easy, PIQA and GLUE SST-2/RTE/MRPC/QNLI dev (zero-shot, scored like "
                    "lm-evaluation-harness) and agreement with the full-depth model. The full-depth reference is "
                    "always evaluated and shown first.")
    add_model_args(p)
    add_config_args(p)
    p.add_argument("--tasks", default=DEFAULT_TASKS,
                   help=f"comma-separated subset of {','.join(TASKS)} (default: {DEFAULT_TASKS})")
    p.add_argument("--limit", type=int, default=None,
                   help="items per task (seeded random subset; for agreement: prompts)")
    p.add_argument("--ppl-windows", type=int, default=None,
                   help="perplexity over the first N windows of WikiText-2 test (default: the whole file)")
    p.add_argument("--seed", type=int, default=0, help="seed of the item subset (default: %(default)s)")
    p.add_argument("--window", type=int, default=512, help="perplexity window in tokens (default: %(default)s)")
    p.add_argument("--stride", type=int, default=None,
                   help="sliding-window stride: each window scores only its last STRIDE tokens, so every "
                        "token but the text's first is scored (default: = window, non-overlapping windows, which "
                        "without a BOS token leave each window's first token unscored)")
    p.add_argument("--agreement-windows", type=int, default=8,
                   help="WikiText-2 windows for top-1 agreement (default: %(default)s)")
    p.add_argument("--gen-tokens", type=int, default=32,
                   help="greedy tokens per prompt for generation agreement (default: %(default)s)")
    p.add_argument("--long-tokens", type=int, default=4096,
                   help="longtext: tokens of the long document, capped at the context size + 1 (default: %(default)s)")
    p.add_argument("--prompts", default=None, help='jsonl of {"prompt": ...} lines (default: the bundled set)')
    p.add_argument("--data", "--data-dir", dest="data", default=None, metavar="FILE|DIR|hf:NAME[:CONFIG[:SPLIT]]",
                   help="evaluation data: a data directory laid out like ../shared/data (wikitext-2/test.txt, "
                        "lambada/, hellaswag/, arc/, piqa/), one task's file (with one --tasks entry), or a Hugging "
                        "Face dataset for wikitext/lambada, e.g. hf:wikitext:wikitext-2-v1 (split test unless "
                        "named; needs the datasets package). Default: $LASERLM_DATA, else ../shared/data next "
                        "to a source checkout. --data-dir is an alias")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the results as JSON to PATH ('-' or no value: stdout, table goes to stderr)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--backend", choices=["torch", "onnxruntime"], default="torch",
                   help="torch: laserlm's engine; onnxruntime: the graphs of `laserlm export onnx` (--model is then "
                        "the export directory; configurations full and adaptive[...], dense attention, the "
                        "export's max length as context) (default: %(default)s)")
    p.set_defaults(func=cmd_eval)


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise InvalidArgumentError("--tasks is empty")
    for t in tasks:
        if t not in TASKS:
            raise InvalidArgumentError(f"unknown task '{t}'; available tasks: {', '.join(TASKS)}")
    return list(dict.fromkeys(tasks))


def cmd_eval(args) -> int:
    tasks = parse_tasks(args.tasks)
    specs = global_attention_config(args, config_specs(args))
    if args.limit is not None and args.limit < 1:
        raise InvalidArgumentError(f"--limit must be a positive number of items, got {args.limit}")
    for name, v, lo in (("--window", args.window, 2), ("--stride", args.stride, 1),
                        ("--agreement-windows", args.agreement_windows, 1), ("--ppl-windows", args.ppl_windows, 1), ("--gen-tokens", args.gen_tokens, 1),
                        ("--long-tokens", args.long_tokens, 3)):
        if v is not None and v < lo:
            raise InvalidArgumentError(f"{name} must be >= {lo}, got {v}")
    if args.stride is not None and args.stride > args.window:
        raise InvalidArgumentError(f"--stride ({args.stride}) cannot exceed --window ({args.window})")
    check_output_path(args.json, "--json")  # fail now, not after the evaluation
    readers = list(dict.fromkeys("wikitext" if t == "agreement" else t for t in tasks))
    if args.data and len(readers) > 1 and not Path(args.data).is_dir():
        raise InvalidArgumentError(f"--data {args.data} is one data set, but --tasks reads several "
                                   f"({', '.join(readers)}): pass a data directory, or one task with --tasks")
    for t in readers:  # fail on missing data before loading the model
        task_source(t, args.data)
    if "agreement" in tasks and args.prompts:
        load_prompts(args.prompts)  # a missing / malformed --prompts file fails now, not after the other tasks
    settings = EvalSettings(data=args.data, limit=args.limit, seed=args.seed, window=args.window,
                            stride=args.stride, ppl_windows=args.ppl_windows, agreement_windows=args.agreement_windows,
                            gen_tokens=args.gen_tokens, long_tokens=args.long_tokens, prompts=args.prompts, progress=not args.no_progress)
    backend = getattr(args, "backend", "torch")
    if backend == "torch":
        from ..defaults import check_before_load  # noqa: PLC0415

        check_before_load(args.model, specs)  # bare adaptive/speculative on a non-bundled model: refuse before loading
    lm = load_from_args(args)
    ev = Evaluator(lm, specs, settings)
    import torch  # noqa: PLC0415

    dtype = str(lm.engine.dtype).replace("torch.", "")
    threads = args.threads if backend == "onnxruntime" else torch.get_num_threads()
    from ..reports import machine, now, write_json  # noqa: PLC0415
    from .report import markdown  # noqa: PLC0415

    results, seconds = {}, {}
    table_out = sys.stderr if args.json == "-" else sys.stdout
    for t in tasks:
        t0 = time.perf_counter()
        results[t] = ev.run(t)
        seconds[t] = round(time.perf_counter() - t0, 1)
        print(markdown({t: results[t]}), file=table_out, flush=True)
    engine_line = lm.describe() if backend == "onnxruntime" else f"backend {backend}, {lm.describe()}"  # the
    # export's line starts with "onnxruntime"
    print(f"model {args.model} ({engine_line}), {threads or 'default'} threads, {machine()}, "
          f"{now()}", file=table_out)
    if args.json:
        doc = {"command": "eval", "model": args.model, "backend": backend, "weights": lm.weights,
               "dtype": dtype, "threads": threads,
               "machine": machine(), "date": now(), "reference": "full", "configs": ev.names,
               "argv": sys.argv[1:],
               "settings": {k: v for k, v in vars(settings).items() if k not in ("progress", "data_dir")},
               "results": results, "seconds": seconds}
        write_json(doc, args.json)
    return 0
