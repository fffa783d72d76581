"""Load a causal LM and its tokenizer from a bundled name, a GGUF file, a local directory or a hub id.

GGUF files are dequantized to float by transformers (``from_pretrained(..., gguf_file=...)``), which
takes 10-45 s, mostly tokenizer conversion. The first load therefore writes a converted copy
(``config.json`` + ``model.safetensors`` + tokenizer files) under :func:`cache_root`, keyed by the
GGUF file's path, size and modification time; later loads read that copy in a few seconds.
"""

from __future__ import annotations

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
from .dtypes import check_offered_dtype
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


def cache_root() -> Path:
    """Directory for converted models and assembled GGUF files (``$LASERLM_CACHE`` or ``~/.cache/laserlm``)."""
    root = Path(os.environ.get("LASERLM_CACHE", Path.home() / ".cache" / "laserlm"))
    root.mkdir(parents=True, exist_ok=True)
    return root


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
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    path: Path
    dtype: torch.dtype
    identity: dict = field(default_factory=dict)

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


def convert_gguf(gguf_path: str | Path, progress: bool = True) -> Path:
    """Dequantize a GGUF file once and cache it as config + safetensors + tokenizer.

    Returns the directory of the converted copy. Raises :class:`ModelNotFoundError` if the file does
    not exist, :class:`CorruptModelError` if it cannot be parsed, :class:`UnsupportedArchitectureError`
    if transformers cannot read its architecture.
    """
    from safetensors.torch import save_model  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    gguf_path = Path(gguf_path)
    _check_gguf_file(gguf_path)
    out = converted_dir_for(gguf_path)
    if (out / "laserlm_source.json").is_file():
        return out
    if progress:
        print(f"laserlm: converting {gguf_path.name} to a cached float copy (once) ...", file=sys.stderr)
    t0 = time.perf_counter()
    _quiet_transformers()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
    except ValueError as exc:
        msg = str(exc)
        if "not supported" in msg or "architecture" in msg.lower():
            raise UnsupportedArchitectureError(
                f"{gguf_path.name}: {msg.splitlines()[0]}; supported families: "
                f"{', '.join(SUPPORTED_MODEL_TYPES.values())}"
            ) from exc
        raise CorruptModelError(f"cannot read GGUF file {gguf_path}: {msg.splitlines()[0]}") from exc
    except Exception as exc:  # gguf's reader raises assorted errors on damaged files
        raise CorruptModelError(f"cannot read GGUF file {gguf_path}: {type(exc).__name__}: {exc}") from exc

    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(tmp)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
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
    return out


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


def resolve(name: str, progress: bool = True) -> Path | str:
    """Map a user's model name to a loadable directory (or a hub id string)."""
    if name in BUNDLED:
        return convert_gguf(BUNDLED[name].locate(), progress=progress)
    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not p.exists():
            raise ModelNotFoundError(f"GGUF file not found: {name} (bundled models: {known_models_text()})")
        return convert_gguf(p, progress=progress)
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


def load_model(name: str, dtype: str | torch.dtype = "float32", progress: bool = True) -> LoadedModel:
    """Load a supported causal LM and its tokenizer for laserlm.

    Args:
        name: a bundled name (``laserlm models``), a ``.gguf`` file, a local directory with
            ``config.json`` + weights, or a Hugging Face hub id available in the local HF cache.
        dtype: ``"float32"`` (default; exact parity with transformers) or ``"bfloat16"``.

    Raises:
        ModelNotFoundError: unknown name, missing file, hub id not available offline.
        CorruptModelError: unreadable config, weights or GGUF file.
        UnsupportedArchitectureError: the architecture is not one of :data:`SUPPORTED_MODEL_TYPES`.
        InvalidArgumentError: unknown dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    check_offered_dtype(dtype)  # float16 is refused with the CLI's message (laserlm.models.dtypes)
    torch_dtype = parse_dtype(dtype)
    where = resolve(name, progress=progress)
    _quiet_transformers()
    if isinstance(where, Path):
        model_type = _check_architecture(where, name)
    else:
        model_type = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, attn_implementation="sdpa")
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
    model_type = model_type or model.config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{name}: architecture '{model_type}' is not supported; supported families: "
            f"{', '.join(SUPPORTED_MODEL_TYPES.values())}"
        )
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
    return LoadedModel(model, tokenizer, name, Path(where) if isinstance(where, Path) else Path(str(where)),
                       torch_dtype, identity)
