"""What decoding a wire message (``ketch.engine.wire``) may skip, the result the same.

A frame from the engine carries a delta per request and step; most of its fields are null or a
plain scalar, and calling each field's decoder and the dataclass's keyword-parsing ``__init__``
for them costs more than parsing the JSON. ``returned_as_is`` says which values a field's
decoder would hand back unchanged, ``constructor`` builds a message as its ``__init__`` would.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any


def constructor(kind: type, fields: list[dataclasses.Field]) -> Callable[[dict], Any]:
    """What ``kind(**values)`` does for a class that ``assigns_fields_only``, without parsing
    keyword arguments: each field set, from ``values`` or its default, in field order; then
    ``__post_init__``."""
    new, post_init = object.__new__, getattr(kind, "__post_init__", None)
    template = {f.name: f.default for f in fields}  # every key, in order (a factory's: below)
    factories = [(f.name, f.default_factory) for f in fields if f.default is dataclasses.MISSING]
    factories = [(name, make) for name, make in factories if make is not dataclasses.MISSING]

    def construct(given: dict) -> Any:
        made = new(kind)
        values = template.copy()
        values.update(given)  # in field order, whatever order they came in
        if len(given) < len(template):  # fields left out at their default
            for name, make in factories:
                if name not in given:
                    values[name] = make()
        made.__dict__ = values
        if post_init is not None:
            post_init(made)
        return made

    return construct


def assigns_fields_only(kind: type, fields: list[dataclasses.Field]) -> bool:
    """Whether ``kind(**values)``, every field given, only sets each field and calls
    ``__post_init__``: its ``__init__`` is the one ``dataclasses`` wrote (compiled from a
    string), every field is an ``__init__`` argument (no InitVar either), instances keep a
    ``__dict__`` (no slots, not frozen), no ``__new__``, ``__setattr__`` or metaclass of its
    own, and no field is a descriptor on the class."""
    init = kind.__dict__.get("__init__")
    code = getattr(init, "__code__", None)
    return (
        code is not None
        and code.co_filename == "<string>"
        and code.co_varnames[1 : code.co_argcount] == tuple(f.name for f in fields)
        and len(fields) == len(kind.__dataclass_fields__)  # type: ignore[attr-defined]
        and not kind.__dataclass_params__.frozen  # type: ignore[attr-defined]
        and all("__slots__" not in k.__dict__ for k in kind.__mro__[:-1])
        and type(kind) is type  # no metaclass __call__
        and kind.__new__ is object.__new__
        and kind.__setattr__ is object.__setattr__
        and not any(hasattr(type(getattr(kind, f.name, None)), "__set__") for f in fields)
    )


PLAIN_SCALARS = frozenset({int, str, bool})
"""The types whose decoders (``wire._scalar_decoder``) return a value of exactly that type as it
is (an int in the 64-bit range); a float is checked for being finite, so it is not one."""


def returned_as_is(hint: Any) -> frozenset[type]:
    """The types of value that ``wire._decoder(hint)`` returns unchanged: null where the hint is
    optional, and ``int``/``str``/``bool`` where it is one of them or a union of them only (in a
    union with ``float``, an int would be made a float; with a list or a dataclass, tried in
    order, a scalar may still be taken as it is, but that is left to the decoder)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    options = set(args) if origin in (typing.Union, types.UnionType) else {hint}
    plain = {type(None)} if type(None) in options else set()
    scalars = options - {type(None)}
    if scalars <= PLAIN_SCALARS:
        plain |= scalars
    return frozenset(plain)
