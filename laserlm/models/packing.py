"""Pack a loaded model's matrices into a weight format (``--weights``), fusing projections.

After :func:`pack_model` every decoder layer carries a :class:`PackedLayer` (``layer.laserlm_packed``)
with three or four matrices instead of seven: ``qkv`` (q, k and v projections stacked along the output
rows), ``o``, ``gate_up`` (gate and up stacked) and ``down``. Stacking rows is exact for block formats
(every row is quantized on its own), so one kernel call reads all three projections. The transformers
modules keep working: ``q_proj`` and friends become :class:`~laserlm.models.quant.RowSlice` views of the
fused matrix (used only when the engine falls back to calling the transformers layer).

Sources of the packed weights:

- ``native``: the GGUF file's own tensors (see :func:`laserlm.models.quant.from_gguf`), with the q/k row
  permutation that transformers applies to Llama-architecture GGUF files (llama.cpp stores those rows
  interleaved for its rotary layout); the float copy is not read for these matrices.
- ``int4`` / ``int8``: the loaded float matrices, quantized round-to-nearest to Q4_1 / Q8_0. The token
  embedding is always Q8_0 (only the rows of the tokens are read, so its size costs memory, not time); the
  LM head follows the format (Q4_1 for ``int4``), so a tied model holds two copies.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import InvalidArgumentError, UnsupportedArchitectureError
from . import quant
from .quant import DenseLinear, QuantEmbedding, QuantLinear, RowSlice
from .files import write_safetensors
from .weights_hash import has_weights_sha256, weights_sha256

ATTN = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


@dataclass
class PackedLayer:
    """The fused matrices of one decoder layer.

    Attributes:
        qkv: ``[.., d] -> [.., (H + 2 H_kv) * head_dim]``.
        o: ``[.., H * head_dim] -> [.., d]``.
        gate_up: ``[.., d] -> [.., 2 * intermediate]``.
        down: ``[.., intermediate] -> [.., d]``.
        q_size, kv_size, intermediate: output split sizes.
    """

    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module
    q_size: int
    kv_size: int
    intermediate: int


@dataclass
class PackReport:
    """What :func:`pack_model` did: ``formats`` counts matrices per storage format; ``notes`` lists how
    GGUF types were taken (exact / re-quantized); ``nbytes`` is the bytes of all packed matrices,
    embedding and head included."""

    weights: str
    formats: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)
    nbytes: int = 0
    cached: bool = False

    def add(self, module: nn.Module, note: str | None = None, name: str | None = None) -> None:
        for part in getattr(module, "parts", None) or [module]:  # a fused projection of mixed formats: each part
            key = quant.FORMAT_NAMES.get(getattr(part, "fmt", None), "float32")
            self.formats[key] = self.formats.get(key, 0) + 1
        self.nbytes += module.nbytes
        if note is not None:
            self.notes[note] = self.notes.get(note, 0) + 1


class _Concat(nn.Module):
    """Matrices of different formats used as one fused projection (outputs concatenated)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.fmt = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([p.weight for p in self.parts])

    def forward(self, x):
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _bias(linears) -> torch.Tensor | None:
    if all(getattr(m, "bias", None) is None for m in linears):
        return None
    return torch.cat([m.bias.detach().float() if m.bias is not None else torch.zeros(m.out_features)
                      for m in linears])


def _fuse(parts: list[tuple[str, torch.Tensor, int | None]], k: int, bias: torch.Tensor | None) -> nn.Module:
    """One module from converted parts ``(kind, data, fmt)`` stacked along output rows."""
    kinds = {(kind, fmt) for kind, _, fmt in parts}
    if len(kinds) == 1:
        kind, _, fmt = parts[0]
        data = torch.cat([d for _, d, _ in parts]) if len(parts) > 1 else parts[0][1]
        return QuantLinear(data, fmt, k, bias) if kind == "blocks" else DenseLinear(data, bias)
    runs = []  # adjacent parts of one kind and format stacked into one matrix: one product each, not one per part
    for kind, data, fmt in parts:
        if runs and runs[-1][0] == (kind, fmt):
            runs[-1][1].append(data)
        else:
            runs.append(((kind, fmt), [data]))
    mods, row = [], 0
    for (kind, fmt), datas in runs:
        data = torch.cat(datas) if len(datas) > 1 else datas[0]
        b = None if bias is None else bias[row:row + data.shape[0]]
        mods.append(QuantLinear(data, fmt, k, b) if kind == "blocks" else DenseLinear(data, b))
        row += data.shape[0]
    return _Concat(mods)


def _from_float(w: torch.Tensor, fmt: int) -> tuple[str, torch.Tensor, int | None]:
    if w.shape[1] % quant.QK:
        return "float", w.detach().float(), None  # documented fallback: no block format fits
    return "blocks", quant.quantize_matrix(w, fmt), fmt


def _reverse_permute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (transformers' LlamaTensorProcessor)."""
    dim = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(n_rows)


class _GGUFSource:
    """Tensors of a GGUF file by name, converted for ``native`` (memory-mapped; ``path`` may be an open
    :class:`~laserlm.models.gguf_file.GGUFTensors`)."""

    def __init__(self, path, config):
        from .gguf_file import GGUFTensors  # noqa: PLC0415

        self.reader = path if isinstance(path, GGUFTensors) else GGUFTensors(path)
        self.tensors = self.reader.by_name
        self.arch = self.reader.arch
        self.config = config

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> tuple[str, torch.Tensor, int | None, str]:
        t = self.tensors[name]
        k, n = int(t.shape[0]), int(t.shape[1])
        kind, data, fmt, how = quant.from_gguf(np.asarray(t.data), int(t.tensor_type), n, k)
        if self.arch in ("llama",) and (".attn_q." in name or ".attn_k." in name):
            cfg = self.config
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            data = data[torch.from_numpy(_reverse_permute_rows(n, heads))].contiguous()
        self.reader.release(t)  # converted; a view still reads the (shared, read-only) mapping from the file
        return kind, data, fmt, f"{t.tensor_type.name}: {how}"


PACK_FORMAT_VERSION = 4  # 4: matrices in the kernel layout (groups of 16 rows)


def pack_model(model: nn.Module, weights: str, gguf_path=None, cache_path=None, requantize=None) -> PackReport:
    """Replace the decoder layers' projections, the LM head and the embedding of ``model`` in place.

    Args:
        model: a transformers causal LM of a supported family: float weights loaded, or (``native``) its projections,
            embedding and head still on ``meta`` (:mod:`laserlm.models.gguf_native`).
        weights: ``"native"`` (needs ``gguf_path``), ``"int4"`` or ``"int8"``.
        gguf_path: the GGUF file the model was converted from.
        cache_path: a ``.safetensors`` file of packed weights: read when it exists (no GGUF parsing, no
            quantization), written after packing otherwise. A damaged file is rebuilt.
        requantize: projections (``layers.<i>.<proj>``) whose float weight changed since loading (a merged delta):
            with ``native`` they are quantized round-to-nearest into the block format their GGUF tensor has, instead
            of taking the file's blocks.

    Returns:
        a :class:`PackReport` (``report.cached`` tells whether the cache was used). Before any matrix is replaced,
        the float weights' identity is recorded on ``model`` (:func:`laserlm.models.weights_hash.weights_sha256`,
        unless the loader recorded or deferred it), so laser files made on the float model load on the packed one.

    Raises:
        InvalidArgumentError: ``native`` without a GGUF source, or an unknown format.
        UnsupportedArchitectureError: a GGUF tensor type with no kernel, or a missing tensor.
    """
    if weights not in quant.QUANTIZED_FORMATS:
        raise InvalidArgumentError(f"cannot pack weights as {weights!r}; choose one of {', '.join(quant.QUANTIZED_FORMATS)}")
    if weights == "native" and gguf_path is None:
        raise InvalidArgumentError("--weights native keeps a GGUF file's own quantization, but this model was not "
                                   "loaded from a GGUF file; use --weights int4, int8, bf16 or fp32")
    if not has_weights_sha256(model):
        weights_sha256(model)  # the float checkpoint's identity, recorded before packing replaces it
    mods = None
    if cache_path is not None and Path(cache_path).is_file():
        try:
            mods, report = _load_packed(Path(cache_path), model.config.num_hidden_layers, weights)
            report.cached = True
        except Exception as exc:  # noqa: BLE001 - a damaged cache is rebuilt, never trusted
            warnings.warn(f"laserlm: ignoring a damaged packed-weights cache {cache_path} ({type(exc).__name__}: "
                          f"{exc}); packing again", RuntimeWarning, stacklevel=2)
            mods = None
    if mods is None:
        mods, report = _convert(model, weights, gguf_path, requantize or set())
        if cache_path is not None:
            _save_packed(Path(cache_path), mods, report)
    _install(model, mods)
    return report


def _convert(model, weights, gguf_path, requantize=frozenset()) -> tuple[dict, PackReport]:
    cfg = model.config
    src = _GGUFSource(gguf_path, cfg) if weights == "native" else None
    fmt = quant.Q4_1 if weights == "int4" else quant.Q8_0
    report = PackReport(weights)
    layers_out = []
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers[: cfg.num_hidden_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            groups = {}
            for owner, names, fused_name in ((attn, ATTN, "qkv"), (mlp, MLP, "gate_up"), (attn, ("o_proj",), "o"),
                                             (mlp, ("down_proj",), "down")):
                linears = [getattr(owner, n) for n in names]
                parts = []
                for n, lin in zip(names, linears):
                    if src is None:
                        parts.append(_from_float(lin.weight, fmt))
                        continue
                    name = f"blk.{i}.{GGUF_NAMES[n]}.weight"
                    if not src.has(name):
                        raise UnsupportedArchitectureError(f"GGUF file has no tensor {name}; cannot use --weights native")
                    kind, data, f, note = src.get(name)
                    if f"layers.{i}.{n}" in requantize:  # adapted weights: the original's format, new values
                        kind, data, f = _from_float(lin.weight, f) if kind == "blocks" else (
                            "float", lin.weight.detach().float(), None)
                        note = f"{note.split(':')[0]}: adapted (delta merged), re-quantized to the same format"
                    parts.append((kind, data, f))
                    report.notes[note] = report.notes.get(note, 0) + 1
                fused = _fuse(parts, linears[0].in_features, _bias(linears))
                report.add(fused)
                groups[fused_name] = fused
            layers_out.append(groups)
        embed, head = _convert_embedding_and_head(model, fmt, src, report)
    return {"layers": layers_out, "embed": embed, "head": head}, report


def _install(model, mods: dict) -> None:
    """Put packed modules into ``model``: fused matrices as ``layer.laserlm_packed``, RowSlice views for the
    transformers projections, the embedding and the head."""
    for layer, groups in zip(model.model.layers, mods["layers"]):
        attn, mlp = layer.self_attn, layer.mlp
        for owner, names, fused_name in ((attn, ATTN, "qkv"), (mlp, MLP, "gate_up"), (attn, ("o_proj",), "o"),
                                         (mlp, ("down_proj",), "down")):
            fused = groups[fused_name]
            if len(names) == 1:
                setattr(owner, names[0], fused)
                continue
            sizes = [getattr(owner, n).out_features for n in names]
            row = 0
            for n, size in zip(names, sizes):
                setattr(owner, n, RowSlice(fused, row, row + size))
                row += size
        object.__setattr__(layer, "laserlm_packed", PackedLayer(
            qkv=groups["qkv"], o=groups["o"], gate_up=groups["gate_up"], down=groups["down"],
            q_size=attn.q_proj.out_features, kv_size=attn.k_proj.out_features,
            intermediate=mlp.gate_proj.out_features))
    if mods["embed"] is not None:
        model.model.embed_tokens = mods["embed"]
    model.lm_head = mods["head"]
    # transformers re-ties lm_head to the embedding on some calls; the packed head is its own module now
    if hasattr(model.config, "tie_word_embeddings"):
        model.config.tie_word_embeddings = False


def _convert_embedding_and_head(model, fmt, src, report):
    emb = model.model.embed_tokens
    head = model.lm_head
    tied = head.weight is emb.weight or (not head.weight.is_meta and head.weight.data_ptr() == emb.weight.data_ptr())
    d = emb.weight.shape[1]
    scale = getattr(emb, "embed_scale", None)
    scale = float(scale) if scale is not None else None
    dtype = emb.weight.dtype
    head_bias = getattr(head, "bias", None)
    emb_mod = None
    if src is not None:
        kind, data, f, how = src.get("token_embd.weight")
        report.notes[how] = report.notes.get(how, 0) + 1
        if kind == "blocks":
            emb_mod = QuantEmbedding(data, f, d, scale, dtype)
        if src.has("output.weight") and not tied:
            kind_h, data_h, f_h, how_h = src.get("output.weight")
            report.notes[how_h] = report.notes.get(how_h, 0) + 1
            head_mod = _fuse([(kind_h, data_h, f_h)], d, head_bias)
        elif emb_mod is not None:
            head_mod = QuantLinear.from_qweight(emb_mod.qweight, emb_mod.fmt, d, emb_mod.num_embeddings, head_bias)
        else:
            head_mod = DenseLinear(data, head_bias)
    else:
        if d % quant.QK == 0:
            emb_mod = QuantEmbedding(quant.quantize_q8_0(emb.weight), quant.Q8_0, d, scale, dtype)
        kind, data, f = _from_float(head.weight, fmt)
        if tied and f == quant.Q8_0 and emb_mod is not None:
            head_mod = QuantLinear.from_qweight(emb_mod.qweight, quant.Q8_0, d, emb_mod.num_embeddings, head_bias)
        else:
            head_mod = _fuse([(kind, data, f)], d, head_bias)
    if emb_mod is not None:
        report.add(emb_mod)
    if not (isinstance(head_mod, QuantLinear) and emb_mod is not None and head_mod.qweight is emb_mod.qweight):
        report.add(head_mod)
    return emb_mod, head_mod


# -- the packed-weights cache (one safetensors file; module structure in its metadata) -----------------
def _record(mod, key: str, tensors: dict, shared: dict) -> dict:
    if isinstance(mod, QuantLinear) or isinstance(mod, QuantEmbedding):
        ptr = mod.qweight.data_ptr()
        if ptr in shared:
            name = shared[ptr]
        else:
            name = shared[ptr] = f"{key}.qweight"
            tensors[name] = mod.qweight
        rec = {"t": "q" if isinstance(mod, QuantLinear) else "e", "qweight": name, "fmt": mod.fmt}
        if isinstance(mod, QuantLinear):
            rec["in"], rec["out"] = mod.in_features, mod.out_features
            if mod.bias is not None:
                tensors[f"{key}.bias"] = mod.bias.data
                rec["bias"] = f"{key}.bias"
        else:
            rec.update(dim=mod.embedding_dim, rows=mod.num_embeddings, scale=mod.scale,
                       dtype=str(mod.dtype).replace("torch.", ""))
        return rec
    if isinstance(mod, DenseLinear):
        tensors[f"{key}.weight"] = mod.weight.data
        rec = {"t": "d", "weight": f"{key}.weight"}
        if mod.bias is not None:
            tensors[f"{key}.bias"] = mod.bias.data
            rec["bias"] = f"{key}.bias"
        return rec
    if isinstance(mod, _Concat):
        return {"t": "c", "parts": [_record(p, f"{key}.{j}", tensors, shared) for j, p in enumerate(mod.parts)]}
    raise TypeError(f"cannot cache module {type(mod).__name__}")


def _rebuild(rec: dict, tensors: dict):
    t = rec["t"]
    bias = tensors[rec["bias"]] if "bias" in rec else None
    if t == "q":
        return QuantLinear.from_qweight(tensors[rec["qweight"]], rec["fmt"], rec["in"], rec["out"], bias)
    if t == "e":
        return QuantEmbedding(None, rec["fmt"], rec["dim"], rec["scale"], getattr(torch, rec["dtype"]),
                              qweight=tensors[rec["qweight"]], num_embeddings=rec["rows"])
    if t == "d":
        return DenseLinear(tensors[rec["weight"]], bias)
    if t == "c":
        return _Concat([_rebuild(r, tensors) for r in rec["parts"]])
    raise ValueError(f"unknown record type {t!r}")


def _save_packed(path: Path, mods: dict, report: PackReport) -> None:
    tensors, shared = {}, {}
    meta = {"version": PACK_FORMAT_VERSION,
            "layers": [{k: _record(m, f"layers.{i}.{k}", tensors, shared) for k, m in g.items()}
                       for i, g in enumerate(mods["layers"])],
            "embed": _record(mods["embed"], "embed", tensors, shared) if mods["embed"] is not None else None,
            "head": _record(mods["head"], "head", tensors, shared),
            "report": {"weights": report.weights, "formats": report.formats, "notes": report.notes,
                       "nbytes": report.nbytes}}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta["sha1"] = _digest(tensors)
    try:
        write_safetensors(tensors, path, {"laserlm": json.dumps(meta)})
    except Exception as exc:  # noqa: BLE001 - a read-only or full cache is not an error: the next load packs again
        warnings.warn(f"laserlm: cannot write the packed-weights cache {path} ({type(exc).__name__}: {exc}); "
                      "the packed weights are used from memory", RuntimeWarning, stacklevel=3)


def _digest(tensors: dict) -> str:
    """SHA-1 over the names and bytes of all tensors (detects damaged data, not only damaged headers)."""
    h = hashlib.sha1()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().view(torch.uint8).reshape(-1).numpy())  # the buffer itself, not a copy
    return h.hexdigest()


def _load_packed(path: Path, num_layers: int, weights: str) -> tuple[dict, PackReport]:
    from safetensors import safe_open  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["laserlm"])
    if meta.get("version") != PACK_FORMAT_VERSION or len(meta["layers"]) != num_layers:
        raise ValueError("made by another laserlm version or for another model")
    if meta.get("report", {}).get("weights") != weights:
        raise ValueError(f"holds {meta.get('report', {}).get('weights')!r} weights, not {weights!r}")
    raw = load_file(str(path))
    if _digest(raw) != meta.get("sha1"):
        raise ValueError("checksum mismatch (damaged data)")
    tensors = raw
    mods = {"layers": [{k: _rebuild(r, tensors) for k, r in g.items()} for g in meta["layers"]],
            "embed": _rebuild(meta["embed"], tensors) if meta["embed"] is not None else None,
            "head": _rebuild(meta["head"], tensors)}
    r = meta["report"]
    return mods, PackReport(r["weights"], r["formats"], r["notes"], r["nbytes"])
