"""Helpers shared by the ``laserlm`` command and its tool subcommands (``eval``, ``bench``, ``calibrate``).

Model-loading arguments and building the :class:`laserlm.LaserLM` from them, the attention and
configuration flags, the checks that run before a model loads. ``laserlm.cli`` and the tools' ``cli``
modules import this module; it imports neither of them (one direction: tools <- cli_common <- cli, and
``laserlm.cli`` imports the tools' CLIs, never the reverse).
"""

from __future__ import annotations

import argparse
import os

from .errors import InvalidArgumentError, LaserLMError



def dtype_arg(value: str) -> str:
    """``--dtype`` values: the API's check (:func:`laserlm.models.dtypes.check_offered_dtype`), one message for
    both."""
    from .models.dtypes import check_offered_dtype  # noqa: PLC0415

    try:
        return check_offered_dtype(value)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None



def add_model_args(p: argparse.ArgumentParser) -> None:
    """Arguments shared by every command that loads a model."""
    p.add_argument("--model", "-m", default="smollm2-135m",
                   help="bundled name (see `laserlm models`), .gguf file, model directory or cached hub id "
                        "(default: %(default)s)")
    from .models.dtypes import OFFERED_DTYPES, PREFILL_DTYPES, WEIGHT_FORMATS  # noqa: PLC0415

    p.add_argument("--weights", "-w", choices=WEIGHT_FORMATS, default="auto",
                   help="weight format: native = a GGUF file's own quantization (4-bit types as int4 blocks, 5/6/8-bit "
                        "as int8 blocks), int8/int4 = round-to-nearest blocks of 32 for any float model, fp32 = the "
                        "exact reference path, bf16; auto = native for a GGUF file unless --dtype is given, else "
                        "fp32 (default: %(default)s)")
    p.add_argument("--prefill-dtype", choices=PREFILL_DTYPES, default="auto",
                   help="arithmetic in which quantized weights multiply prompt chunks (more than 16 positions): "
                        "int16 = the block kernels of a decode step, so a prompt position is computed exactly as "
                        "in decoding whatever the chunking; float32 / bfloat16 = a GEMM over the dequantized "
                        "matrix; auto = int16 where the kernels are built (default: %(default)s)")
    p.add_argument("--dtype", type=dtype_arg, default=None, metavar="{" + ",".join(OFFERED_DTYPES) + "}",
                   help="activations dtype, and the weights' for fp32/bf16 (default: float32; float16 runs guarded: "
                        "norms in float32, a layer that would overflow falls back to float32)")
    p.add_argument("--ctx-size", "-c", type=int, default=None,
                   help="context size of the KV cache in tokens (default: min(4096, model limit))")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="a LoRA delta file from `laserlm train-backbone`, merged into the weights at load (a --laser file "
                        "calibrated on the adapted model loads its delta by itself)")
    add_attention_args(p)



def add_attention_args(p: argparse.ArgumentParser) -> None:
    """Block-sparse attention options (laserlm.attention); orthogonal to --mode."""
    g = p.add_argument_group("attention")
    g.add_argument("--attention", choices=["dense", "sparse"], default="dense",
                   help="attention kernel: dense SDPA or block-sparse (default: %(default)s)")
    g.add_argument("--sparse-threshold", type=float, default=None, metavar="C",
                   help="sparse: keep key blocks whose coarse logit is within C*log(n) of the best block "
                        "(the seed's C/sqrt(d_k)*log(n) on q.k/d_k); C >= 0, inf = dense (default: 0.5)")
    g.add_argument("--sparse-mass", type=float, default=None, metavar="TAU",
                   help="sparse: use the mass rule instead: fewest blocks reaching coarse softmax mass TAU in (0, 1]")
    g.add_argument("--block-size", type=int, default=None,
                   help="sparse: positions per block (default: 64)")
    g.add_argument("--dense-layers", type=int, default=None,
                   help="sparse: the first N decoder layers stay dense (default: 2)")



def add_mode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="full",
                   help="decoding mode spec NAME[:key=value,...], e.g. full, adaptive:..., speculative:... "
                        "(default: %(default)s)")



def add_config_args(p: argparse.ArgumentParser) -> None:
    """Several configurations for ``eval`` / ``bench``: ``MODE_SPEC[@ATTENTION]``, e.g. ``full@sparse:threshold=0.5``.
    Mode specs contain commas, so configurations are given one per ``--config`` flag or ``;``-separated
    in ``--configs``."""
    p.add_argument("--config", action="append", default=[], metavar="SPEC",
                   help="configuration MODE[:k=v,...][@ATTENTION] to evaluate, repeatable, e.g. --config "
                        "adaptive:policy=confidence,threshold=0.9 or full@sparse:threshold=0.5 (the dense "
                        "full-depth reference 'full' is always included)")
    p.add_argument("--configs", default="", metavar="SPEC;SPEC",
                   help="several mode specs separated by ';' (quote it in the shell)")



def config_specs(args) -> list[str]:
    """The mode specs from ``--config`` / ``--configs``, ``full`` first, duplicates removed."""
    specs = ["full"] + [s.strip() for s in args.config] + [s.strip() for s in args.configs.split(";")]
    for s in specs:
        if s.startswith(("-", ":")):
            raise LaserLMError(f"bad configuration spec {s!r} (expected NAME[:key=value,...])")
    specs = list(dict.fromkeys(s for s in specs if s))
    from .mode_table import MODES  # noqa: PLC0415
    from .runtime.modes import parse_spec  # noqa: PLC0415

    for s in specs:  # unknown names and bad attention settings fail here, before the model loads
        mode_spec, _, attn = s.partition("@")
        name = parse_spec(mode_spec)[0]
        if name not in MODES:
            raise LaserLMError(f"unknown mode '{name}' in configuration '{s}'; available modes: {', '.join(sorted(MODES))}")
        if attn:
            from .attention import parse_attention  # noqa: PLC0415

            parse_attention(attn)
    return specs



def global_attention_config(args, specs: list[str]) -> list[str]:
    """With ``--attention sparse ...`` on ``eval`` / ``bench`` the reference ``full`` stays dense; when no
    other configuration is given, ``full@<that attention>`` is added so the flag is measured, not ignored."""
    kw = attention_kwargs(args)
    if not kw or any(s != "full" for s in specs):
        return specs
    name = kw.pop("attention")
    attn = f"{name}:" + ",".join(f"{k}={v}" for k, v in kw.items()) if kw else name
    return specs + [f"full@{attn}"]



def apply_threads(args) -> None:
    if getattr(args, "threads", None) is not None:  # 0 is an error, not "unset"
        import torch  # noqa: PLC0415

        if args.threads < 1:
            raise LaserLMError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)



def check_onnx_args(args) -> None:
    """Refuse the model-loading options that the exported graphs do not have (``generate`` and ``eval``
    with ``--backend onnxruntime``).

    Raises:
        InvalidArgumentError: ``--weights``, ``--dtype``, ``--prefill-dtype``, ``--attention`` or a sparse-attention
            option, or ``--ctx-size`` given.
    """
    if getattr(args, "weights", "auto") != "auto" or getattr(args, "dtype", None) is not None:
        raise InvalidArgumentError("--backend onnxruntime runs the exported graphs, whose weights `laserlm export onnx "
                                   "--weights` chose: drop --weights/--dtype")
    if getattr(args, "prefill_dtype", "auto") != "auto":
        raise InvalidArgumentError("--backend onnxruntime runs the exported float32 graphs: drop --prefill-dtype")
    sparse = ("sparse_threshold", "sparse_mass", "block_size", "dense_layers")
    if getattr(args, "attention", "dense") != "dense" or any(getattr(args, k, None) is not None for k in sparse):
        raise InvalidArgumentError("--backend onnxruntime has dense attention only: drop --attention and the "
                                   "sparse-attention options")
    if getattr(args, "monitor_ranges", False):
        raise InvalidArgumentError("--backend onnxruntime cannot record layer ranges (the layers run inside the "
                                   "graphs): drop --monitor-ranges")
    if getattr(args, "lora", None) is not None:
        raise InvalidArgumentError("--backend onnxruntime runs the exported graphs, whose weights include the LoRA "
                                   "delta they were exported with: drop --lora")
    if getattr(args, "ctx_size", None) is not None:
        raise InvalidArgumentError("--backend onnxruntime uses the export's --max-len as context: drop --ctx-size")


def load_from_args(args):
    """Build a :class:`laserlm.LaserLM` from the shared model arguments; with ``--backend onnxruntime`` the export
    directory ``--model`` on the onnxruntime engine (:func:`laserlm.api.load_onnx`, after :func:`check_onnx_args`).

    Raises:
        InvalidArgumentError: options the exported graphs do not have.
        ModelNotFoundError / CorruptModelError / UnsupportedArchitectureError: as :func:`laserlm.load`.
    """
    from .api import load, load_onnx  # noqa: PLC0415
    from .runtime.ort_engine import is_export_dir  # noqa: PLC0415

    if is_export_dir(args.model) and getattr(args, "backend", "torch") != "onnxruntime":
        command = getattr(args, "command", None) or "this command"
        has_backend = getattr(args, "backend", None) is not None
        raise InvalidArgumentError(f"{args.model} is an ONNX export: " + (
            "run it with --backend onnxruntime" if has_backend else
            f"{command} needs laserlm's own engine; give it the source model"))
    if getattr(args, "backend", "torch") == "onnxruntime":
        check_onnx_args(args)
        apply_threads(args)  # checks --threads; torch threads for the exit policies' small tensors
        return load_onnx(args.model, threads=args.threads)
    apply_threads(args)
    return load(args.model, dtype=args.dtype, max_seq_len=args.ctx_size, weights=getattr(args, "weights", "auto"),
                prefill_dtype=getattr(args, "prefill_dtype", "auto"), lora=lora_from_args(args),
                **attention_kwargs(args))


def lora_from_args(args):
    """``--lora PATH``, else the delta a ``--laser`` file names (it was calibrated on the adapted model), else None.

    Raises:
        InvalidArgumentError: ``--lora`` names no file, or the laser file's delta is missing.
    """
    from pathlib import Path  # noqa: PLC0415

    delta = getattr(args, "lora", None)
    if delta is not None:
        if not Path(delta).is_file():
            raise InvalidArgumentError(f"--lora {delta}: no such file")
        return delta
    laser = getattr(args, "laser", None)
    if not laser or not Path(laser).is_file():
        return None  # a missing laser file is reported where it is read
    from .depth.laser_file import delta_file_of, read_metadata  # noqa: PLC0415

    meta, _ = read_metadata(laser)
    found = delta_file_of(meta, laser)
    if found is not None and not found.is_file():
        raise InvalidArgumentError(f"{laser} was calibrated on the model adapted by the delta {found}, which is missing; "
                                   "put the delta file there or give --lora PATH")
    return found



def attention_kwargs(args) -> dict:
    """``load()`` keyword arguments from the --attention options (empty for dense without options)."""
    attention = getattr(args, "attention", "dense") or "dense"
    check_one_sparse_rule(args)
    opts = {"threshold": getattr(args, "sparse_threshold", None), "block_size": getattr(args, "block_size", None),
            "dense_layers": getattr(args, "dense_layers", None)}
    if getattr(args, "sparse_mass", None) is not None:
        opts.update(rule="mass", tau=args.sparse_mass)
    opts = {k: v for k, v in opts.items() if v is not None}
    if attention == "dense" and not opts:
        return {}
    from .attention import parse_attention  # noqa: PLC0415

    parse_attention(attention, **opts)  # fail on bad settings before the model loads
    return {"attention": attention, **opts}



def check_one_sparse_rule(args) -> None:
    """``--sparse-threshold`` and ``--sparse-mass`` pick two different block-selection rules; giving both
    is ambiguous.

    Raises:
        InvalidArgumentError: both flags were given.
    """
    if getattr(args, "sparse_threshold", None) is not None and getattr(args, "sparse_mass", None) is not None:
        raise InvalidArgumentError("--sparse-threshold and --sparse-mass select blocks by two different rules "
                                   "(threshold rule / mass rule); give only one of them")



def check_output_path(path: str | None, flag: str) -> None:
    """Fail before any work (model load, measurements) when the output file of ``flag`` cannot be written.

    ``path``: the file given to ``flag`` (e.g. ``--json PATH``, ``--plot PATH``); ``None`` (option not
    given) and ``"-"`` (standard output) pass. The file itself need not exist; it is not created here.

    Raises:
        InvalidArgumentError: the path is a directory, or its directory is missing or not writable.
    """
    if path is None or path == "-":
        return
    from pathlib import Path  # noqa: PLC0415

    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise InvalidArgumentError(f"{flag} {path} is a directory; give a file path")
    if not parent.is_dir():
        raise InvalidArgumentError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"{flag} {path}: directory {parent} is not writable")


def laser_mode_spec(mode: str, laser: str) -> str:
    """``--laser PATH``: ``full`` becomes ``adaptive:laser=PATH`` (the file's bridge and patience: the settings the
    calibration's guarantee is about); an ``adaptive``, ``routed`` or ``speculative`` spec gets ``laser=PATH`` added
    (``routed`` runs the file's router, speculative drafts with the file's exit head); other modes are an error."""
    if not str(laser).strip():
        raise LaserLMError("--laser needs the path of a laser file (from `laserlm calibrate`)")
    name, _, rest = mode.partition(":")
    if name == "full" and not rest:
        return f"adaptive:laser={laser}"
    if name not in ("adaptive", "routed", "speculative"):
        raise LaserLMError(f"--laser works with the adaptive, routed and speculative modes, not '{name}'")
    return f"{name}:{rest},laser={laser}" if rest else f"{name}:laser={laser}"


def add_batch_args(p, queue_help: str | None = None) -> None:
    """The KV pool and continuous-batching flags (``laserlm batch``, ``laserlm serve``); ``queue_help`` adds
    ``--max-queue``."""
    g = p.add_argument_group("KV pool and batching")
    g.add_argument("--kv-budget", default=None, metavar="SIZE",
                   help="KV pool size: MiB (512, 512MiB, 2GiB) or tokens (8192t) (default: 512MiB)")
    g.add_argument("--max-batch", type=int, default=16, help="requests running at once (default: %(default)s)")
    if queue_help is not None:
        g.add_argument("--max-queue", type=int, default=256, help=queue_help + " (default: %(default)s)")
    g.add_argument("--page-size", type=int, default=16, help="positions per KV page (default: %(default)s)")
    g.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens prefilled per step (default: %(default)s)")
    g.add_argument("--eviction", default=None, metavar="POLICY",
                   help="none, streaming[:sinks=4,window=256] or depth_lru[:budget=512,sinks=4,recent=64]")
    g.add_argument("--no-prefix-cache", action="store_true", help="do not share prompt pages between requests")
    g.add_argument("--kv-prealloc", choices=["full", "staged", "request"], default="full",
                   help="full: allocate the whole --kv-budget at start; staged: start at 1024 pages and double up "
                        "to the budget as load grows (seed 004's progressive pre-allocation); request: no pool, each "
                        "request allocates its own contiguous KV cache when admitted and frees it when done (the "
                        "baseline the pool is measured against; no prefix cache or eviction) (default: full)")
    g.add_argument("--kv-groups", default=None, metavar="SPEC",
                   help="one block of the KV pool per layer group (seed 004's fixed block per execution group): N = "
                        "groups of N layers, or group end boundaries such as 8/16/30; needs --kv-prealloc full "
                        "(default: one block for all layers)")
    return g


def stream_to_stdout(gen):
    """Write each text piece of a :class:`~laserlm.runtime.generate.Generation` to stdout as it comes, then a
    newline; returns its result."""
    import sys  # noqa: PLC0415

    for piece in gen:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return gen.result
