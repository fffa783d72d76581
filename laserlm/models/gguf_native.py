"""Open a GGUF file on its own quantization (``--weights native``) without a float copy of its matrices.

The model's modules are built on the meta device (:func:`build_meta_model`: parameters on ``meta``, buffers such as
rotary frequencies real). Then:

1. the small float tensors (norms, q/k/v biases) are read from the file into float32 through transformers' own tensor
   processor for the architecture (so Gemma's stored ``1 + w`` norms come out as transformers has them);
2. the seven projections of every layer, the token embedding and the LM head are packed straight from the
   memory-mapped file (:func:`laserlm.models.packing.pack_model` with a GGUF source), one tensor at a time;
3. anything still on ``meta`` after packing (a float-typed embedding the kernels do not pack) is read like step 1.

No float tensor of a packed matrix's shape is made, and nothing is written beside the file but the config and
tokenizer (``laserlm.models.loader.convert_gguf``) and, as for every packed model, the packed-weights cache. Peak
memory is the packed bytes plus one tensor's conversion (a few groups of 16 rows at a time into the kernel layout).

The weights hash (:mod:`laserlm.models.weights_hash`) of such a model is taken only when something asks for it (a
laser file, a draft head, a delta): by streaming, each matrix dequantized :data:`HASH_ROWS` rows at a time in
transformers' row order (the q/k permutation of Llama-architecture files undone), which gives the digest of the float
model transformers makes from the same file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import CorruptModelError, InvalidArgumentError, UnsupportedArchitectureError
from .gguf_file import GGUFTensors
from .weights_hash import defer_weights_sha256

HASH_ROWS = 128  # rows dequantized at a time by the streaming weights hash
PACKED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def memory_available_bytes() -> int | None:
    """The kernel's ``MemAvailable`` (bytes), or ``None`` where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits_memory(nbytes: int, what: str, hint: str = "") -> None:
    """Refuse, before allocating, work that needs more memory than the machine has available.

    Args:
        nbytes: the bytes the work will hold at its peak.
        what: the work, for the message (e.g. ``"the packed weights of x.gguf"``).
        hint: what the user can do instead.

    Raises:
        InvalidArgumentError: ``nbytes`` exceeds ``MemAvailable`` (unchecked where that cannot be read, or when the
            environment variable ``LASERLM_SKIP_MEMORY_CHECK=1`` is set).
    """
    avail = memory_available_bytes()
    if avail is None or os.environ.get("LASERLM_SKIP_MEMORY_CHECK") == "1":
        return
    if nbytes > avail:
        raise InvalidArgumentError(
            f"{what} need {nbytes / 2**30:.1f} GiB, but this machine has {avail / 2**30:.1f} GiB of memory "
            f"available{'; ' + hint if hint else ''}")


def _is_packed(name: str) -> bool:
    leaf = name.rsplit(".", 2)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return True
    return len(leaf) == 3 and leaf[-1] == "weight" and leaf[-2] in PACKED


_NAME_MAP_LOCK = threading.Lock()


@contextlib.contextmanager
def _one_tensor_name_map():
    """Within the block, ``gguf.get_tensor_name_map(arch, n_blocks)`` returns one map per arguments instead of building
    a new one per call. transformers' ``get_gguf_hf_weights_map`` recurses into every submodule and builds gguf's
    ``TensorNameMap`` at each: 215 times for a 16-layer Llama, 1.5 s of a 7 s warm load on Zen 4. The map is only read
    (``get_name``), so one per (arch, layers) gives the same names. A lock keeps concurrent loads from restoring each
    other's function."""
    import gguf  # noqa: PLC0415

    with _NAME_MAP_LOCK:
        real = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real)
        try:
            yield
        finally:
            gguf.get_tensor_name_map = real


def _processor(arch: str, config):
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor  # noqa: PLC0415

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())


def _read_small(tensor, processor) -> torch.Tensor:
    """One small GGUF tensor as transformers would load it: dequantized, processed, float32, HF shape."""
    from gguf.quants import dequantize  # noqa: PLC0415

    w = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name).weights
    return torch.from_numpy(np.array(w, dtype=np.float32, copy=True))


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    old = owner._parameters[leaf]
    if tuple(value.shape) != tuple(old.shape):
        raise CorruptModelError(f"GGUF tensor for {name} has shape {tuple(value.shape)}, the config says "
                                f"{tuple(old.shape)}")
    owner._parameters[leaf] = nn.Parameter(value.to(old.dtype), requires_grad=False)


def build_meta_model(config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A transformers causal LM of ``config`` built on the ``meta`` device (no parameter memory is allocated, not even
    uninitialised), then its non-persistent buffers (rotary frequencies, Gemma's embedding scale) made real and
    filled by the model's own ``_init_weights``, as ``from_pretrained`` does for buffers no checkpoint holds.

    Raises:
        UnsupportedArchitectureError: a buffer the model's initialiser leaves on ``meta``.
    """
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        owners = []
        for name, buf in list(model.named_non_persistent_buffers()):
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            owner._buffers[leaf] = torch.empty_like(buf, device="cpu")
            if owner not in owners:
                owners.append(owner)
        with torch.no_grad():
            for owner in owners:
                model._init_weights(owner)
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise UnsupportedArchitectureError(f"{config.model_type}: buffers {left} cannot be built without weights")
    model.tie_weights()  # from_pretrained ties a tied head to the embedding; from_config on meta does not
    return model


def packed_size_estimate(gguf_path) -> int:
    """Bytes the packed model will hold: every tensor's bytes in the file, Q4_K counted as Q4_1 (+11 %; kept, 148 bytes
    per 256 weights, +2.8 %) and the types re-quantized to Q8_0 (Q5_K, Q6_K unless kept, ...) as Q8_0 (34 bytes per 32
    weights), float tensors as float32."""
    from gguf import GGMLQuantizationType as T  # noqa: PLC0415

    from .quant import kquant_mode  # noqa: PLC0415

    native = kquant_mode() == "native"

    total = 0
    for t in (gguf_path if isinstance(gguf_path, GGUFTensors) else GGUFTensors(gguf_path)).tensors:
        n = int(t.n_elements)
        if t.tensor_type in (T.Q4_0, T.Q4_1) or (t.tensor_type == T.Q4_K and not native):
            total += n // 32 * 20
        elif t.tensor_type == T.Q4_K:
            total += n // 256 * 148
        elif t.tensor_type == T.Q6_K and native:
            total += n // 256 * 210
        elif t.tensor_type in (T.F32, T.F16, T.BF16):
            total += n * 4
        else:
            total += n // 32 * 34
    return total


def float_size_estimate(gguf_path: Path) -> int:
    """Bytes of the float32 copy transformers makes of ``gguf_path`` (4 per weight), held twice at its peak
    (the dequantized tensors and the model)."""
    return 2 * 4 * sum(int(t.n_elements) for t in GGUFTensors(gguf_path).tensors)


class _StreamingHash:
    """The weights hash of :func:`laserlm.models.weights_hash.compute_weights_sha256`, computed from the GGUF file
    without a float copy (module docstring). Built before packing (it needs the float model's parameter names and
    tied weights); called later, at most once."""

    def __init__(self, model: nn.Module, reader, gguf_map: dict[str, str], arch: str, config, small: dict):
        self.entries = []  # (hf name, shape, gguf tensor or small float tensor)
        seen = set()
        tensors = {t.name: t for t in reader.tensors}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            self.entries.append((name, tuple(p.shape), small.get(name, tensors.get(gguf_map.get(name, "")))))
        self.arch, self.config = arch, config

    def __call__(self) -> str:
        from gguf.quants import dequantize  # noqa: PLC0415

        from .packing import _reverse_permute_rows  # noqa: PLC0415

        h = hashlib.sha256()
        for name, shape, src in self.entries:
            h.update(f"{name}:{shape};".encode())
            if src is None:
                raise CorruptModelError(f"the GGUF file has no tensor for {name}; cannot hash the weights")
            if isinstance(src, torch.Tensor):
                h.update(src.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
                continue
            raw = np.asarray(src.data)
            n = shape[0]
            rows = np.arange(n)
            if self.arch == "llama" and (".attn_q." in src.name or ".attn_k." in src.name):
                heads = (self.config.num_attention_heads if ".attn_q." in src.name
                         else self.config.num_key_value_heads)
                rows = _reverse_permute_rows(n, heads)
            raw = raw.reshape(n, -1)
            for r in range(0, n, HASH_ROWS):
                w = np.asarray(dequantize(raw[rows[r:r + HASH_ROWS]], src.tensor_type), dtype=np.float32)
                t = torch.from_numpy(np.ascontiguousarray(w)).reshape(-1, shape[1] if len(shape) > 1 else w.size)
                h.update(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
        return h.hexdigest()


def load_native(config, gguf_path: Path, cache_path: Path | None, stored_hash=None) -> tuple[nn.Module, object]:
    """Build the model of ``config`` from ``gguf_path`` with packed native weights (module docstring).

    Args:
        config: the transformers config read from the file's metadata.
        gguf_path: the GGUF file.
        cache_path: the packed-weights cache file (read when valid, written otherwise), or ``None``.
        stored_hash: wraps the streaming hash (e.g. to read and store the digest beside the cache:
            ``laserlm.models.loader``); the result is deferred on the model (``weights_hash.defer_weights_sha256``).

    Returns:
        ``(model, pack_report)``: the model (eval mode, gradients off, nothing on ``meta``) and the
        :class:`~laserlm.models.packing.PackReport`.

    Raises:
        InvalidArgumentError: the packed model would not fit the machine's available memory.
        CorruptModelError: a tensor the config needs is missing from the file, or has another shape.
        UnsupportedArchitectureError: a tensor type without a kernel (:func:`laserlm.models.quant.from_gguf`).
    """
    with torch.inference_mode(False):  # parameters made under a caller's inference mode could not be versioned
        return _load_native(config, gguf_path, cache_path, stored_hash)


def _load_native(config, gguf_path: Path, cache_path: Path | None, stored_hash) -> tuple[nn.Module, object]:
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map  # noqa: PLC0415

    from .packing import pack_model  # noqa: PLC0415

    reader = GGUFTensors(gguf_path)
    check_fits_memory(int(1.3 * packed_size_estimate(reader)), f"the packed weights of {gguf_path.name}",
                      "use a smaller quantization of the model (Q4_0, Q4_K_M) or a machine with more memory")
    arch = reader.arch
    model = build_meta_model(config)
    processor = _processor(arch, config)
    try:
        with _one_tensor_name_map():
            gguf_to_hf = get_gguf_hf_weights_map(model, processor)
    except NotImplementedError as exc:
        raise UnsupportedArchitectureError(f"{gguf_path.name}: {exc}") from exc
    hf_to_gguf = {hf: g for g, hf in gguf_to_hf.items()}
    tensors = reader.by_name
    small = {}
    for name, p in model.named_parameters():
        if _is_packed(name):
            continue
        t = tensors.get(hf_to_gguf.get(name, ""))
        if t is None:
            raise CorruptModelError(f"{gguf_path.name} has no tensor for {name} (expected "
                                    f"{hf_to_gguf.get(name, 'a mapped name')})")
        _set_param(model, name, _read_small(t, processor))
        small[name] = model.get_parameter(name)
    hasher = _StreamingHash(model, reader, hf_to_gguf, arch, config, small)
    defer_weights_sha256(model, stored_hash(hasher) if stored_hash is not None else hasher)
    report = pack_model(model, "native", gguf_path=reader, cache_path=cache_path)
    for name, p in list(model.named_parameters()):
        if p.is_meta:  # a float-typed tensor the kernels did not pack (e.g. an F16 embedding)
            t = tensors.get(hf_to_gguf.get(name, ""))
            if t is None:
                raise CorruptModelError(f"{gguf_path.name} has no tensor for {name}")
            _set_param(model, name, _read_small(t, processor))
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise UnsupportedArchitectureError(f"{gguf_path.name}: no weights for {', '.join(left[:5])}")
    model.eval()
    model.requires_grad_(False)
    return model, report
