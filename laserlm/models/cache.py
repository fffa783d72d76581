"""Where and how laserlm keeps what it builds: converted GGUF copies, assembled GGUF files, packed weights, weight
hashes, compiled kernels, calibrated defaults and per-machine measurements (one small module, so the loader, the
bundled-model registry, the kernel builder and the defaults share it without importing each other).

Calibrated defaults and per-machine measurements are built under one lock (:func:`build_lock`: one process builds,
the others wait and reuse); files of shared entries are read and written under it (:func:`cached_json_entry`), so
two processes never lose each other's entries. Files are written atomically (:func:`laserlm.models.files.atomic_write`)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def cache_root() -> Path:
    """Directory for converted models and assembled GGUF files (``$LASERLM_CACHE`` or ``~/.cache/laserlm``),
    created when missing."""
    root = Path(os.environ.get("LASERLM_CACHE", Path.home() / ".cache" / "laserlm"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def build_lock(path: Path):
    """An exclusive lock on ``path`` (one process builds a cache entry at a time; others wait, then reuse it).
    Not POSIX (no ``fcntl``): no lock.

    Raises:
        OSError: the lock file cannot be created (a read-only cache).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl  # noqa: PLC0415
        except ImportError:  # not POSIX: no lock
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_json_entry(path: Path, key: str, build, valid, refresh: bool = False):
    """``(value, cached)``: one entry of the JSON object file ``path`` (entries keyed by ``key``). ``valid(entry)``
    turns a stored entry into its value, or ``None`` when the entry is damaged or stale; on a miss (or ``refresh``)
    ``build()`` makes a new entry, which is stored and returned as ``valid(entry)``.

    The read, the build and the write happen under :func:`build_lock` on ``path.lock``: processes that want the same
    entry build it once, and no process's entry is lost to another's write. A file that is not a JSON object is
    rewritten. Where the lock cannot be taken (a read-only cache) the file is still read, and a valid entry is used;
    else the entry is built and not kept. A file that cannot be read or written is not an error either.
    Not re-entrant: a ``build`` that asks for an entry of the same file waits for itself.

    Raises:
        whatever ``build`` raises; ``ValueError`` when ``valid`` refuses what ``build`` just made.
    """
    from .files import write_json_atomic  # noqa: PLC0415

    def read() -> dict:
        try:
            saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError):  # unreadable, or damaged (not JSON, not UTF-8): rewritten when writable
            return {}
        return saved if isinstance(saved, dict) else {}

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(build_lock(path.with_name(path.name + ".lock")))
            writable = True
        except OSError:  # a read-only or missing cache directory: read what is there, keep nothing new
            writable = False
        saved = read()
        if not refresh and key in saved:
            value = valid(saved[key])
            if value is not None:
                return value, True
        entry = build()
        value = valid(entry)
        if value is None:
            raise ValueError(f"the new entry for {path.name} is not valid: {entry!r}")
        if writable:
            saved[key] = entry
            try:
                write_json_atomic(saved, path, indent=1)
            except OSError:
                pass
        return value, False
