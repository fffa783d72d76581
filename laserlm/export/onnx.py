"""Export a model to ONNX per layer group, with a ``manifest.json`` (seed 004 §3.1).

``export_onnx(engine, out_dir, ...)`` writes, from :mod:`laserlm.export.graphs`:

- ``embed.onnx``: ``input_ids [batch, new_tokens] int64 -> hidden [batch, new_tokens, d]``;
- ``group_<g>.onnx`` per layer group: ``hidden``, ``positions [batch, new_tokens] int64``, ``past_k_<j>`` /
  ``past_v_<j>`` ``[batch, n_kv, past, head_dim]`` for its layers -> ``hidden_out`` and ``new_k_<j>`` / ``new_v_<j>``
  ``[batch, n_kv, new_tokens, head_dim]``;
- ``bridge_<g>.onnx`` for every group after the first exit point: the ``propagate`` bridge's K/V of its layers
  computed from an exit hidden state (``hidden``, ``positions`` -> ``new_k_<j>`` / ``new_v_<j>``);
- ``head.onnx``: final norm + LM head: ``hidden -> logits [batch, new_tokens, vocab]`` float32;
- ``exit_<layer>.onnx`` for each trained exit head of a laser file: its adapter (``hidden -> hidden``); the exit
  head is that graph followed by ``head.onnx`` (the LM head is stored once);
- ``laser.safetensors``: a copy of the laser file (its gates run in PyTorch with the same policy code as the engine);
- ``tokenizer/``: the model's tokenizer (``save_pretrained``), so the runtime needs no PyTorch model.

Exporter: ``torch.onnx.export`` with ``dynamo=False`` (the TorchScript exporter; torch 2.13's dynamo exporter
rejected the variable number of past K/V inputs) at opset :data:`OPSET` (13, the seed's), constant folding on.
Dynamic axes: ``batch``, ``new_tokens``, ``past``. The declared bounds are in the manifest (``shapes``): batch
1..max_batch, new_tokens >= 1, past >= 0, past + new_tokens <= max_len (the rotary tables in the graphs cover
``max_len`` positions). Activations are float32. Weights are float32 (the exactness reference), or, with
``weights=`` a packed model (``--weights native|int4|int8``), the same Q4_1 / Q8_0 blocks as the PyTorch engine's in
onnxruntime's ``MatMulNBits`` (:mod:`laserlm.export.quantize`; reduced-precision activations: :mod:`laserlm.profiling.precision`).

Raises (from :func:`export_onnx`): :class:`~laserlm.errors.InvalidArgumentError` for bad groups or bounds, a
non-float32 or packed model, an output path that is a file. Files of an earlier export in the directory are
overwritten.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path

import torch

from ..errors import InvalidArgumentError
from ..models.files import file_sha256
from . import graphs as G
from ..runtime.options import is_int
from ..runtime.ort_engine import MANIFEST, MANIFEST_VERSION

OPSET = 13
EXPORTER = "torch.onnx.export(dynamo=False) (TorchScript exporter), do_constant_folding=True"


def _io(name: str, dtype: str, shape: list) -> dict:
    return {"name": name, "dtype": dtype, "shape": shape}


def _layer_io(start: int, stop: int, prefix: str, n_kv: int, hd: int, axis: str) -> list:
    out = []
    for j in range(start, stop):
        for kv in "kv":
            out.append(_io(f"{prefix}_{kv}_{j}", "float32", ["batch", n_kv, axis, hd]))
    return out


def _export_one(module, args: tuple, path: Path, inputs: list, outputs: list) -> None:
    axes = {}
    for spec in inputs + outputs:
        named = {i: d for i, d in enumerate(spec["shape"]) if isinstance(d, str)}
        if named:
            axes[spec["name"]] = named
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(module.eval(), args, str(path), input_names=[s["name"] for s in inputs],
                          output_names=[s["name"] for s in outputs], dynamic_axes=axes, opset_version=OPSET,
                          do_constant_folding=True, dynamo=False)


def export_whole_model(engine, path, max_len: int | None = None) -> dict:
    """Export ``engine``'s model (float32, dense weights) as one ONNX graph with seed 004 §3.1's signature:
    ``input_ids [batch, seq_len]`` int64 and ``attention_mask [batch, seq_len]`` int64 -> ``logits [batch, seq_len,
    V]`` float32, opset 13, constant folding, dynamic ``batch`` and ``seq_len`` (at most ``max_len`` tokens per
    row, the rotary tables' length). Padding may be on either side; every row needs at least one token. It has no
    KV cache: for decoding use the per-group export (:func:`export_onnx`). Returns ``{"path", "bytes", "seconds",
    "max_len"}``.

    Raises:
        InvalidArgumentError: packed or non-float32 weights, ``max_len`` outside ``2 .. context size``, ``path`` a
            directory.
    """
    if engine.dtype != torch.float32 or getattr(engine, "_packed", None):
        raise InvalidArgumentError("ONNX export needs the float32 dense weights: load with --weights fp32 "
                                   f"(this model runs {engine.weights})")
    max_len = engine.max_seq_len if max_len is None else int(max_len)
    if not 2 <= max_len <= engine.max_seq_len:
        raise InvalidArgumentError(f"--max-len must be in 2-{engine.max_seq_len} (the context size), got {max_len}")
    path = Path(path)
    if path.is_dir():
        raise InvalidArgumentError(f"{path} is a directory; give the .onnx file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    tables = {t: (c[:max_len], s[:max_len]) for t, (c, s) in G.rope_tables(engine).items()}
    attn = G.register_export_attention()
    saved = engine.config._attn_implementation
    t0 = time.perf_counter()
    try:
        engine.config._attn_implementation = attn
        ids = torch.zeros(1, 2, dtype=torch.long)
        io = [_io("input_ids", "int64", ["batch", "seq_len"]), _io("attention_mask", "int64", ["batch", "seq_len"])]
        with torch.no_grad():
            _export_one(G.WholeModelGraph(engine, tables), (ids, torch.ones_like(ids)), path, io,
                        [_io("logits", "float32", ["batch", "seq_len", engine.config.vocab_size])])
    finally:
        engine.config._attn_implementation = saved
    return {"path": str(path), "bytes": path.stat().st_size, "seconds": round(time.perf_counter() - t0, 2),
            "max_len": max_len}


def export_onnx(engine, out_dir, groups=None, laser=None, max_batch: int = 1, max_len: int | None = None,
                progress: bool = True, tokenizer=None, packed=None, accuracy_level: int = 4) -> dict:
    """Export ``engine``'s model (float32, dense weights) to ``out_dir``; returns the manifest (also written as
    ``manifest.json``).

    Args:
        groups: layer groups spec (:func:`laserlm.depth.make_groups`; default: the laser file's, else groups of 5).
        laser: path of a laser file (``laserlm calibrate``): its trained exit heads are exported, its gates and
            calibrated thresholds recorded, and the file copied next to the graphs.
        max_batch: declared maximum batch (seed 004 §3.1: 1.2x the peak concurrency).
        max_len: declared maximum context (past + new tokens), default the engine's context size.
        tokenizer: saved under ``tokenizer/`` (default: the loaded model's).
        packed: ``None`` (float32 weights), or an :class:`~laserlm.runtime.engine.Engine` of the same model with
            packed weights (``load(..., weights="native"|"int4"|"int8").engine``, or
            :func:`laserlm.models.packing.pack_model`): its blocks replace the float matrices (``MatMulNBits``).
        accuracy_level: ``MatMulNBits``' compute: 4 = int8 activations (default), 0 = float32 (exact).

    Raises:
        InvalidArgumentError: see the module docstring.
    """
    from ..depth import load_laser_file, make_groups  # noqa: PLC0415
    from ..models.weights_hash import weights_sha256  # noqa: PLC0415

    if engine.dtype != torch.float32 or getattr(engine, "_packed", None):
        raise InvalidArgumentError("ONNX export needs the float32 dense weights: load with --weights fp32 "
                                   f"(this model runs {engine.weights})")
    max_len = engine.max_seq_len if max_len is None else int(max_len)
    if not 2 <= max_len <= engine.max_seq_len:
        raise InvalidArgumentError(f"--max-len must be in 2-{engine.max_seq_len} (the context size), got {max_len}")
    if not is_int(max_batch) or max_batch < 1:
        raise InvalidArgumentError(f"--max-batch must be a positive integer, got {max_batch!r}")
    if packed is not None:  # before the export, which takes seconds to minutes
        _check_packed(engine, packed, accuracy_level)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"--out {out} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    art = load_laser_file(laser, engine) if laser is not None else None
    cfg_file = art.config if art else {}
    lg = make_groups(groups if groups is not None else cfg_file.get("groups"), engine.num_layers,
                     cfg_file.get("min_depth"))
    a = engine.adapter
    cfg = engine.config
    d, n_kv, hd, V = cfg.hidden_size, a.num_kv_heads, a.head_dim, cfg.vocab_size
    first_exit = min(lg.exit_points) if lg.exit_points else engine.num_layers
    tables = G.rope_tables(engine)
    hidden_io = _io("hidden", "float32", ["batch", "new_tokens", d])
    pos_io = _io("positions", "int64", ["batch", "new_tokens"])

    jobs = [("embed", lambda: G.EmbedGraph(engine), (torch.zeros(1, 2, dtype=torch.long),),
             [_io("input_ids", "int64", ["batch", "new_tokens"])], [_io("hidden", "float32", ["batch", "new_tokens", d])])]
    P, T = 3, 2  # example shapes for tracing (the axes are dynamic)
    ex_h, ex_pos = torch.randn(1, T, d), torch.arange(P, P + T).unsqueeze(0)
    group_rows = []
    for g, (s, e) in enumerate(lg.bounds):
        past = tuple(torch.randn(1, n_kv, P, hd) for _ in range(2 * (e - s)))
        jobs.append((f"group_{g}", lambda s=s, e=e: G.GroupGraph(engine, s, e, tables), (ex_h, ex_pos, *past),
                     [hidden_io, pos_io] + _layer_io(s, e, "past", n_kv, hd, "past"),
                     [_io("hidden_out", "float32", ["batch", "new_tokens", d])] +
                     _layer_io(s, e, "new", n_kv, hd, "new_tokens")))
        bridge = s >= first_exit
        if bridge:
            jobs.append((f"bridge_{g}", lambda s=s, e=e: G.BridgeGraph(engine, s, e, tables), (ex_h, ex_pos),
                         [hidden_io, pos_io], _layer_io(s, e, "new", n_kv, hd, "new_tokens")))
        group_rows.append({"index": g, "start": s, "stop": e, "graph": f"group_{g}",
                           "bridge": f"bridge_{g}" if bridge else None, "can_exit": lg.can_exit(g),
                           "layer_types": a.layer_types[s:e]})
    jobs.append(("head", lambda: G.HeadGraph(engine), (ex_h,), [hidden_io],
                 [_io("logits", "float32", ["batch", "new_tokens", V])]))
    exits = []
    for layer in lg.exit_points:
        head = art.heads.get(layer) if art else None
        name = None
        if head is not None and head.kind != "none":
            name = f"exit_{layer}"
            jobs.append((name, lambda head=head: G.AdapterGraph(head), (ex_h,), [hidden_io],
                         [_io("hidden_out", "float32", ["batch", "new_tokens", d])]))
        exits.append({"layer": layer, "group": lg.group_ending_at(layer), "adapter": name,
                      "head": head.config_dict() if head is not None else None})

    attn_name = G.register_export_attention()
    old_impl = cfg._attn_implementation
    graphs = {}
    t_all = time.perf_counter()
    from tqdm.auto import tqdm  # noqa: PLC0415

    try:
        cfg._attn_implementation = attn_name
        with torch.no_grad():
            for name, build, args, inputs, outputs in tqdm(jobs, desc="export onnx", unit="graph",
                                                           disable=not progress):
                t0 = time.perf_counter()
                path = out / f"{name}.onnx"
                _export_one(build(), args, path, inputs, outputs)
                graphs[name] = {"file": path.name, "inputs": inputs, "outputs": outputs,
                                "bytes": path.stat().st_size, "sha256": file_sha256(path),
                                "export_s": round(time.perf_counter() - t0, 3)}
    finally:
        cfg._attn_implementation = old_impl
    quantized = None
    if packed is not None:
        quantized = _quantize_graphs(engine, packed, out, graphs, accuracy_level)
    laser_meta = None
    if art is not None:
        shutil.copyfile(laser, out / "laser.safetensors")
        laser_meta = {"file": "laser.safetensors", "source": str(laser), "thresholds": art.thresholds,
                      "config": art.config, "gates": sorted(art.gates), "heads": sorted(art.heads),
                      "router": art.router is not None}
    tok = tokenizer if tokenizer is not None else engine.tokenizer
    if tok is not None:
        tok.save_pretrained(str(out / "tokenizer"))
    from ..runtime.generate import eos_token_ids  # noqa: PLC0415

    ident = dict(engine.loaded.identity) if engine.loaded is not None else {"model_type": cfg.model_type}
    manifest = {
        "format_version": MANIFEST_VERSION,
        "exporter": EXPORTER, "opset": OPSET, "torch": torch.__version__,
        "model": {"identity": ident, "weights_sha256": weights_sha256(engine.model), "model_type": cfg.model_type,
                  "num_layers": engine.num_layers, "hidden_size": d, "num_kv_heads": n_kv, "head_dim": hd,
                  "vocab_size": V, "layer_types": list(a.layer_types),
                  "sliding_window": getattr(cfg, "sliding_window", None),
                  "eos_token_ids": sorted(eos_token_ids(engine.model, tok)),
                  "bos_token_id": getattr(tok, "bos_token_id", None) if tok is not None else None},
        "dtype": "float32", "weights": _weights_name(packed), "quantized": quantized,
        "shapes": {"batch": [1, max_batch], "new_tokens": [1, max_len], "past": [0, max_len - 1],
                   "max_len": max_len, "note": "past + new_tokens <= max_len; positions < max_len"},
        "groups": group_rows, "min_depth": lg.min_depth, "groups_spec": lg.describe(),
        "exits": exits, "laser": laser_meta, "graphs": graphs,
        "tokenizer": "tokenizer" if tok is not None else None,
        "export_seconds": round(time.perf_counter() - t_all, 2),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def _quantize_graphs(engine, packed, out: Path, graphs: dict, accuracy_level: int) -> dict:
    """Put ``packed``'s blocks into the graph files (:mod:`laserlm.export.quantize`); updates ``graphs``' sizes and
    hashes; returns ``{"accuracy_level", "matrices": {format: count}, "float_matmuls": count}``.

    Raises:
        InvalidArgumentError: no graph matrix has ``packed``'s blocks.
    """
    from . import quantize as Q  # noqa: PLC0415

    index, blocks = Q.weight_index(engine.model), Q.packed_blocks(packed.model)
    formats, kept = {}, 0
    for name, g in graphs.items():
        if not (name.startswith(("group_", "bridge_")) or name == "head"):
            continue
        path = out / g["file"]
        r = Q.quantize_graph(path, index, blocks, accuracy_level)
        kept += r["float"]
        for fmt in r["quantized"].values():
            formats[fmt] = formats.get(fmt, 0) + 1
        g["bytes"], g["sha256"] = path.stat().st_size, file_sha256(path)
    if not formats:
        raise InvalidArgumentError(f"no matrix of the exported graphs has {_weights_name(packed)} blocks")
    return {"accuracy_level": accuracy_level, "matrices": formats, "float_matmuls": kept}


def _check_packed(engine, packed, accuracy_level: int) -> None:
    """Raises InvalidArgumentError: ``packed`` has no packed layers or is another model than ``engine``'s, or
    ``accuracy_level`` is not one of :data:`laserlm.export.quantize.ACCURACY_LEVELS`."""
    from ..models.weights_hash import weights_sha256  # noqa: PLC0415
    from .quantize import check_accuracy_level  # noqa: PLC0415

    check_accuracy_level(accuracy_level)
    if not getattr(packed, "_packed", None):
        raise InvalidArgumentError(f"packed weights must be native, int4 or int8, not {packed.weights}")
    if weights_sha256(packed.model) != weights_sha256(engine.model):
        raise InvalidArgumentError("the packed model is not the exported one (weight hash differs)")


def _weights_name(packed) -> str:
    """The manifest's ``weights``: ``fp32``, the packed engine's format, or ``packed`` (packed outside the loader)."""
    from ..models.quant import QUANTIZED_FORMATS  # noqa: PLC0415

    if packed is None:
        return "fp32"
    return packed.weights if packed.weights in QUANTIZED_FORMATS else "packed"
