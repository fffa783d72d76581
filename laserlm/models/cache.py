"""Where laserlm keeps what it builds from models: converted GGUF copies, assembled GGUF files, packed
weights, weight hashes and compiled kernels (one small module, so the loader, the bundled-model registry
and the kernel builder share it without importing each other)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Directory for converted models and assembled GGUF files (``$LASERLM_CACHE`` or ``~/.cache/laserlm``),
    created when missing."""
    root = Path(os.environ.get("LASERLM_CACHE", Path.home() / ".cache" / "laserlm"))
    root.mkdir(parents=True, exist_ok=True)
    return root
