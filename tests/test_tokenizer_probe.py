"""The load-time tokenizer round-trip probe (issue 18, "also noticed"): transformers' GGUF tokenizer conversion
loses leading spaces for some SentencePiece vocabularies; laserlm warns when a loaded tokenizer does not decode
its own encoding of the probe strings back.

The broken tokenizer is SmolLM2's own with a ``Strip`` step appended to its decoder (the ``tokenizers``
library's, dropping one leading space), the failure the report saw; its round trip is checked against the
plain ``tokenizers`` library before it is given to laserlm.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
from transformers import AutoTokenizer

from laserlm.models.loader import load_model
from laserlm.models.tokenizer_probe import PROBE_STRINGS, TokenizerRoundTripWarning, round_trip_failures


def _broken_model_dir(src, dst):
    """A model directory with ``src``'s weights (symlinked) and a tokenizer whose decoder drops a leading space."""
    dst.mkdir()
    for f in os.listdir(src):
        if f == "model.safetensors":
            os.symlink(src / f, dst / f)
        elif f != "tokenizer.json":
            shutil.copy(src / f, dst / f)
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["decoder"] = {"type": "Sequence", "decoders": [tj["decoder"], {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    return dst


def test_bundled_tokenizer_round_trips(smol):
    assert round_trip_failures(smol.tokenizer) == []
    assert any(s.startswith(" ") for s in PROBE_STRINGS) and any(ord(c) > 0xFFFF for s in PROBE_STRINGS for c in s)


def test_probe_finds_lost_leading_spaces(smol, tmp_path):
    from tokenizers import Tokenizer

    broken_dir = _broken_model_dir(smol.loaded.path, tmp_path / "broken")
    raw = Tokenizer.from_file(str(broken_dir / "tokenizer.json"))  # the tokenizers library on its own
    assert raw.decode(raw.encode(" Hello world", add_special_tokens=False).ids) == "Hello world"
    failures = dict(round_trip_failures(AutoTokenizer.from_pretrained(broken_dir)))
    assert failures[" Hello world"] == "Hello world"
    assert failures["  two leading spaces"] == " two leading spaces"
    assert "Hello world" not in failures


def test_load_warns_on_a_tokenizer_that_does_not_round_trip(smol, tmp_path):
    broken_dir = _broken_model_dir(smol.loaded.path, tmp_path / "broken")
    assert (broken_dir / "laserlm_source.json").is_file()  # converted from GGUF: the warning names the converter
    with pytest.warns(TokenizerRoundTripWarning, match=r"does not round-trip \d+ of .*GGUF tokenizer converter"):
        load_model(str(broken_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenizerRoundTripWarning)
        load_model("smollm2-135m")  # the bundled tokenizer does not warn


@pytest.mark.slow
def test_gemma3_tokenizer_round_trips():
    import laserlm

    assert round_trip_failures(laserlm.load("gemma3-270m").tokenizer) == []
