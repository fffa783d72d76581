"""The one option parser (``laserlm.runtime.options.from_spec``) on small dataclasses, and the option
dataclasses of the modes and of sparse attention that use it (no model needed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import pytest

from laserlm.attention.kernel import parse_attention
from laserlm.attention.selection import SparseConfig
from laserlm.depth import AdaptiveOptions, RoutedOptions, StaticOptions
from laserlm.errors import InvalidArgumentError
from laserlm.runtime.modes import parse_spec
from laserlm.runtime.options import from_spec
from laserlm.speculative.factory import OPTIONS, SpeculativeOptions


@dataclass
class Demo:
    n: int = 1
    x: float = 0.5
    flag: bool = False
    name: str = "a"
    maybe: Optional[int] = None
    k: Optional[Union[int, Literal["auto"]]] = None
    mode: Literal["fast", "slow"] = "fast"
    raw: Any = None
    custom: Optional[list] = field(default=None, metadata={"parse": lambda v: [int(p) for p in v.split("/")],
                                                           "expect": "numbers joined by '/'"})
    switch: bool = field(default=False, metadata={"expect": "0 or 1"})


@dataclass
class Quoted:
    UNKNOWN_MESSAGE = "no such {what} setting {quoted}"
    BAD_VALUE_MESSAGE = "{what}: {name}={value!r} is not a valid {type}"

    size: int = 4


def test_strings_are_converted_by_annotation():
    d = from_spec(Demo, {"n": "3", "x": "0.25", "flag": "yes", "name": "b", "maybe": "7", "mode": "SLOW"}, "demo")
    assert (d.n, d.x, d.flag, d.name, d.maybe, d.mode) == (3, 0.25, True, "b", 7, "slow")
    assert type(d.n) is int and type(d.x) is float


def test_missing_keys_keep_the_defaults():
    assert from_spec(Demo, {}, "demo") == Demo()
    _, opts = parse_spec("demo:n=2")
    assert from_spec(Demo, opts, "demo") == Demo(n=2)


@pytest.mark.parametrize("text, value", [
    ("1", True), ("true", True), ("True", True), ("yes", True), ("on", True), ("ON", True),
    ("0", False), ("false", False), ("no", False), ("off", False), ("Off", False),
])
def test_bool_spellings(text, value):
    assert from_spec(Demo, {"flag": text}, "demo").flag is value


def test_auto_literal_in_a_union():
    assert from_spec(Demo, {"k": "auto"}, "demo").k == "auto"
    assert from_spec(Demo, {"k": "AUTO"}, "demo").k == "auto"
    assert from_spec(Demo, {"k": "4"}, "demo").k == 4
    assert from_spec(Demo, {"k": 5}, "demo").k == 5
    with pytest.raises(InvalidArgumentError, match=r"^demo option k must be an integer, got 'four'$"):
        from_spec(Demo, {"k": "four"}, "demo")


def test_optional_accepts_none():
    assert from_spec(Demo, {"maybe": None, "k": None}, "demo").maybe is None


def test_typed_values_from_the_api_pass_through():
    d = from_spec(Demo, {"n": 3, "x": 1, "flag": True, "name": Path("f.bin"), "maybe": 2.0, "raw": [1, 2]}, "demo")
    assert (d.n, d.x, d.flag, d.name, d.maybe, d.raw) == (3, 1.0, True, "f.bin", 2, [1, 2])
    assert type(d.x) is float and type(d.maybe) is int
    assert from_spec(Demo, {"x": float("inf")}, "demo").x == float("inf")
    assert from_spec(Demo, {"x": "inf"}, "demo").x == float("inf")


def test_any_is_passed_unchanged_and_custom_parse():
    obj = object()
    assert from_spec(Demo, {"raw": obj}, "demo").raw is obj
    assert from_spec(Demo, {"custom": "1/2/3"}, "demo").custom == [1, 2, 3]
    with pytest.raises(InvalidArgumentError, match=r"^demo option custom must be numbers joined by '/', got '1/x'$"):
        from_spec(Demo, {"custom": "1/x"}, "demo")


def test_unknown_keys_list_the_known_ones():
    with pytest.raises(InvalidArgumentError) as err:
        from_spec(Demo, {"zeta": "1", "alpha": "2", "n": "1"}, "demo")
    assert str(err.value) == ("unknown demo option(s) alpha, zeta; known: n, x, flag, name, maybe, k, mode, raw, "
                              "custom, switch")


@pytest.mark.parametrize("opts, message", [
    ({"n": "three"}, "demo option n must be an integer, got 'three'"),
    ({"n": "1.5"}, "demo option n must be an integer, got '1.5'"),
    ({"n": 1.5}, "demo option n must be an integer, got 1.5"),
    ({"n": True}, "demo option n must be an integer, got True"),
    ({"x": "high"}, "demo option x must be a number, got 'high'"),
    ({"x": False}, "demo option x must be a number, got False"),
    ({"flag": "maybe"}, "demo option flag must be true/false (1/0), got 'maybe'"),
    ({"flag": 2}, "demo option flag must be true/false (1/0), got 2"),
    ({"name": 3}, "demo option name must be a string, got 3"),
    ({"mode": "medium"}, "demo option mode must be one of fast, slow, got 'medium'"),
    ({"switch": "maybe"}, "demo option switch must be 0 or 1, got 'maybe'"),
])
def test_bad_values_name_the_option_and_the_expected_kind(opts, message):
    with pytest.raises(InvalidArgumentError) as err:
        from_spec(Demo, opts, "demo")
    assert str(err.value) == message


def test_a_class_can_word_its_messages():
    with pytest.raises(InvalidArgumentError, match=r"^no such box setting 'colour'$"):
        from_spec(Quoted, {"colour": "red"}, "box")
    with pytest.raises(InvalidArgumentError, match=r"^box: size='big' is not a valid int$"):
        from_spec(Quoted, {"size": "big"}, "box")


# -- the option dataclasses of the modes and of sparse attention -------------------------------------
def test_mode_option_classes():
    a = from_spec(AdaptiveOptions, parse_spec("adaptive:threshold=0.9,patience=2,groups=0-3/4-7")[1], "adaptive")
    assert (a.threshold, a.patience, a.groups, a.policy) == (0.9, 2, "0-3/4-7", None)
    r = from_spec(RoutedOptions, parse_spec("routed:laser=a.st,confidence=0.5")[1], "routed")
    assert (r.laser, r.confidence) == ("a.st", 0.5)
    with pytest.raises(InvalidArgumentError, match="unknown option.*for mode 'adaptive': colour; known: groups, "):
        from_spec(AdaptiveOptions, {"colour": "red"}, "adaptive")
    assert from_spec(StaticOptions, {"drop": "12/13/14"}, "static").drop == [12, 13, 14]
    assert from_spec(StaticOptions, {"drop": (1, 2)}, "static").drop == [1, 2]
    with pytest.raises(InvalidArgumentError, match="static option drop must be layer indices joined by '/'"):
        from_spec(StaticOptions, {"drop": "1/a"}, "static")
    s = from_spec(SpeculativeOptions, {"k": "auto", "draft_layers": "3", "reuse": "off"}, "speculative")
    assert (s.k, s.draft_layers, s.reuse, s.threshold, s.auto) == ("auto", 3, False, None, False)
    assert OPTIONS == ("draft_layers", "k", "threshold", "reuse", "auto", "laser", "draft", "max_ngram", "min_match",
                       "adaptive", "suffix_tokens", "verify_cost", "verify_base", "batch_above", "head",
                       "head_threshold", "head_cost", "loss_budget")


def test_sparse_config_through_the_parser():
    cfg = parse_attention("sparse:block_size=32,threshold=inf,rule=mass,tau=0.9")
    assert (cfg.block_size, cfg.threshold, cfg.rule, cfg.tau) == (32, float("inf"), "mass", 0.9)
    assert parse_attention(SparseConfig(block_size=16), threshold=0).threshold == 0.0
    assert parse_attention({"block_size": 64.0}).block_size == 64
    with pytest.raises(InvalidArgumentError, match=r"^sparse attention option block_size=1.5 is not a valid int$"):
        parse_attention("sparse", block_size=1.5)
    with pytest.raises(InvalidArgumentError, match=r"^unknown sparse attention option 'foo'; known: block_size, "):
        parse_attention("sparse:foo=1")
