"""Passkey retrieval prompts (Mohtashami & Jaggi, "Landmark Attention", 2023) for long-context checks.

Prompt format from ``data/needle_haystack/PASSKEY_SPEC.txt`` (epfml/landmark-attention, run_test.py
``generate_prompt``): task description, garbage prefix, the information line, garbage suffix, the final
question, joined by newlines. Filler is the spec's repeated "grass is green" garbage or, with
``filler="essays"``, the Paul Graham essays of the needle-in-a-haystack corpus (a harder haystack).
Scoring: the first integer of a greedy continuation of up to 10 tokens must equal the pass key.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
GARBAGE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"
ESSAYS = "needle_haystack/gkamradt_PaulGrahamEssays"  # under the data directory (see laserlm.data)


def filler_text(kind: str = "garbage", essays_dir: Path | str | None = None) -> str:
    """The haystack source text: ``"garbage"`` (spec) or ``"essays"`` (all essays, sorted by name).

    ``essays_dir`` is the essays folder or a data directory holding ``needle_haystack/...``; default: the
    data directory of :mod:`laserlm.data` (``$LASERLM_DATA``).

    Raises:
        DataFileError: no essays folder found or it holds no ``*.txt``; ValueError: unknown ``kind``.
    """
    if kind == "garbage":
        return " ".join([GARBAGE] * 2000)
    if kind == "essays":
        from ..data import resolve  # noqa: PLC0415
        from ..errors import DataFileError  # noqa: PLC0415

        if essays_dir is not None:
            d = Path(essays_dir)
            d = d / ESSAYS if (d / ESSAYS).is_dir() else d
        else:
            d = resolve(None, ESSAYS, flag="essays_dir=", what="passkey essays")
        files = sorted(d.glob("*.txt"))
        if not files:
            raise DataFileError(f"no essays (*.txt) in {d}; set $LASERLM_DATA to a data directory with {ESSAYS}")
        return " ".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    raise ValueError(f"unknown filler {kind!r}")


def passkey_prompt(tokenizer, num_tokens: int, pass_key: int, depth: float, filler: str = "garbage") -> str:
    """A passkey prompt of about ``num_tokens`` tokens with the key at relative ``depth`` in [0, 1].

    The garbage length in characters is searched so that the tokenized prompt is at most ``num_tokens``.
    """
    text = filler_text(filler)

    def build(n_garbage: int) -> str:
        n_prefix = int(n_garbage * depth)
        prefix = text[:n_prefix]
        suffix = text[n_prefix:n_garbage] if filler == "essays" else text[:n_garbage - n_prefix]
        info = f"The pass key is {pass_key}. Remember it. {pass_key} is the pass key."
        return "\n".join([TASK, prefix, info, suffix, QUESTION])

    lo, hi = 0, min(len(text), num_tokens * 8)
    while lo < hi:  # largest garbage length whose prompt fits
        mid = (lo + hi + 1) // 2
        if len(tokenizer(build(mid))["input_ids"]) <= num_tokens:
            lo = mid
        else:
            hi = mid - 1
    return build(lo)


def passkey_cases(n: int, seed: int = 0) -> list[tuple[int, float]]:
    """``n`` (pass_key, depth) pairs: keys uniform in [1, 50000] (spec), depths spread over (0, 1)."""
    rng = random.Random(seed)
    return [(rng.randint(1, 50000), (i + 0.5) / n) for i in range(n)]


def first_integer(text: str) -> int | None:
    """The first integer in ``text`` (the spec's scoring), or ``None``."""
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None
