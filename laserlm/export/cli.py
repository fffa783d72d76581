"""``laserlm export onnx``: ``add_parser(sub)`` registers ``export`` (called by :func:`laserlm.cli.build_parser`).

The export runs with ``--backend onnxruntime`` on ``generate``, ``eval`` and ``bench`` (``--model`` is then the
export directory; :func:`laserlm.cli_common.load_from_args`), or ``laserlm.load(DIR)`` in Python.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidArgumentError, LaserLMError



def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a model (ONNX per layer group, TensorRT build profile)",
                       description="Export a model for other runtimes.")
    fmt = p.add_subparsers(dest="format", metavar="FORMAT")
    o = fmt.add_parser("onnx", help="one ONNX graph per layer group + embedding, bridges, exit heads and final head",
                       description="Export the model to ONNX (opset 13, TorchScript exporter, dynamic batch / "
                                   "new-token / past axes): embed.onnx, group_<g>.onnx, bridge_<g>.onnx, head.onnx, "
                                   "exit_<layer>.onnx and manifest.json. Run it with `laserlm generate --backend "
                                   "onnxruntime --model DIR`.")
    o.add_argument("--model", "-m", default="smollm2-135m", help="model to export (default: %(default)s)")
    o.add_argument("--out", "-o", required=True, metavar="DIR", help="output directory")
    o.add_argument("--groups", default=None, metavar="SPEC",
                   help="layer groups: size ('5'), end boundaries ('8/16/30') or ranges (default: the laser file's, "
                        "else groups of 5)")
    o.add_argument("--laser", default=None, metavar="PATH",
                   help="laser file from `laserlm calibrate`: exports its exit heads, records its gates and thresholds")
    o.add_argument("--lora", default=None, metavar="PATH",
                   help="a LoRA delta file from `laserlm train-backbone`, merged into the exported weights (a --laser "
                        "file calibrated on the adapted model names its delta; it is used by itself)")
    o.add_argument("--weights", "-w", default="fp32", choices=["fp32", "native", "int4", "int8"],
                   help="matrix weights in the graphs: fp32 (the exactness reference), or the Q4_1 / Q8_0 blocks that "
                        "the PyTorch engine runs with this --weights, as onnxruntime MatMulNBits (native: the GGUF "
                        "file's own blocks, not re-quantized) (default: %(default)s)")
    o.add_argument("--accuracy-level", type=int, default=4, choices=[0, 4],
                   help="MatMulNBits compute for quantized --weights: 4 = int8 activations, integer dot products "
                        "(llama.cpp's scheme), 0 = float32 (exact, slower) (default: %(default)s)")
    o.add_argument("--max-len", type=int, default=2048,
                   help="declared maximum context, past + new tokens (default: %(default)s)")
    o.add_argument("--peak-concurrency", type=int, default=1,
                   help="expected peak concurrent requests; max batch = ceil(1.2 x this) (seed 004 §3.1; default: "
                        "%(default)s)")
    o.add_argument("--max-batch", type=int, default=None,
                   help="declared maximum batch (default: ceil(1.2 x --peak-concurrency))")
    o.add_argument("--whole-model", action="store_true",
                   help="instead: one graph of the whole model with seed 004's signature, input_ids + attention_mask "
                        "-> logits (dynamic batch and seq_len up to --max-len, padding on either side, no KV cache), "
                        "written as DIR/model.onnx with the tokenizer; float32 weights only")
    o.add_argument("--no-tensorrt", action="store_true", help="do not write the TensorRT build profile")
    o.add_argument("--threads", "-t", type=int, default=None, help="CPU threads for the export")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.set_defaults(func=cmd_export_onnx)
    p.set_defaults(func=_no_format)


def _no_format(args) -> int:
    raise LaserLMError("give a format: `laserlm export onnx --model M --out DIR`")


def cmd_export_onnx(args) -> int:
    """``laserlm export onnx``; a refused or failed export removes the output directory it created."""
    out = Path(args.out)
    existed = out.exists()
    try:
        return _export_onnx(args)
    except BaseException:
        if not existed and out.is_dir():
            import shutil  # noqa: PLC0415

            shutil.rmtree(out, ignore_errors=True)
        raise


def _export_onnx(args) -> int:
    from ..cli_common import apply_threads  # noqa: PLC0415
    from ..runtime.ort_engine import is_export_dir  # noqa: PLC0415

    if is_export_dir(args.model):
        raise InvalidArgumentError(f"{args.model} is already an ONNX export; export the model it was made from")
    from .onnx import export_onnx  # noqa: PLC0415
    from .tensorrt import batch_bounds, write_profile  # noqa: PLC0415

    max_batch = args.max_batch if args.max_batch is not None else batch_bounds(args.peak_concurrency)[2]
    if max_batch < 1:
        raise InvalidArgumentError(f"--max-batch must be a positive integer, got {max_batch}")
    if args.max_len < 2:
        raise InvalidArgumentError(f"--max-len must be at least 2, got {args.max_len}")
    out = Path(args.out)
    if out.is_file():
        raise InvalidArgumentError(f"--out {out} is a file; give a directory")
    if args.laser is not None and not Path(args.laser).is_file():
        raise InvalidArgumentError(f"laser file not found: {args.laser}")
    if args.whole_model and (args.weights != "fp32" or args.laser is not None or args.groups is not None
                             or args.accuracy_level != 4 or args.max_batch is not None or args.peak_concurrency != 1
                             or args.no_tensorrt):
        raise InvalidArgumentError("--whole-model exports the float32 model as one graph with a dynamic batch and no "
                                   "TensorRT profile: drop --weights / --laser / --groups / --accuracy-level / "
                                   "--max-batch / --peak-concurrency / --no-tensorrt (they shape the per-group export)")
    apply_threads(args)
    from ..api import load  # noqa: PLC0415

    from ..cli_common import lora_from_args  # noqa: PLC0415

    lora = lora_from_args(args)
    if args.whole_model:
        from .onnx import export_whole_model  # noqa: PLC0415

        lm = load(args.model, dtype="float32", weights="fp32", max_seq_len=args.max_len, lora=lora)
        info = export_whole_model(lm.engine, out / "model.onnx", max_len=args.max_len)
        lm.tokenizer.save_pretrained(str(out / "tokenizer"))
        print(f"exported the whole model ({info['bytes'] / 2**20:.0f} MiB, opset 13; input_ids, attention_mask -> "
              f"logits, up to {info['max_len']} tokens) to {info['path']} in {info['seconds']:.1f} s")
        return 0
    lm = load(args.model, dtype="float32", weights="fp32", max_seq_len=args.max_len, lora=lora)  # refuses a
    # --max-len above the model's context
    packed = None if args.weights == "fp32" else load(args.model, dtype="float32", weights=args.weights,
                                                      max_seq_len=args.max_len, lora=lora).engine
    max_len = args.max_len
    man = export_onnx(lm.engine, out, groups=args.groups, laser=args.laser, max_batch=max_batch, max_len=max_len,
                      progress=not args.no_progress, tokenizer=lm.tokenizer, packed=packed,
                      accuracy_level=args.accuracy_level)
    size = sum(g["bytes"] for g in man["graphs"].values())
    q = man["quantized"]
    weights = "float32 weights" if q is None else (
        f"{man['weights']} weights ({', '.join(f'{n} {f}' for f, n in sorted(q['matrices'].items()))} matrices as "
        f"MatMulNBits, accuracy level {q['accuracy_level']})")
    print(f"exported {len(man['graphs'])} graphs ({size / 2**20:.0f} MiB, opset {man['opset']}, {weights}) to {out} "
          f"in {man['export_seconds']:.1f} s; groups {man['groups_spec']}, exit points "
          f"{[e['layer'] for e in man['exits']]}, max batch {max_batch}, max len {max_len}")
    if not args.no_tensorrt:
        prof = write_profile(out, args.peak_concurrency)
        print(f"TensorRT build profile written to {out / 'tensorrt_profile.json'} and trtexec commands to "
              f"{out / 'trtexec.sh'} (batch min/opt/max {prof['batch']}); NOT built: no GPU or TensorRT here")
    return 0
