"""The one place where laserlm finds its data (calibration text, evaluation sets, passkey essays).

A data *source* is given as one string (the ``--data`` flag of ``laserlm eval`` / ``laserlm calibrate``,
``calib=`` in a ``static`` mode, ``data=`` in library calls) and is one of:

- a **file**: used as it is (``valid.txt``, ``lambada_test.jsonl``, ...);
- a **directory**: a data directory laid out like the source checkout's ``../shared/data``; the caller's
  default file is looked up under it (e.g. ``wikitext-2/valid.txt`` for calibration);
- a **Hugging Face dataset** ``hf:NAME[:CONFIG[:SPLIT]]``, e.g. ``hf:wikitext:wikitext-2-raw-v1:validation``
  (``hf:NAME::SPLIT`` leaves the config out; without a split the caller's default split is used:
  ``validation`` for calibration, ``test`` for evaluation). Loaded with ``datasets.load_dataset(NAME, CONFIG,
  split=SPLIT)`` when the ``datasets`` package is installed; ``NAME`` may be a local dataset directory.
  The ``text`` column is read (rows joined by newlines).

When no source is given, the data directory is, in this order: ``$LASERLM_DATA`` (``$LASERLM_DATA_DIR``
is accepted as an older alias), then ``../shared/data`` next to a source checkout of laserlm (found from
this file's location; a pip-installed laserlm has none). When nothing is found, :class:`DataFileError`
names the flag to use and the environment variable.

This module is the bottom layer: it imports only the standard library and :mod:`laserlm.errors`
(``datasets`` lazily, when an ``hf:`` source is read).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import DataFileError, InvalidArgumentError

ENV_VAR = "LASERLM_DATA"
ENV_ALIASES = ("LASERLM_DATA_DIR",)
FLAG = "--data"
HF_PREFIX = "hf:"
SYNTAX = "FILE, DIR or hf:NAME[:CONFIG[:SPLIT]]"

__all__ = ["ENV_VAR", "FLAG", "HFDataset", "checkout_data_dir", "data_root", "find_data_root", "is_test_split",
           "parse_hf", "read_rows", "read_text", "resolve"]


@dataclass(frozen=True)
class HFDataset:
    """A Hugging Face ``datasets`` source: ``datasets.load_dataset(name, config, split=split)``."""

    name: str
    config: str | None = None
    split: str | None = None

    def __str__(self) -> str:
        return HF_PREFIX + ":".join([self.name, self.config or "", self.split or ""]).rstrip(":")

    def with_split(self, default: str) -> HFDataset:
        """This source with ``default`` as the split when none was given."""
        return self if self.split else HFDataset(self.name, self.config, default)


def parse_hf(spec: str) -> HFDataset | None:
    """``"hf:NAME[:CONFIG[:SPLIT]]"`` -> :class:`HFDataset`; any other string -> ``None``.

    Raises:
        InvalidArgumentError: an ``hf:`` spec without a name or with more than three fields.
    """
    if not isinstance(spec, str) or not spec.startswith(HF_PREFIX):
        return None
    parts = spec[len(HF_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3:
        raise InvalidArgumentError(f"bad Hugging Face dataset {spec!r}: expected hf:NAME[:CONFIG[:SPLIT]], "
                                   "e.g. hf:wikitext:wikitext-2-raw-v1:validation")
    parts += [""] * (3 - len(parts))
    return HFDataset(parts[0], parts[1] or None, parts[2] or None)


def checkout_data_dir() -> Path | None:
    """``../shared/data`` next to the source checkout this module runs from, or ``None``.

    A checkout is recognised by the ``pyproject.toml`` beside the ``laserlm`` package, so an installed copy
    (in ``site-packages``) never picks up an unrelated directory.
    """
    repo = Path(__file__).resolve().parents[1]
    d = repo.parent / "shared" / "data"
    return d if (repo / "pyproject.toml").is_file() and d.is_dir() else None


def _env() -> tuple[str, str] | None:
    for var in (ENV_VAR, *ENV_ALIASES):
        value = os.environ.get(var)
        if value:
            return var, value
    return None


def _root() -> tuple[Path, str] | None:
    """The default data directory and where it came from (for messages)."""
    env = _env()
    if env:
        return Path(env[1]).expanduser(), f"${env[0]}"
    d = checkout_data_dir()
    return (d, "the source checkout's ../shared/data") if d is not None else None


def find_data_root() -> Path | None:
    """The default data directory (``$LASERLM_DATA``, its alias, or the checkout's ``../shared/data``), or
    ``None`` when none is configured. The directory named by the environment is returned even if missing."""
    r = _root()
    return r[0] if r else None


def _nothing_found(what: str, flag: str) -> DataFileError:
    return DataFileError(f"no {what} found: pass {flag} {SYNTAX}, or set ${ENV_VAR} to a data directory "
                         "(a pip-installed laserlm ships no data)")


def data_root(flag: str = FLAG, what: str = "data directory") -> Path:
    """The default data directory (see :func:`find_data_root`).

    Raises:
        DataFileError: none configured, or ``$LASERLM_DATA`` names something that is not a directory
            (the message names ``flag`` and the environment variable).
    """
    r = _root()
    if r is None:
        raise _nothing_found(what, flag)
    root, source = r
    if not root.is_dir():
        raise DataFileError(f"data directory {root} (from {source}) does not exist: pass {flag} {SYNTAX} or fix "
                            f"${ENV_VAR}")
    return root


def _check_datasets(spec) -> None:
    if importlib.util.find_spec("datasets") is None:
        raise DataFileError(f"{spec} is a Hugging Face dataset, but the 'datasets' package is not installed "
                            "(pip install datasets), or pass a local FILE or DIR")


def resolve(data: str | os.PathLike | None = None, default: str | None = None, *, flag: str = FLAG,
            what: str = "data", default_split: str | None = None) -> Path | HFDataset:
    """Resolve a data source to a local path or a Hugging Face dataset.

    Args:
        data: a file, a directory or ``hf:NAME[:CONFIG[:SPLIT]]``; ``None`` = the default data directory.
        default: path of the default file (or folder) relative to a data directory, e.g.
            ``"wikitext-2/valid.txt"``; looked up under a directory ``data`` or the default directory.
            ``None``: a directory resolves to itself.
        flag: the option that sets ``data``, named in error messages (``--data``, ``calib=``, ...).
        what: what the data is for, in error messages.
        default_split: the split of an ``hf:`` source that names none.

    Returns:
        an existing :class:`~pathlib.Path`, or an :class:`HFDataset` (not loaded yet: see :func:`read_text`).

    Raises:
        DataFileError: the file or directory does not exist, holds no ``default``, nothing is configured, or an
            ``hf:`` source without the ``datasets`` package; every message names ``flag`` and ``$LASERLM_DATA``.
        InvalidArgumentError: a malformed ``hf:`` spec.
    """
    if data is not None and str(data) != "":
        hf = parse_hf(str(data))
        if hf is not None:
            _check_datasets(data)
            return hf.with_split(default_split) if default_split else hf
        p = Path(data).expanduser()
        if p.is_file():
            return p
        if p.is_dir():
            if default is None:
                return p
            if (p / default).exists():
                return p / default
            raise DataFileError(f"{what} not found: {p / default} ({flag} {p} is a directory without {default}; "
                                f"pass the file itself or a data directory laid out like ../shared/data)")
        raise DataFileError(f"{what} not found: {data} ({flag}: no such file or directory; expected {SYNTAX})")
    r = _root()
    if r is None:
        raise _nothing_found(what, flag)
    root, source = r
    p = root / default if default is not None else root
    if not p.exists():
        raise DataFileError(f"{what} not found: {p} (data directory from {source}); pass {flag} {SYNTAX} or set "
                            f"${ENV_VAR}")
    return p


def is_test_split(source: Path | HFDataset) -> bool:
    """Whether a source looks like a test split (``test.txt``, ``wiki.test.raw``, split ``test``; not
    ``latest.txt``), which calibration refuses so that reported numbers stay unseen."""
    import re  # noqa: PLC0415

    name = (source.split or "") if isinstance(source, HFDataset) else Path(source).name
    return re.search(r"(^|[^a-z])test([^a-z]|$)", name.lower()) is not None


def read_rows(source: HFDataset) -> list[dict]:
    """The rows of a Hugging Face dataset as dicts (``datasets.load_dataset(name, config, split=split)``).

    Raises:
        DataFileError: ``datasets`` is not installed, or loading fails (unknown name, no network, ...).
        InvalidArgumentError: no split given (and no default applied).
    """
    _check_datasets(source)
    if not source.split:
        raise InvalidArgumentError(f"{source}: name the split, e.g. {source}:validation")
    import datasets  # noqa: PLC0415

    try:
        ds = datasets.load_dataset(source.name, source.config, split=source.split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many unrelated types (network, config, files)
        raise DataFileError(f"cannot load Hugging Face dataset {source}: {type(exc).__name__}: {exc}") from exc
    return [dict(r) for r in ds]


def read_text(source: Path | HFDataset, column: str = "text", errors: str = "strict") -> str:
    """The text of a source: a UTF-8 file as stored, or a dataset's ``column`` rows joined by ``"\\n"``
    (a trailing newline of a row is dropped first, so a text file loaded through ``datasets`` reads back as
    the file, and WikiText's rows, which end in ``"\\n"``, as the original text). ``errors`` is the file's
    decoding error handler (``"replace"`` to read damaged text anyway).

    Raises:
        DataFileError: unreadable or non-UTF-8 file, a dataset without ``column``, or a loading failure.
    """
    if isinstance(source, HFDataset):
        rows = read_rows(source)
        if rows and column not in rows[0]:
            raise DataFileError(f"{source} has no '{column}' column (columns: {', '.join(rows[0])})")
        return "\n".join(r[column][:-1] if r[column].endswith("\n") else r[column] for r in rows)
    try:
        return Path(source).read_text(encoding="utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise DataFileError(f"{source} is not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise DataFileError(f"cannot read {source}: {exc}") from exc
