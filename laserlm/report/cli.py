"""``laserlm report``: reports that reproduce published tables (``report seeds``, :mod:`laserlm.report.seeds`)."""

from __future__ import annotations

import argparse
import sys

from ..cli_common import add_model_args, check_output_path, load_from_args
from ..errors import InvalidArgumentError
def add_parser(sub) -> None:
    """Register ``report`` (``report seeds``: the seeds' result tables beside ours, :mod:`laserlm.report.seeds`)."""
    p = sub.add_parser("report", help="reports that reproduce published tables (report seeds)",
                       description="Reports that reproduce published result tables on one model in one run.")
    rsub = p.add_subparsers(dest="report", metavar="REPORT")
    s = rsub.add_parser(
        "seeds", help="both seeds' result tables with laserlm's figure beside every row",
        description="Measure every row of seed 004 §4 (dynamic compute path, sparse attention, memory-pool "
                    "pre-allocation, all combined: speed, memory saved, accuracy on GLUE), seed 000 §2.2 (latency per "
                    "token, peak memory, long-text consistency, utilization, decay past 2,048 tokens) and the seed "
                    "scenarios on one model, and print the seed's figure beside ours with the definition of each. "
                    "Run it alone: it times things.")
    add_model_args(s)
    for action in s._actions:  # the sparse rows use the default sparse settings: these are refused, so not listed
        if action.dest in ("attention", "sparse_threshold", "sparse_mass", "block_size", "dense_layers"):
            action.help = argparse.SUPPRESS
    s.add_argument("--laser", default=None, metavar="PATH",
                   help="a laser file for the model (`laserlm calibrate`): the dynamic-path and Laser rows (without "
                        "it those rows say so)")
    s.add_argument("--glue-task", default="sst2", choices=["sst2", "rte", "mrpc", "qnli"],
                   help="GLUE dev set of the seed-004 rows (default: %(default)s)")
    s.add_argument("--glue-limit", type=int, default=100, help="GLUE items scored, 0 = all (default: %(default)s)")
    s.add_argument("--long-tokens", type=int, default=4096,
                   help="tokens of the long novel for the long-text rows (default: %(default)s)")
    s.add_argument("--decode-tokens", type=int, default=48, help="tokens per request in the latency rows "
                   "(default: %(default)s)")
    s.add_argument("--decode-prompts", type=int, default=8, help="chat prompts in the latency rows "
                   "(default: %(default)s)")
    s.add_argument("--docs", type=int, default=16, help="documents in the batch rows (default: %(default)s)")
    s.add_argument("--data", default=None, help="data directory (default: $LASERLM_DATA or ../shared/data)")
    s.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON ('-': stdout)")
    s.add_argument("--md", default=None, metavar="PATH", help="write the Markdown tables to PATH")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_report_seeds)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])


def cmd_report_seeds(args) -> int:
    from ..reports import machine, now, write_json  # noqa: PLC0415
    from .seeds import SeedsConfig, format_markdown, run_seeds  # noqa: PLC0415

    cfg = SeedsConfig(laser=args.laser, glue_task=args.glue_task, glue_limit=args.glue_limit or None,
                      long_tokens=args.long_tokens, decode_tokens=args.decode_tokens,
                      decode_prompts=args.decode_prompts, docs=args.docs, data=args.data,
                      progress=not args.no_progress).validate()
    check_output_path(args.json, "--json")
    check_output_path(args.md, "--md")
    sparse_flags = [f for f, v in (("--attention sparse", args.attention != "dense"),
                                   ("--sparse-threshold", args.sparse_threshold is not None),
                                   ("--sparse-mass", args.sparse_mass is not None),
                                   ("--block-size", args.block_size is not None),
                                   ("--dense-layers", args.dense_layers is not None)) if v]
    if sparse_flags:
        raise InvalidArgumentError(f"report seeds measures dense and block-sparse attention itself (its sparse rows "
                                   f"use the default sparse settings); drop {', '.join(sparse_flags)}")
    lm = load_from_args(args)
    rows = run_seeds(lm, cfg)
    command = "laserlm " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("laserlm") else \
        "laserlm report seeds"
    header = (f"Model {lm.loaded.name if lm.loaded else '?'} ({lm.describe()}); machine: {machine()}; {now()}; "
              f"command: `{command}`")
    md = format_markdown(rows, header)
    print(md, file=sys.stderr if args.json == "-" else sys.stdout)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.json:
        write_json({"model": lm.loaded.name if lm.loaded else None, "machine": machine(), "date": now(),
                    "command": command, "settings": cfg.__dict__, "rows": [r.to_dict() for r in rows]}, args.json)
    return 0
