"""``laserlm profile MODEL``: per-layer costs and what each technique could save, before any training."""

from __future__ import annotations

import importlib.util
import os
import sys

from ..cli_common import add_model_args, check_output_path, load_from_args
from ..errors import InvalidArgumentError

LONG_TEXT = "gutenberg/1400-0.txt"  # under the data directory (see laserlm.data)


def add_parser(sub) -> None:
    """Register the ``profile`` subcommand (all of its arguments are built here)."""
    p = sub.add_parser(
        "profile", help="per-layer time, exit agreement, Block Influence, skip sensitivity, sparse density and "
                        "predicted speedups, before any calibration",
        description="Profile a model on this machine in a few minutes: per-layer decode time; raw exit-head and "
                    "quick-lens agreement with the final layer; ShortGPT Block Influence; sensitivity to skipping "
                    "each layer's attention and MLP; block-sparse attention density vs context length; break-even "
                    "exit rates and speculative acceptance from the measured costs; a predicted speedup per "
                    "technique with its quality cost, and a measured decode of full depth and static pruning.")
    p.add_argument("model_name", nargs="?", default=None, metavar="MODEL", help="same as --model")
    add_model_args(p)
    p.add_argument("--data", default=None, metavar="FILE|DIR|hf:NAME",
                   help="calibration text (default: WikiText-2 valid of the data directory)")
    p.add_argument("--long-data", default=None, metavar="FILE",
                   help="long document for the sparse-attention density (default: the Gutenberg novel of the data "
                        "directory)")
    p.add_argument("--tokens", type=int, default=None,
                   help="calibration tokens: the quick lens is fitted on the first half, scored on the second "
                        "(default: 1024; with --precision: tokens of WikiText-2 test scored, default 256)")
    p.add_argument("--sensitivity-tokens", type=int, default=256,
                   help="positions scored per skip-sensitivity run (default: %(default)s)")
    p.add_argument("--sparse-lengths", default="512,1024,2048", metavar="N[,N...]",
                   help="context lengths for the sparse density (default: %(default)s); 'none' skips it")
    p.add_argument("--drops", default=None, metavar="N[,N...]",
                   help="static-pruning sizes (layers dropped, lowest Block Influence first; default 1,2,L/8,L/4)")
    p.add_argument("--draft-layers", type=int, default=None, help="self-speculative draft depth (default L/2)")
    p.add_argument("-k", type=int, default=4, help="self-speculative drafts per cycle (default: %(default)s)")
    p.add_argument("--context", type=int, default=64, help="cached tokens before the timed decode step "
                                                           "(default: %(default)s)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions (medians; default: %(default)s)")
    p.add_argument("--no-measure", action="store_true", help="skip the measured decode of full depth and static "
                                                             "pruning")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the profile as JSON to PATH ('-' or no value: stdout, tables go to stderr)")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="write a PNG plot")
    p.add_argument("--out", default=None, metavar="DIR", help="write profile.json, profile.md and profile.png to DIR")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("precision profile (laserlm.profiling.precision)")
    g.add_argument("--precision", action="store_true",
                   help="instead: the precision profile, float16 / bfloat16 beside float32 (per-layer max |x| vs "
                        "the dtype's range, NaN/inf, per-layer and per-head error, perplexity per dtype)")
    g.add_argument("--dtypes", default="float16,bfloat16", help="dtypes of --precision (default: %(default)s)")
    g.add_argument("--top", type=int, default=5, help="most sensitive layers/heads --precision lists "
                                                      "(default: %(default)s)")
    p.set_defaults(func=cmd_profile)


def _ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    if text.strip().lower() == "none":
        return []
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgumentError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in vals):
        raise InvalidArgumentError(f"{flag} values must be >= 1, got {text!r}")
    return vals


def _validate(args) -> None:
    if args.model_name:
        args.model = args.model_name
    args.tokens = 1024 if args.tokens is None else args.tokens
    if args.tokens < 16:
        raise InvalidArgumentError(f"--tokens must be >= 16, got {args.tokens}")
    for name in ("sensitivity_tokens", "context", "reps"):
        if getattr(args, name) < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.sparse_list = _ints(args.sparse_lengths, "--sparse-lengths")
    args.drop_list = _ints(args.drops, "--drops")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        args.json = args.json or os.path.join(args.out, "profile.json")
        args.plot = args.plot or os.path.join(args.out, "profile.png")
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise InvalidArgumentError("--plot needs matplotlib: pip install 'laserlm[bench]'")


def _long_ids(args, tok):
    import torch  # noqa: PLC0415

    from ..data import read_text, resolve  # noqa: PLC0415

    path = resolve(args.long_data, LONG_TEXT, flag="--long-data", what="long document")
    need = max(args.sparse_list)
    text = read_text(path, errors="replace")[: need * 8]
    return torch.tensor(tok(text)["input_ids"][:need], dtype=torch.long)


def cmd_profile(args) -> int:
    if args.precision:
        from .precision import run_precision_profile  # noqa: PLC0415

        args.model = args.model_name or args.model
        args.tokens = 256 if args.tokens is None else args.tokens
        return run_precision_profile(args)
    _validate(args)
    lm = load_from_args(args)
    import torch  # noqa: PLC0415

    from ..depth.pruning import calibration_ids  # noqa: PLC0415
    from ..reports import machine, now, write_json  # noqa: PLC0415
    from .report import markdown, plot  # noqa: PLC0415
    from .run import profile  # noqa: PLC0415

    L = lm.engine.num_layers
    if args.drop_list and max(args.drop_list) >= L:
        raise InvalidArgumentError(f"--drops: at most {L - 1} of the model's {L} layers can be dropped")
    ids = calibration_ids(lm.engine, args.data, args.tokens)
    long_ids = _long_ids(args, lm.tokenizer) if args.sparse_list else None
    doc = profile(lm, ids, long_ids, drops=args.drop_list, draft_layers=args.draft_layers, k=args.k,
                  context=args.context, reps=args.reps, sparse_lengths=tuple(args.sparse_list or ()),
                  sensitivity_positions=args.sensitivity_tokens, measure=not args.no_measure,
                  progress=not args.no_progress)
    doc.update({"command": "profile", "model": args.model, "machine": machine(), "date": now(), "argv": sys.argv[1:]})
    text = markdown(doc) + f"\n\nmodel {args.model}; {machine()}; {now()}; profile took {doc['seconds']:.0f} s"
    out = sys.stderr if args.json == "-" else sys.stdout
    print(text, file=out)
    if args.out:
        with open(os.path.join(args.out, "profile.md"), "w") as f:
            f.write(text + "\n")
    if args.plot:
        plot(doc, args.plot, f"{args.model} ({lm.engine.weights}, {torch.get_num_threads()} threads)")
        print(f"plot written to {args.plot}", file=out)
    if args.json:
        write_json(doc, args.json)
    return 0
