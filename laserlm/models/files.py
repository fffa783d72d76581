"""Artifact files: their identity (:func:`file_sha256`) and how they are written (:func:`atomic_write`, and on it
:func:`write_safetensors`, :func:`write_json_atomic` and :func:`write_torch_atomic`: atomically, with the permissions of the user's umask)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path


def file_sha256(path) -> str:
    """The SHA-256 (hex) of a file's bytes: the identity of an artifact file (exported graphs, laser files, data
    files), as opposed to :func:`laserlm.models.weights_hash.weights_sha256`, the identity of a model's weights.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def atomic_write(path, write) -> Path:
    """Write a file the way every laserlm file is written: ``write(tmp)`` fills a temporary file beside ``path``
    (its name unique to this process and thread), which gets mode ``0o666 & ~umask`` as any file the user creates and
    is then renamed over ``path``, so a reader sees the old file or the new one, never a part, and an interrupted
    write leaves no temporary behind.

    Raises:
        OSError: the directory is not writable, or the disk is full; anything ``write`` raises (the temporary file
        is removed either way).
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_safetensors(tensors: dict, path, metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` (name -> contiguous tensor) to ``path`` as safetensors, through :func:`atomic_write` (with
    the user's umask: safetensors itself writes ``0o600``).

    Raises:
        OSError: the directory is not writable, or the disk is full (the temporary file is removed).
    """
    from safetensors.torch import save_file  # noqa: PLC0415

    return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def write_json_atomic(obj, path, indent: int = 2, default=None) -> Path:
    """Write ``obj`` as JSON to ``path`` through :func:`atomic_write`. ``default``: as ``json.dumps``'s (``str`` turns
    paths and other values into strings; ``None`` refuses them).

    Raises:
        TypeError: a value JSON cannot hold, with ``default=None`` (nothing is written).
        OSError: the directory is not writable, or the disk is full (the temporary file is removed).
    """
    import json  # noqa: PLC0415

    text = json.dumps(obj, indent=indent, default=default)
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_torch_atomic(obj, path) -> Path:
    """``torch.save(obj)`` to ``path`` through :func:`atomic_write` (checkpoints, cached features).

    Raises:
        OSError: the directory is not writable, or the disk is full (the temporary file is removed).
    """
    import torch  # noqa: PLC0415

    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``, kernel 4.7+): the
    ``os.umask`` swap would let a file another thread creates meanwhile get umask 0. Elsewhere the swap, under a
    lock (which keeps two writers from saving each other's 0)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        umask = os.umask(0)
        os.umask(umask)
    return umask


__all__ = ["atomic_write", "file_sha256", "write_json_atomic", "write_safetensors", "write_torch_atomic"]
