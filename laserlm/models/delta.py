"""Delta files: a backbone adaptation (LoRA factors, :mod:`laserlm.training.lora`) bound to the base model it adapts.

``laserlm train-backbone`` writes one; ``laserlm.load(..., lora=PATH)`` / ``--lora PATH`` (and a laser file that
names one) merge it into the float weights before packing (:func:`laserlm.models.loader.load_model`).

File format (safetensors):

- tensors ``lora.layers.<i>.<proj>.lora_A`` ``[r, in]`` and ``.lora_B`` ``[out, r]`` (bfloat16), and the exit adapters
  trained with them, ``heads.<exit>.weight`` ``[d, d]`` / ``heads.<exit>.bias`` ``[d]`` (bfloat16);
- metadata ``laserlm_delta`` (JSON): ``{"format": "laserlm-delta", "version": 1, "identity": {...}, "weights_sha256":
  <the base model's weights hash>, "rank", "alpha", "targets", "exit_points", "tensors_sha256", "report": {...}}``.

The merged weight of a projection is ``W + (alpha / r) * B @ A`` computed in float64 from the stored factors. A delta
whose base hash is not the loaded model's is refused (:func:`check_base`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import CorruptModelError, InvalidArgumentError
from .files import write_safetensors

FORMAT = "laserlm-delta"
VERSION = 1
META_KEY = "laserlm_delta"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_OWNER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ATTRIBUTE = "laserlm_delta_sha256"  # set on a model whose weights carry a merged delta
PATH_ATTRIBUTE = "laserlm_delta_path"   # the file it came from (a laser file made on the model names it)


def tensors_sha256(tensors: dict) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of ``tensors`` in name order (detects damaged files)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_delta(path, factors: dict, adapters: dict, meta: dict) -> Path:
    """Write a delta file.

    Args:
        factors: ``{"layers.<i>.<proj>.lora_A" | ".lora_B": tensor}`` (:func:`laserlm.training.lora.lora_factors`).
        adapters: ``{"<exit>.weight": [d, d], "<exit>.bias": [d]}`` exit adapters (may be empty).
        meta: ``identity``, ``weights_sha256`` (the base), ``rank``, ``alpha``, ``targets``, ``exit_points``,
            ``report``.
    """
    tensors = {f"lora.{k}": v.detach().to(torch.bfloat16).contiguous() for k, v in factors.items()}
    tensors.update({f"heads.{k}": v.detach().to(torch.bfloat16).contiguous() for k, v in adapters.items()})
    doc = {"format": FORMAT, "version": VERSION, **meta, "tensors_sha256": tensors_sha256(tensors)}
    path = Path(path)
    return write_safetensors(tensors, path, {META_KEY: json.dumps(doc)})


def read_delta(path) -> tuple[dict, dict, dict]:
    """``(factors, adapters, meta)`` of a delta file (factors and adapters as float32).

    Raises:
        InvalidArgumentError: no such file.
        CorruptModelError: not a safetensors file, not a delta file, another version, or damaged tensors.
    """
    from safetensors import safe_open  # noqa: PLC0415

    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"delta file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types on a damaged file
        raise CorruptModelError(f"{path} is not a readable delta file ({type(exc).__name__}: {exc})") from exc
    if raw is None:
        raise CorruptModelError(f"{path} is not a laserlm delta file (no '{META_KEY}' metadata; laser files and "
                                "draft heads are other kinds of file)")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CorruptModelError(f"{path}: unreadable delta metadata ({exc})") from exc
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CorruptModelError(f"{path}: delta format {meta.get('format')!r} version {meta.get('version')!r}; this "
                                f"laserlm reads {FORMAT} version {VERSION}")
    if tensors_sha256(tensors) != meta.get("tensors_sha256"):
        raise CorruptModelError(f"{path}: the tensors do not match their recorded checksum (a damaged file)")
    factors = {k[5:]: v.float() for k, v in tensors.items() if k.startswith("lora.")}
    adapters = {k[6:]: v.float() for k, v in tensors.items() if k.startswith("heads.")}
    return factors, adapters, meta


def delta_digest(meta: dict) -> str:
    """The identity of a delta: its tensors' checksum (what a laser file made on the adapted model records)."""
    return str(meta["tensors_sha256"])


def check_base(meta: dict, base_sha256: str, identity: dict, path) -> None:
    """Refuse a delta made for another base model.

    Raises:
        InvalidArgumentError: other architecture numbers or another base weights hash.
    """
    theirs = meta.get("identity", {})
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
    if any(theirs.get(k) != identity.get(k) for k in keys) or meta.get("weights_sha256") != base_sha256:
        raise InvalidArgumentError(
            f"delta {path} adapts another model ({theirs.get('name') or theirs.get('model_type')}, base weights hash "
            f"{str(meta.get('weights_sha256'))[:12]}...), not this one ({identity.get('name')}, "
            f"{base_sha256[:12]}...); load the model it was trained on, or train a delta for this one with "
            "`laserlm train-backbone`")


def merge_factors(model, factors: dict[str, torch.Tensor], scale: float) -> list[str]:
    """Add ``scale * B @ A`` (computed in float64) to each named projection's float weight of ``model``, in place.

    Args:
        factors: ``{"layers.<i>.<proj>.lora_A": [r, in], "...lora_B": [out, r]}``.
        scale: ``alpha / r``.

    Returns the merged projection names (``layers.<i>.<proj>``).

    Raises:
        InvalidArgumentError: a factor names an unknown layer or projection, lacks its partner, or has the wrong
            shape for that projection.
    """
    decoder = model.model.layers
    names = sorted({k.rsplit(".", 1)[0] for k in factors})
    merged = []
    with torch.no_grad():
        for name in names:
            parts = name.split(".")
            if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or parts[2] not in LORA_TARGETS:
                raise InvalidArgumentError(f"delta names an unknown projection '{name}'")
            i = int(parts[1])
            if i >= len(decoder):
                raise InvalidArgumentError(f"delta names layer {i}, but the model has {len(decoder)} layers")
            a, b = factors.get(f"{name}.lora_A"), factors.get(f"{name}.lora_B")
            if a is None or b is None:
                raise InvalidArgumentError(f"delta has only one factor of '{name}'")
            lin = getattr(getattr(decoder[i], LORA_OWNER[parts[2]]), parts[2])
            w = lin.weight
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or tuple(w.shape) != (b.shape[0], a.shape[1]):
                raise InvalidArgumentError(f"delta factors of '{name}' have shapes {tuple(a.shape)} / {tuple(b.shape)}, "
                                           f"which do not fit the weight {tuple(w.shape)}")
            w.copy_((w.double() + scale * (b.double() @ a.double())).to(w.dtype))
            merged.append(name)
    return merged


def merge_delta(model, path, identity: dict) -> dict:
    """Check and merge the delta file at ``path`` into the float weights of ``model`` (before packing); records the
    delta's digest on the model (:data:`ATTRIBUTE`). Returns the delta's metadata with ``merged`` (projection names).

    Raises:
        InvalidArgumentError, CorruptModelError: see :func:`read_delta` and :func:`check_base`.
    """
    from .weights_hash import weights_sha256  # noqa: PLC0415

    factors, _, meta = read_delta(path)
    check_base(meta, weights_sha256(model), identity, path)
    merged = merge_factors(model, factors, float(meta["alpha"]) / int(meta["rank"]))
    model.__dict__[ATTRIBUTE] = delta_digest(meta)
    model.__dict__[PATH_ATTRIBUTE] = str(path)
    return {**meta, "merged": merged, "path": str(path)}


__all__ = ["LORA_OWNER", "LORA_TARGETS", "check_base", "delta_digest", "merge_delta", "merge_factors", "read_delta", "save_delta", "tensors_sha256"]
