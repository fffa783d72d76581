"""A cheap tokenizer round-trip probe, run at load time: encode -> decode a few strings and warn on a mismatch.

Why: transformers' GGUF tokenizer conversion (``transformers.integrations.ggml`` building the fast tokenizer
from the GGUF vocabulary; 5.24 here) does not reproduce the original tokenizer for some SentencePiece
vocabularies: on a Llama-2 GGUF vocabulary 31 of 46 probe strings were identical, leading spaces were lost
in round trips. laserlm uses that converter unchanged, so it cannot fix the tokenizer, but it can
say so instead of silently scoring or generating with different token ids.

The probe strings cover what such converters get wrong: leading and repeated spaces, digits, punctuation,
newlines and tabs, multi-byte UTF-8 (accents, CJK, an emoji). A correct tokenizer decodes its own encoding
of each string back to the string (special tokens off, no clean-up of tokenization spaces).
"""

from __future__ import annotations

import warnings
from pathlib import Path

PROBE_STRINGS = (
    "Hello world",
    " Hello world",
    "  two leading spaces",
    "a  b   c",
    "The year 2024 had 366 days, not 365.",
    " 3.14159 and -42",
    "line one\nline two\ttabbed",
    "naïve café Ωμέγα",
    "日本語のテキスト",
    "emoji 🙂 end",
)


class TokenizerRoundTripWarning(UserWarning):
    """A loaded tokenizer does not decode its own encoding of a probe string back to that string."""


def round_trip_failures(tokenizer, strings=PROBE_STRINGS) -> list[tuple[str, str]]:
    """``[(string, decoded)]`` for every probe string with ``decode(encode(s)) != s``.

    Encoding uses ``add_special_tokens=False``; decoding keeps special tokens and does not clean up
    tokenization spaces, so only the tokenizer itself is tested. A tokenizer that raises on a string counts
    that string as a failure (decoded ``"<error: ...>"``).
    """
    failures = []
    for s in strings:
        try:
            ids = tokenizer(s, add_special_tokens=False)["input_ids"]
            back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except Exception as exc:  # noqa: BLE001 - a probe must never break loading
            back = f"<error: {type(exc).__name__}: {exc}>"
        if back != s:
            failures.append((s, back))
    return failures


def warn_on_round_trip_failure(tokenizer, name: str, model_dir) -> list[tuple[str, str]]:
    """Run the probe on ``tokenizer`` of model ``name`` (loaded from ``model_dir``) and warn when it fails.

    The warning (:class:`TokenizerRoundTripWarning`, one line) gives the count, the first failing string and
    its round trip, and names the upstream converter when the model was converted from a GGUF file (its
    directory holds laserlm's ``laserlm_source.json``).

    Returns:
        the failures, ``[(string, decoded)]`` (empty when the tokenizer round-trips every probe string).
    """
    failures = round_trip_failures(tokenizer)
    if failures:
        s, back = failures[0]
        from_gguf = model_dir is not None and (Path(str(model_dir)) / "laserlm_source.json").is_file()
        source = ("it was built from the GGUF vocabulary by transformers' GGUF tokenizer converter "
                  "(transformers.integrations.ggml), which does not reproduce some SentencePiece vocabularies"
                  if from_gguf else f"tokenizer class {type(tokenizer).__name__}")
        warnings.warn(
            f"laserlm: the tokenizer of {name} does not round-trip {len(failures)} of {len(PROBE_STRINGS)} probe "
            f"strings (e.g. {s!r} -> {back!r}); {source}; token ids may differ from the original tokenizer's",
            TokenizerRoundTripWarning, stacklevel=3)
    return failures
