"""The one parser of option dataclasses: every mode's options and the attention settings.

A mode spec ``NAME:key=value,...`` (:func:`laserlm.runtime.modes.parse_spec`) gives strings; the Python API
may give typed values. :func:`from_spec` turns either into an instance of an options dataclass, converting
each field by its annotation:

- ``int``: an integer, an integral float (``64.0``) or a string (``"64"``); ``bool`` is not an integer;
- ``float``: a number or a string (``"0.9"``, ``"inf"``); ``bool`` is not a number;
- ``bool``: ``True``/``False`` or ``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off`` (any case);
- ``str``: a string (a path-like value becomes its string);
- ``Literal["a", "b"]``: one of those values (strings compared case-insensitively; the literal is returned);
- a union, e.g. ``int | Literal["auto"]`` (an integer or ``auto``, speculative's ``k=auto``): the literals
  are tried first, then the other members in order;
- ``Optional[X]`` / ``X | None``: ``None`` passes as is (a field default of ``None`` means "not given");
- ``Any`` / ``object``: passed unchanged (the mode parses it itself, e.g. adaptive's ``groups``).

A field's ``metadata`` may give ``parse`` (a function ``value -> value`` raising ``ValueError`` or
``TypeError``, used instead of the annotation) and ``expect`` (how the error message describes a good value,
e.g. ``"0 or 1"``).

Errors are :class:`~laserlm.errors.InvalidArgumentError`: unknown keys (sorted, with the known ones in field
order) and bad values. The wording is the class attributes ``UNKNOWN_MESSAGE`` and ``BAD_VALUE_MESSAGE``
(plain class attributes, not fields), format strings with the fields ``what`` (the caller's name for the
options, e.g. ``"speculative"``), ``unknown`` (``a, b``), ``quoted`` (``'a', 'b'``), ``known``, ``name``,
``value``, ``expect`` (``an integer``) and ``type`` (``int``); the defaults are :data:`UNKNOWN_MESSAGE` and
:data:`BAD_VALUE_MESSAGE`.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import types
import typing
from typing import Any, Literal, Union

from ..errors import InvalidArgumentError

UNKNOWN_MESSAGE = "unknown {what} option(s) {unknown}; known: {known}"
BAD_VALUE_MESSAGE = "{what} option {name} must be {expect}, got {value!r}"

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")

_HINTS: dict[type, dict[str, Any]] = {}


def from_spec(cls, opts: dict, what: str):
    """An instance of the dataclass ``cls`` from ``opts`` (``name -> string or value``); fields not in
    ``opts`` keep their defaults. ``what`` names the options in messages (``"adaptive"``).

    Raises:
        InvalidArgumentError: a key that is not a field of ``cls`` (the known ones are listed), or a value
            its field's type does not accept.
    """
    fields = [f for f in dataclasses.fields(cls) if f.init]
    known = [f.name for f in fields]
    unknown = sorted(set(opts) - set(known))
    if unknown:
        raise InvalidArgumentError(getattr(cls, "UNKNOWN_MESSAGE", UNKNOWN_MESSAGE).format(
            what=what, unknown=", ".join(unknown), quoted=", ".join(map(repr, unknown)), known=", ".join(known)))
    hints = _hints(cls)
    kwargs = {}
    for f in fields:
        if f.name not in opts:
            continue
        value, hint, parse = opts[f.name], hints[f.name], f.metadata.get("parse")
        try:
            kwargs[f.name] = parse(value) if parse is not None else convert(hint, value)
        except (TypeError, ValueError):
            raise InvalidArgumentError(getattr(cls, "BAD_VALUE_MESSAGE", BAD_VALUE_MESSAGE).format(
                what=what, name=f.name, value=value, expect=f.metadata.get("expect") or expect(hint),
                type=type_name(hint))) from None
    return cls(**kwargs)


def convert(hint, value):
    """``value`` (a string or a typed value) as the type ``hint`` (see the module docstring).

    Raises:
        ValueError: the value does not fit the type.
    """
    if hint is Any or hint is object:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        for lit in args:
            if value == lit or (isinstance(value, str) and isinstance(lit, str)
                                and value.strip().lower() == lit.lower()):
                return lit
        raise ValueError(value)
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        members = sorted((a for a in args if a is not type(None)), key=lambda a: typing.get_origin(a) is not Literal)
        for member in members:
            try:
                return convert(member, value)
            except (TypeError, ValueError):
                pass
        raise ValueError(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in TRUE:
            return True
        if s in FALSE:
            return False
        raise ValueError(value)
    if hint is int:
        if isinstance(value, bool):
            raise ValueError(value)
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real):
            if float(value).is_integer():
                return int(value)
            raise ValueError(value)
        if isinstance(value, str):
            return int(value.strip())
        raise ValueError(value)
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(value)
        if isinstance(value, (numbers.Real, str)):
            return float(value)
        raise ValueError(value)
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise ValueError(value)
    raise TypeError(f"options: unsupported field type {hint!r}")


def expect(hint) -> str:
    """How a message describes a good value of ``hint``: ``an integer``, ``a number``, ``true/false (1/0)``..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is Union or origin is types.UnionType:
        plain = [a for a in args if a is not type(None) and typing.get_origin(a) is not Literal]
        return " or ".join(expect(a) for a in plain) if plain else " or ".join(expect(a) for a in args
                                                                                if a is not type(None))
    return {int: "an integer", float: "a number", bool: "true/false (1/0)", str: "a string"}.get(hint, "a value")


def type_name(hint) -> str:
    """Short name of ``hint``: ``int``, ``float``, ``int or auto``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return " or ".join(map(str, args))
    if origin is Union or origin is types.UnionType:
        return " or ".join(type_name(a) for a in args if a is not type(None))
    return getattr(hint, "__name__", str(hint))


def is_int(value) -> bool:
    """Whether ``value`` is an integer and not a bool (``True`` is an ``int`` in Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """Whether ``value`` is an int or float and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _hints(cls) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


__all__ = ["BAD_VALUE_MESSAGE", "UNKNOWN_MESSAGE", "convert", "expect", "from_spec", "is_int", "is_number",
           "type_name"]
