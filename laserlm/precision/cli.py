"""``laserlm profile --precision MODEL``: the precision profile (:func:`laserlm.precision.profile.precision_profile`).

``add_parser(sub)`` registers ``profile`` with a ``--precision`` flag; :func:`run_precision_profile` is the plain
function it calls (kept separate so that another ``profile`` parser can dispatch ``--precision`` to it).
"""

from __future__ import annotations

import json
import sys

from ..errors import InvalidArgumentError


def add_precision_args(p) -> None:
    """The options of the precision profile (also for a merged ``profile`` parser)."""
    p.add_argument("--precision", action="store_true",
                   help="precision profile: float16 / bfloat16 beside float32, per layer and head")
    p.add_argument("--dtypes", default="float16,bfloat16", help="dtypes to profile (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=256, help="tokens of text scored (default: %(default)s)")
    p.add_argument("--data", default=None, metavar="FILE|DIR|hf:NAME",
                   help="text to score (default: WikiText-2 test of the data directory)")
    p.add_argument("--top", type=int, default=5, help="most sensitive layers/heads listed (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON ('-': stdout)")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads")


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="profile a model (--precision: float16/bfloat16 vs float32)",
                       description="Profile MODEL. --precision: run float16 and bfloat16 beside float32 on the same "
                                   "text and report per-layer max |activation| vs the dtype's range, NaN/inf counts, "
                                   "per-layer and per-head error vs float32, the most sensitive layers and heads, and "
                                   "perplexity per dtype (float16 also as guarded --dtype float16 runs it).")
    p.add_argument("model", nargs="?", default="smollm2-135m", help="model (default: %(default)s)")
    add_precision_args(p)
    p.set_defaults(func=run_precision_profile)


def run_precision_profile(args) -> int:
    """Run the precision profile for ``args.model``; prints the summary (stdout, or stderr with ``--json -``).

    Raises:
        InvalidArgumentError: ``--precision`` missing, bad ``--tokens`` / ``--dtypes``; data and model errors from
            their loaders.
    """
    if not getattr(args, "precision", False):
        raise InvalidArgumentError("`laserlm profile` here runs the precision profile: add --precision")
    if args.tokens < 2:
        raise InvalidArgumentError(f"--tokens must be at least 2, got {args.tokens}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    from .profile import DTYPES, format_report, precision_profile  # noqa: PLC0415

    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise InvalidArgumentError(f"--dtypes takes {', '.join(DTYPES)}, got {args.dtypes!r}")
    from .. import data as data_mod  # noqa: PLC0415
    from ..cli_common import apply_threads, check_output_path  # noqa: PLC0415

    if args.json not in (None, "-"):
        check_output_path(args.json, "--json")
    src = data_mod.resolve(args.data, "wikitext-2/test.txt", flag="--data", what="profile text")
    text = data_mod.read_text(src)
    apply_threads(args)
    from ..api import load  # noqa: PLC0415

    lm = load(args.model, dtype="float32", weights="fp32")
    import torch  # noqa: PLC0415

    ids = torch.tensor(lm.tokenizer(text[:args.tokens * 20])["input_ids"][:args.tokens])
    rep = precision_profile(lm.engine, ids, dtypes, top=args.top)
    rep["model"] = args.model
    out = sys.stderr if args.json == "-" else sys.stdout
    print(format_report(rep), file=out)
    if args.json == "-":
        print(json.dumps(rep))
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=1)
    return 0
