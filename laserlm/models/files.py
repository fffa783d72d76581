"""Artifact files: their identity (:func:`file_sha256`) and how they are written (:func:`write_safetensors`:
atomically, with the permissions of the user's umask)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def file_sha256(path) -> str:
    """The SHA-256 (hex) of a file's bytes: the identity of an artifact file (exported graphs, laser files, data
    files), as opposed to :func:`laserlm.models.weights_hash.weights_sha256`, the identity of a model's weights.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_safetensors(tensors: dict, path, metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` (name -> contiguous tensor) to ``path`` as safetensors: into a temporary file beside it,
    then renamed over it (an interrupted write never leaves half a file), with mode ``0o666 & ~umask`` as any file
    the user creates (safetensors itself writes ``0o600``).

    Raises:
        OSError: the directory is not writable, or the disk is full (the temporary file is removed).
    """
    from safetensors.torch import save_file  # noqa: PLC0415

    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


__all__ = ["file_sha256", "write_safetensors"]
