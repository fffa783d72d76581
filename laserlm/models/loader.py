"""Load a causal LM and its tokenizer from a bundled name, a GGUF file, a local directory or a hub id.

A GGUF file's config and tokenizer are read by transformers once (10-45 s, mostly tokenizer conversion) and cached
under :func:`cache_root`, keyed by the file's path, size and modification time. With ``--weights native`` (the
default for GGUF files) the model is then built on the meta device and packed straight from the file
(:mod:`laserlm.models.gguf_native`): no float copy. Float and re-quantized formats need transformers' dequantized
float32 copy, written once beside the config (``model.safetensors``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CorruptModelError, InvalidArgumentError, ModelNotFoundError, UnsupportedArchitectureError
from .cache import cache_root
from .dtypes import check_offered_dtype
from .files import atomic_write
from .registry import BUNDLED
from .tokenizer_probe import warn_on_round_trip_failure

SUPPORTED_MODEL_TYPES = {
    "llama": "Llama (SmolLM2, Llama 2/3)",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma3 text",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

CONVERTED_FORMAT_VERSION = 1


@dataclass
class LoadedModel:
    """A loaded Hugging Face causal LM plus what laserlm needs to know about it.

    Attributes:
        model: the transformers ``*ForCausalLM`` module, in eval mode, gradients off.
        tokenizer: its tokenizer.
        name: the name the user asked for (bundled name, path or hub id).
        path: the directory the weights were read from (the converted copy for GGUF files).
        dtype: parameter dtype.
        identity: a JSON-able description used to check that artifacts belong to this model.
        weights: the weight format in use (``fp32``, ``bf16``, ``int8``, ``int4``, ``native``).
        pack_report: a :class:`~laserlm.models.packing.PackReport` for packed formats, else ``None``.
        load_seconds: wall-clock seconds of :func:`load_model`.
        prefill_dtype: dtype of the quantized matrices' products over many rows (float32 for float weights).
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    path: Path
    dtype: torch.dtype
    identity: dict = field(default_factory=dict)
    weights: str = "fp32"
    pack_report: object = None
    load_seconds: float = 0.0
    prefill_dtype: torch.dtype = torch.float32

    @property
    def config(self):
        return self.model.config


def known_models_text() -> str:
    return ", ".join(BUNDLED)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise InvalidArgumentError(f"unsupported dtype {dtype}; choose one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"unsupported dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _quiet_transformers():
    """Silence transformers' info/warning chatter and its GGUF progress bars while we load."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CorruptModelError(f"{path} is not a GGUF file (bad magic bytes {magic!r})")


def _gguf_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{CONVERTED_FORMAT_VERSION}"
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def converted_dir_for(gguf_path: Path) -> Path:
    return cache_root() / "converted" / f"{gguf_path.stem}-{_gguf_key(gguf_path)}"


def convert_gguf(gguf_path: str | Path, progress: bool = True, float_copy: bool = True) -> Path:
    """Cache a GGUF file's config and tokenizer (once), and with ``float_copy`` its dequantized weights.

    The directory (:func:`converted_dir_for`) holds ``config.json``, the tokenizer files and ``laserlm_source.json``;
    ``model.safetensors``, the float32 copy transformers makes of the file, is written only when ``float_copy`` is
    true: for ``--weights fp32/bf16/int8/int4``, a LoRA delta, or a reference model in tests. ``--weights native``
    never needs it (:mod:`laserlm.models.gguf_native`), so a model larger than the machine's memory can still run.

    Returns the directory. Raises :class:`ModelNotFoundError` if the file does not exist, :class:`CorruptModelError`
    if it cannot be parsed, :class:`UnsupportedArchitectureError` if transformers cannot read its architecture,
    :class:`InvalidArgumentError` if the float copy would not fit the machine's memory.
    """
    gguf_path = Path(gguf_path)
    _check_gguf_file(gguf_path)
    out = converted_dir_for(gguf_path)
    if not (out / "laserlm_source.json").is_file():
        from .gguf_file import GGUFTensors  # noqa: PLC0415

        GGUFTensors(gguf_path)  # a damaged header or a truncated file fails here, fast and before any message
        _write_metadata(gguf_path, out, progress)
    if float_copy and not (out / "model.safetensors").is_file():
        _write_float_copy(gguf_path, out, progress)
    return out


def _gguf_errors(gguf_path: Path):
    """A context that turns transformers' and gguf's errors on a GGUF file into laserlm's."""
    import contextlib  # noqa: PLC0415

    @contextlib.contextmanager
    def ctx():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        except ValueError as exc:
            msg = str(exc)
            if "not supported" in msg or "architecture" in msg.lower():
                raise UnsupportedArchitectureError(
                    f"{gguf_path.name}: {msg.splitlines()[0]}; supported families: "
                    f"{', '.join(SUPPORTED_MODEL_TYPES.values())}"
                ) from exc
            raise CorruptModelError(f"cannot read GGUF file {gguf_path}: {msg.splitlines()[0]}") from exc
        except (InvalidArgumentError, UnsupportedArchitectureError, CorruptModelError):
            raise
        except Exception as exc:  # gguf's reader raises assorted errors on damaged files
            raise CorruptModelError(f"cannot read GGUF file {gguf_path}: {type(exc).__name__}: {exc}") from exc

    return ctx()


def _write_metadata(gguf_path: Path, out: Path, progress: bool) -> None:
    """Config, generation config and tokenizer of a GGUF file into ``out`` (atomically: a temporary directory
    renamed), read from its metadata by transformers; no tensor is read."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # noqa: PLC0415

    if progress:
        print(f"laserlm: reading {gguf_path.name}'s config and tokenizer (once) ...", file=sys.stderr)
    t0 = time.perf_counter()
    _quiet_transformers()
    with _gguf_errors(gguf_path):
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    source = {
        "gguf": str(gguf_path.resolve()),
        "size": gguf_path.stat().st_size,
        "format_version": CONVERTED_FORMAT_VERSION,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (tmp / "laserlm_source.json").write_text(json.dumps(source, indent=2))
    if out.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)


def _write_float_copy(gguf_path: Path, out: Path, progress: bool) -> None:
    """``out/model.safetensors``: the float32 model transformers dequantizes from the file (written to a temporary
    name, then renamed). Refused before loading when float32 weights would not fit the machine's memory."""
    from safetensors.torch import save_model  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from .gguf_native import check_fits_memory, float_size_estimate  # noqa: PLC0415

    check_fits_memory(float_size_estimate(gguf_path), f"float32 weights of {gguf_path.name}",
                      "open it with --weights native (the file's own quantization, no float copy)")
    if progress:
        print(f"laserlm: converting {gguf_path.name} to a cached float copy (once) ...", file=sys.stderr)
    _quiet_transformers()
    with _gguf_errors(gguf_path):
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    atomic_write(out / "model.safetensors", lambda tmp: save_model(model, str(tmp)))


def _check_architecture(model_dir: Path, label: str) -> str:
    from transformers import AutoConfig  # noqa: PLC0415

    if not (Path(model_dir) / "config.json").is_file():
        raise ModelNotFoundError(f"{label}: directory {model_dir} has no config.json (not a model directory)")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise CorruptModelError(f"cannot read the config of {label}: {str(exc).splitlines()[0]}") from exc
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{label}: architecture '{model_type}' is not supported; supported families: "
            f"{', '.join(SUPPORTED_MODEL_TYPES.values())} (model_type {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return model_type


def resolve(name: str, progress: bool = True, float_copy: bool = True) -> Path | str:
    """Map a user's model name to a loadable directory (or a hub id string); for a GGUF file, its converted
    directory, with the float copy only when ``float_copy`` (:func:`convert_gguf`)."""
    if name in BUNDLED:
        return convert_gguf(BUNDLED[name].locate(), progress=progress, float_copy=float_copy)
    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not p.exists():
            raise ModelNotFoundError(f"GGUF file not found: {name} (bundled models: {known_models_text()})")
        return convert_gguf(p, progress=progress, float_copy=float_copy)
    if p.is_dir():
        return p
    if p.is_file():
        raise CorruptModelError(f"{name} is a file but not a .gguf file; pass a model directory or a .gguf file")
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if looks_like_hub_id:
        return name
    raise ModelNotFoundError(
        f"unknown model '{name}'; bundled models: {known_models_text()} "
        "(or pass a local model directory, a .gguf file or a Hugging Face hub id)"
    )


def _tokenizer_dir_on_disk(name: str) -> Path | None:
    """The directory holding ``name``'s tokenizer files when it exists without converting or loading
    anything: the cached converted copy of a bundled model / GGUF file, or a model directory; else ``None``."""
    try:
        if name in BUNDLED or name.endswith(".gguf"):
            gguf = BUNDLED[name].locate() if name in BUNDLED else Path(name).expanduser()
            if not gguf.is_file():
                return None
            out = converted_dir_for(gguf)
            return out if (out / "laserlm_source.json").is_file() else None
    except (OSError, ModelNotFoundError, CorruptModelError):
        return None
    p = Path(name).expanduser()
    return p if p.is_dir() else None


def chat_template_available(name: str) -> bool | None:
    """Whether model ``name`` has a chat template, read from its tokenizer files without loading weights.

    A template is a ``chat_template.jinja`` file or ``additional_chat_templates/`` folder (transformers >= 4.50
    saves them so) or a ``chat_template`` key in ``tokenizer_config.json``; ``chat_template.json`` also counts.

    Returns:
        ``True`` / ``False``; ``None`` when unknown without loading (GGUF not converted yet, hub id, missing
        model, no ``tokenizer_config.json``): the caller then learns it from the loaded tokenizer.
    """
    where = _tokenizer_dir_on_disk(name)
    if where is None:
        return None
    if any((where / f).is_file() for f in ("chat_template.jinja", "chat_template.json")):
        return True
    if (where / "additional_chat_templates").is_dir():
        return True
    try:
        config = json.loads((where / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return bool(config.get("chat_template")) if isinstance(config, dict) else None


def reference_dir(loaded: "LoadedModel") -> Path:
    """The directory transformers loads ``loaded``'s float model from (the unmodified reference: ``laserlm bench``'s
    transformers arm, tests): for a GGUF file its converted directory, with the float copy written now if the native
    path never needed it (:func:`convert_gguf`)."""
    src = gguf_source_of(loaded.path)
    if src is not None:
        convert_gguf(src, progress=False, float_copy=True)
    return loaded.path


def gguf_source_of(where) -> Path | None:
    """The GGUF file a converted copy was made from (``None`` for other model directories)."""
    if not isinstance(where, Path):
        return None
    marker = where / "laserlm_source.json"
    if not marker.is_file():
        return None
    try:
        src = Path(json.loads(marker.read_text())["gguf"])
    except (OSError, ValueError, KeyError):
        return None
    return src if src.is_file() else None


def packed_cache_path(where, weights: str) -> Path | None:
    """Where packed weights of ``where`` are cached: beside laserlm's own converted copy of a GGUF file, else
    under ``<cache>/packed/`` keyed by the directory's path and its weight files' sizes and times; ``None`` for
    a hub id."""
    from .packing import PACK_FORMAT_VERSION  # noqa: PLC0415

    variant = "-kquants" if kquants_kept(where, weights) else ""
    return _cache_file_for(where, f"packed-{weights}{variant}-v{PACK_FORMAT_VERSION}.safetensors")


def kquants_kept(where, weights: str) -> bool:
    """Whether loading ``where`` with ``weights`` keeps K-quant matrices as they are (``LASERLM_KQUANTS=native``,
    :func:`laserlm.models.quant.kquant_mode`): native weights of a GGUF file that holds Q4_K or Q6_K tensors. Only
    then do the packed weights differ from the default conversions', so only then do the packed cache and the
    calibrated defaults need a key of their own.

    Raises:
        CorruptModelError: the source GGUF's tensor table cannot be read.
    """
    from .quant import kquant_mode  # noqa: PLC0415

    if weights != "native" or kquant_mode() != "native":
        return False
    src = gguf_source_of(where)
    if src is None:
        return False
    st = src.stat()
    return _holds_kquants(str(src), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _holds_kquants(path: str, size: int, mtime_ns: int) -> bool:
    from .gguf_file import GGUFTensors  # noqa: PLC0415
    from .quant import Q4_K, Q6_K  # noqa: PLC0415

    return any(int(t.tensor_type) in (Q4_K, Q6_K) for t in GGUFTensors(path).tensors)


def _cache_file_for(where, name: str) -> Path | None:
    """``where/name`` beside laserlm's converted copy of a GGUF file; else ``<cache>/packed/<key>-name``, the key
    made from the directory's path and its weight files' sizes and times; ``None`` for a hub id."""
    if not isinstance(where, Path):
        return None
    if (where / "laserlm_source.json").is_file():
        return where / name
    stamp = [str(where.resolve())]
    for f in sorted(where.glob("*.safetensors")) + sorted(where.glob("*.bin")):
        st = f.stat()
        stamp.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha1("|".join(stamp).encode()).hexdigest()[:16]
    d = cache_root() / "packed"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{key}-{name}"


WEIGHTS_HASH_FILE = "weights-sha256-v1.txt"


def _stored_hash(where, compute):
    """A callable giving the weights' SHA-256 (:mod:`laserlm.models.weights_hash`): the digest stored beside the
    cached weights when there is one, else ``compute()``, then stored (a read-only cache is skipped)."""
    def digest() -> str:
        path = _cache_file_for(where, WEIGHTS_HASH_FILE)
        if path is not None and path.is_file():
            stored = path.read_text().strip()
            if len(stored) == 64 and all(c in "0123456789abcdef" for c in stored):
                return stored
        value = compute()
        if path is not None:
            try:
                atomic_write(path, lambda tmp: tmp.write_text(value + "\n"))
            except OSError:  # a read-only cache: the digest is recomputed next time
                pass
        return value

    return digest


def _record_stored_weights_hash(model, where) -> None:
    """Before packing: attach the float weights' SHA-256 (:mod:`laserlm.models.weights_hash`) to ``model``, read
    from the digest stored beside the cached weights or computed now (~0.4 s for 135M parameters) and stored."""
    from .weights_hash import compute_weights_sha256, record_weights_sha256  # noqa: PLC0415

    record_weights_sha256(model, _stored_hash(where, lambda: compute_weights_sha256(model))())


def resolve_weights(weights: str | None, dtype, from_gguf: bool) -> tuple[str, torch.dtype]:
    """Pick the weight format and activation dtype from the user's ``--weights`` / ``--dtype``.

    ``weights="auto"`` (default): ``native`` for a GGUF source when no dtype is given (a GGUF file runs on
    its own quantization without flags), else dense weights in the given dtype (``float32`` by default).
    ``fp32`` / ``bf16`` are dense float weights (``fp32`` is the exact reference path). ``int8`` / ``int4``
    / ``native`` are packed block formats (:mod:`laserlm.models.packing`) with float32 activations unless
    ``dtype`` says otherwise.

    Raises:
        InvalidArgumentError: an unknown value, a dtype that contradicts ``fp32``/``bf16``, or ``native``
            for a model that is not a GGUF file.
    """
    from .quant import WEIGHT_FORMATS  # noqa: PLC0415

    weights = "auto" if weights is None else weights
    if weights not in WEIGHT_FORMATS:
        raise InvalidArgumentError(f"unknown weight format '{weights}'; choose one of {', '.join(WEIGHT_FORMATS)}")
    torch_dtype = parse_dtype(dtype) if dtype is not None else None
    if weights == "auto":
        if torch_dtype is None and from_gguf:
            return "native", torch.float32
        torch_dtype = torch_dtype or torch.float32
        return ("bf16" if torch_dtype == torch.bfloat16 else "fp32"), torch_dtype
    if weights in ("fp32", "bf16"):
        want = torch.float32 if weights == "fp32" else torch.bfloat16
        if torch_dtype is not None and torch_dtype != want:
            raise InvalidArgumentError(f"--weights {weights} stores {str(want).replace('torch.', '')} weights, "
                                       f"which contradicts --dtype {str(torch_dtype).replace('torch.', '')}")
        return weights, want
    if weights == "native" and not from_gguf:
        raise InvalidArgumentError("--weights native keeps a GGUF file's own quantization, but this model is not a "
                                   "GGUF file; use --weights int4, int8, bf16 or fp32")
    return weights, torch_dtype or torch.float32


def load_model(name: str, dtype: str | torch.dtype | None = None, progress: bool = True,
               weights: str | None = "auto", prefill_dtype: str | None = "auto", lora=None) -> LoadedModel:
    """Load a supported causal LM and its tokenizer for laserlm.

    Args:
        name: a bundled name (``laserlm models``), a ``.gguf`` file, a local directory with
            ``config.json`` + weights, or a Hugging Face hub id available in the local HF cache.
        dtype: activations (and float weights) dtype, ``"float32"`` or ``"bfloat16"``; ``None`` picks
            float32 (see :func:`resolve_weights`).
        weights: ``"auto"`` (default), ``"fp32"`` (exact parity with transformers), ``"bf16"``, ``"int8"``,
            ``"int4"`` or ``"native"`` (a GGUF file's own quantization); see :mod:`laserlm.models.quant`.
        prefill_dtype: ``"auto"`` (default), ``"int16"``, ``"float32"`` or ``"bfloat16"``: the arithmetic in which
            quantized weights multiply prompt chunks of more than 16 positions; int16 = the block kernels of a decode
            step (auto, where they are built), float32 / bfloat16 = a GEMM over the dequantized matrix
            (:func:`laserlm.models.quant.resolve_prefill_dtype`). Float weights ignore ``auto``.
        lora: a LoRA delta file (``laserlm train-backbone``, :mod:`laserlm.models.delta`) merged into the float weights
            before packing; quantized formats then quantize each adapted matrix into the format its original had
            (native: the GGUF tensor's own block format), the others stay as stored. The model's weights hash stays
            the base's; the delta's digest is recorded beside it.

    Raises:
        ModelNotFoundError: unknown name, missing file, hub id not available offline.
        CorruptModelError: unreadable config, weights or GGUF file.
        UnsupportedArchitectureError: the architecture is not one of :data:`SUPPORTED_MODEL_TYPES`, or a
            GGUF tensor type without a kernel under ``native``.
        InvalidArgumentError: unknown dtype, weight format or prefill dtype, or contradicting ones (an explicit
            ``prefill_dtype`` with float weights); a delta made for another base model.
        CorruptModelError: a damaged delta file.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    t_start = time.perf_counter()
    from .quant import QUANTIZED_FORMATS, WEIGHT_FORMATS, QuantLinear, resolve_prefill_dtype  # noqa: PLC0415

    if weights is not None and weights not in WEIGHT_FORMATS:
        resolve_weights(weights, dtype, False)  # raises the unknown-format error before any loading
    gemm_dtype = resolve_prefill_dtype(prefill_dtype)  # raises on an unknown value before any loading
    if dtype is not None:
        check_offered_dtype(dtype)  # float16 is refused with the CLI's message (laserlm.models.dtypes)
        parse_dtype(dtype)
    where = resolve(name, progress=progress, float_copy=False)
    gguf_src = gguf_source_of(where)
    asked_weights = weights
    weights, torch_dtype = resolve_weights(weights, dtype, gguf_src is not None)
    native_direct = gguf_src is not None and weights == "native" and lora is None  # no float copy needed
    if gguf_src is not None and not native_direct:
        convert_gguf(gguf_src, progress=progress, float_copy=True)
    if weights not in QUANTIZED_FORMATS:
        if prefill_dtype not in (None, "auto") and gemm_dtype is not torch.float32:  # an explicit non-fp32 choice
            chosen = "" if asked_weights == weights else f" (chosen by --weights auto with --dtype {dtype})"
            raise InvalidArgumentError(
                f"prefill dtype {prefill_dtype} applies to quantized weights (int8, int4, native), not to "
                f"--weights {weights}{chosen}: float weights multiply in their own dtype; drop --prefill-dtype, or "
                f"give --weights native / int4 / int8 for quantized weights")
        gemm_dtype = torch.float32
    _quiet_transformers()
    if isinstance(where, Path):
        model_type = _check_architecture(where, name)
    else:
        model_type = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_dtype = torch.float32 if weights in QUANTIZED_FORMATS else torch_dtype
            if native_direct:
                from transformers import AutoConfig  # noqa: PLC0415

                model = AutoConfig.from_pretrained(where)  # the config; the model is built after the checks below
            else:
                model = AutoModelForCausalLM.from_pretrained(where, dtype=load_dtype, attn_implementation="sdpa")
            tokenizer = AutoTokenizer.from_pretrained(where)
    except OSError as exc:
        if isinstance(where, str):
            raise ModelNotFoundError(
                f"model '{name}' is not a bundled name, local path or locally cached hub id "
                f"(no model hub is reachable); bundled models: {known_models_text()}"
            ) from exc
        raise CorruptModelError(f"cannot load model from {where}: {str(exc).splitlines()[0]}") from exc
    except Exception as exc:  # safetensors / torch errors on damaged weight files
        raise CorruptModelError(f"cannot load model from {where}: {type(exc).__name__}: {exc}") from exc
    model_type = model_type or (model.model_type if native_direct else model.config.model_type)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{name}: architecture '{model_type}' is not supported; supported families: "
            f"{', '.join(SUPPORTED_MODEL_TYPES.values())}"
        )
    report = None
    if native_direct:
        from .gguf_native import load_native  # noqa: PLC0415

        model, report = load_native(model, gguf_src, packed_cache_path(where, weights),
                                    stored_hash=lambda compute: _stored_hash(where, compute))
    model.eval()
    model.requires_grad_(False)
    warn_on_round_trip_failure(tokenizer, name, where)  # encode -> decode probe (laserlm.models.tokenizer_probe)
    cfg = model.config
    identity = {
        "name": name,
        "model_type": model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
    }
    merged = None
    if lora is not None:
        from .delta import merge_delta  # noqa: PLC0415

        _record_stored_weights_hash(model, where)  # the base's identity, before the merge changes the weights
        merged = merge_delta(model, lora, identity)
    if weights in QUANTIZED_FORMATS and not native_direct:
        from .packing import pack_model  # noqa: PLC0415

        _record_stored_weights_hash(model, where)
        report = pack_model(model, weights, gguf_path=gguf_src,
                            cache_path=packed_cache_path(where, weights) if merged is None else None,
                            requantize=set(merged["merged"]) if merged is not None else None)
    if weights in QUANTIZED_FORMATS:
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.prefill_dtype = gemm_dtype
        if torch_dtype != torch.float32:
            model.to(torch_dtype)
            if hasattr(model.model.embed_tokens, "blocks"):
                model.model.embed_tokens.dtype = torch_dtype
    if merged is not None:
        identity["lora"] = merged["tensors_sha256"]
    return LoadedModel(model, tokenizer, name, Path(where) if isinstance(where, Path) else Path(str(where)),
                       torch_dtype, identity, weights=weights, pack_report=report,
                       load_seconds=time.perf_counter() - t_start, prefill_dtype=gemm_dtype)
