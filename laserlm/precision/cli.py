"""``laserlm profile --precision MODEL``: the precision profile (:func:`laserlm.precision.profile.precision_profile`).

The ``profile`` subcommand (:mod:`laserlm.profiling.cli`) declares the flags and dispatches ``--precision`` to
:func:`run_precision_profile`.
"""

from __future__ import annotations

import json
import sys

from ..errors import InvalidArgumentError


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
