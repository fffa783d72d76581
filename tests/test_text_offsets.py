"""``text_offset`` of completions' log-probabilities (serve/app.text_lengths) against the whole-prefix decode.

Reference: ``len(tokenizer.decode(ids[:i]).rstrip("\\ufffd"))`` for every prefix, the O(n²) definition, on both
bundled tokenizers (byte-level BPE and SentencePiece-style with byte fallback), over texts with multi-byte
characters split across tokens, emoji sequences, CJK, spaces, newlines and special tokens.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from laserlm.models.loader import resolve
from laserlm.serve.app import text_lengths

TEXTS = [
    "Hello, world! This is a test.",
    "  leading spaces, trailing spaces   ",
    "😶‍🌫️ emoji ZWJ sequence 👩🏽‍🚀 and flags 🇫🇷🇯🇵",
    "中文字符和日本語のテキスト，混合 English.",
    "tabs\tand\r\nwindows newlines\n\n\nand NBSP\u00a0here",
    "ünïcödé àccents, Ελληνικά, русский, עברית, العربية",
    "code: def f(x):\n    return x ** 2  # comment",
]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def tokenizer(request):
    try:
        path = resolve(request.param, progress=False, float_copy=False)
    except Exception as exc:  # noqa: BLE001  (gemma3 is an optional extra)
        pytest.skip(f"{request.param}: {exc}")
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("skip_special", [False, True])
def test_text_lengths_equal_whole_prefix_decode(tokenizer, skip_special):
    specials = [t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None]
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = specials[:1] + ids + specials[-1:] + ids[:5]  # special tokens at the start and inside
        ref = [len(tokenizer.decode(ids[:i], skip_special_tokens=skip_special).rstrip("\ufffd"))
               for i in range(len(ids) + 1)]
        assert text_lengths(tokenizer, ids, skip_special_tokens=skip_special) == ref, text


def test_text_lengths_of_byte_tokens_inside_a_character(tokenizer):
    """Tokens that are parts of one character report that character's start until it is complete."""
    ids = tokenizer("a😶‍🌫️ 𓀀𒀀𐍈 \U0001FAE8 b", add_special_tokens=False)["input_ids"]  # rare characters: byte tokens
    ref = [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids) + 1)]
    assert len(set(ref)) < len(ref)  # some token did end inside a character (else this test checks nothing)
    assert text_lengths(tokenizer, ids) == ref


@pytest.mark.parametrize("skip_special", [False, True])
def test_incremental_decoder_equals_whole_decode(tokenizer, skip_special):
    """The generation loop's incremental text equals ``decode(ids[:i])`` after every token (both sides stripped of
    the U+FFFD of an unfinished character), on the texts above and on rare characters made of byte tokens."""
    from laserlm.runtime.generate import IncrementalDecoder

    specials = [t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None]
    for text in TEXTS + ["a😶‍🌫️ 𓀀𒀀𐍈 \U0001FAE8 b"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = specials[:1] + ids + specials[-1:] + ids[:5]
        dec = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special)
        for i, t in enumerate(ids, 1):
            got = dec.push(t)
            ref = tokenizer.decode(ids[:i], skip_special_tokens=skip_special)
            assert got.rstrip("\ufffd") == ref.rstrip("\ufffd"), (text, i)
            if not ref.endswith("\ufffd"):
                assert dec.text == ref and dec.complete == i
