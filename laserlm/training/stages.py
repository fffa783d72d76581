"""A small stage runner with a resume manifest (used by ``laserlm calibrate``).

A run is a list of named :class:`Stage` s, each a plain function of a shared context dict. A stage that
``saves`` writes its result to ``<work>/<name>.pt`` and is recorded in ``<work>/manifest.json`` with a
hash of everything its result depends on: its own settings (``Stage.settings(ctx)``, JSON-able) and the
hashes of the stages it reads (``Stage.after``). With ``resume=True`` a stage whose recorded hash equals
the new one is loaded instead of run; a stage whose settings changed runs again, and so does every stage
after it that reads it (its inputs' hashes changed). Without ``resume`` the manifest and the stages'
files are removed first, so every stage runs.

Manifest format (``manifest.json``)::

    {"format": "laserlm-calibrate-manifest", "version": 1,
     "stages": {"<name>": {"hash": "<sha256 hex>", "file": "<name>.pt", "seconds": 12.3}}}

A manifest that cannot be read (not JSON, another format or version) or a stage file that cannot be
loaded is not an error: it is reported with a :class:`ManifestWarning` and the affected stages run again
(the work directory is only a cache, so recomputing is always safe).
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..models.files import write_json_atomic

MANIFEST = "manifest.json"
FORMAT = "laserlm-calibrate-manifest"
VERSION = 1


class ManifestWarning(UserWarning):
    """The resume manifest or a stage checkpoint could not be used; the stage(s) run again."""


@dataclass(frozen=True)
class Stage:
    """One step of a run.

    Attributes:
        name: unique name (also the checkpoint's file name ``<name>.pt``).
        run: ``ctx -> dict | None``: computes the stage, puts what later stages need into ``ctx`` itself and
            returns what to checkpoint (when ``saves``; written with :func:`torch.save`: tensors, dicts of
            tensors, numbers, strings).
        load: ``(ctx, saved) -> None``: restores the stage from its checkpoint into ``ctx`` (default
            ``ctx.update(saved)``).
        settings: ``ctx -> JSON-able``: the settings the result depends on (besides the stages in ``after``).
        after: names of earlier stages whose results this stage reads (their hashes enter this stage's hash).
        saves: checkpoint the result; ``False`` = always run (cheap or target-specific stages).
        when: ``ctx -> bool``: whether the stage applies to this run (default: always); a stage that does not
            apply is skipped and counts as one fixed input for the stages that read it (so a reader lists every
            stage whose result it uses in ``after``, not only the nearest).
        owns: extra files in the work directory derived from this stage's result (caches); removed whenever
            the stage runs again.
    """

    name: str
    run: Callable[[dict], dict | None]
    load: Callable[[dict, dict], None] | None = None
    settings: Callable[[dict], Any] = lambda ctx: None
    after: tuple[str, ...] = ()
    saves: bool = True
    when: Callable[[dict], bool] = lambda ctx: True
    owns: tuple[str, ...] = field(default=())


def settings_hash(obj: Any) -> str:
    """SHA-256 of the canonical JSON of ``obj`` (sorted keys; non-JSON values by ``str``)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


class StageRunner:
    """Runs stages in order in ``work`` and keeps the manifest there (see the module docstring).

    Args:
        work: the work directory (created if missing).
        stages: the stages, in run order; ``after`` may name only earlier stages.
        resume: reuse finished stages whose hash is unchanged.
        say: ``str -> None`` for progress messages (e.g. "resume: heads loaded").

    After :meth:`run`, ``ran`` and ``loaded`` list the stage names that were computed / restored, and
    ``seconds`` the wall time of each stage (loading included).

    Raises:
        ValueError: duplicate stage names or an ``after`` naming a later or unknown stage (a programming
            error, not a user error).
    """

    def __init__(self, work, stages: list[Stage], resume: bool = False, say: Callable[[str], None] = lambda m: None):
        self.work = Path(work)
        self.stages = list(stages)
        self.resume = resume
        self.say = say
        seen: set[str] = set()
        for st in self.stages:
            if st.name in seen:
                raise ValueError(f"duplicate stage {st.name!r}")
            if missing := [a for a in st.after if a not in seen]:
                raise ValueError(f"stage {st.name!r} runs after unknown or later stages {missing}")
            seen.add(st.name)
        self.ran: list[str] = []
        self.loaded: list[str] = []
        self.seconds: dict[str, float] = {}
        self.hashes: dict[str, str] = {}

    @property
    def manifest_path(self) -> Path:
        return self.work / MANIFEST

    def _files(self, st: Stage) -> list[Path]:
        return [self.work / f"{st.name}.pt", *(self.work / f for f in st.owns)]

    def read_manifest(self) -> dict:
        """The recorded stages ``name -> entry``; ``{}`` when missing or unreadable (with a warning)."""
        p = self.manifest_path
        if not p.is_file():
            return {}
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
            if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise ValueError(f"not a version-{VERSION} {FORMAT}")
            stages = doc["stages"]
            if not isinstance(stages, dict) or not all(isinstance(e, dict) and "hash" in e for e in stages.values()):
                raise ValueError("malformed 'stages'")
            return stages
        except (OSError, UnicodeDecodeError, ValueError, KeyError) as exc:
            warnings.warn(f"laserlm: ignoring the unreadable resume manifest {p} ({exc}); every stage runs again",
                          ManifestWarning, stacklevel=3)
            return {}

    def _write_manifest(self, entries: dict) -> None:
        # atomic: an interrupted write never leaves half a manifest
        write_json_atomic({"format": FORMAT, "version": VERSION, "stages": entries}, self.manifest_path)

    def run(self, ctx: dict) -> dict:
        """Run (or restore) every applicable stage, updating ``ctx`` in place; returns ``ctx``."""
        self.work.mkdir(parents=True, exist_ok=True)
        if not self.resume:
            self.manifest_path.unlink(missing_ok=True)
            for st in self.stages:
                for f in self._files(st):
                    f.unlink(missing_ok=True)
        entries = self.read_manifest() if self.resume else {}
        for st in self.stages:
            inputs = {a: self.hashes[a] for a in st.after}
            if not st.when(ctx):
                self.hashes[st.name] = settings_hash({"skipped": st.name})
                entries.pop(st.name, None)
                continue
            h = settings_hash({"stage": st.name, "settings": st.settings(ctx), "inputs": inputs})
            self.hashes[st.name] = h
            t0 = time.perf_counter()
            saved = self._load(st, entries.get(st.name), h) if st.saves else None
            if saved is not None:
                (st.load or (lambda c, s: c.update(s)))(ctx, saved)
                self.loaded.append(st.name)
                self.say(f"resume: stage '{st.name}' loaded")
            else:
                entries.pop(st.name, None)
                for f in self._files(st)[1:]:  # caches derived from an older result
                    f.unlink(missing_ok=True)
                saved = st.run(ctx) or {}
                self.ran.append(st.name)
                if st.saves:
                    torch.save(saved, self.work / f"{st.name}.pt")
                    entries[st.name] = {"hash": h, "file": f"{st.name}.pt",
                                        "seconds": round(time.perf_counter() - t0, 3)}
                    self._write_manifest(entries)
            self.seconds[st.name] = time.perf_counter() - t0
        self._write_manifest({k: v for k, v in entries.items() if k in self.hashes})
        return ctx

    def _load(self, st: Stage, entry: dict | None, h: str) -> dict | None:
        if entry is None or entry.get("hash") != h:
            return None
        p = self.work / f"{st.name}.pt"
        try:
            out = torch.load(p)
            if not isinstance(out, dict):
                raise ValueError("not a dict")
            return out
        except Exception as exc:  # noqa: BLE001 - a damaged checkpoint can fail in many ways; recompute it
            warnings.warn(f"laserlm: cannot load the checkpoint {p} ({type(exc).__name__}: {exc}); stage "
                          f"'{st.name}' runs again", ManifestWarning, stacklevel=3)
            return None
