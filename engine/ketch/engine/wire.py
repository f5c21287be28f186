"""Tagged JSON, the wire format of every message between Ketch's processes (never pickle).

A message is a dataclass; on the wire it is ``{"type": <class name>, "body": <its fields>}``, so
either side can be replaced, or inspected with a plain ZMQ client, without sharing Python
objects.

Decoding never trusts the peer. One codec serves every protocol, driven by the message classes'
own type hints: the size of the frame, the nesting depth, the type of every field (``int`` is
never a bool, and fits 64 bits; ``float`` is a finite number, and NaN or an infinity is refused
wherever it appears, as JSON itself has none; lists, tuples, sets, dicts, unions,
optionals and nested dataclasses recursively), unknown and missing fields; the class's
``__post_init__`` then checks ranges. Anything that fails is a ``MessageError`` naming the
protocol and the field, for the caller to count and drop or answer: never a crash in a loop.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
import types
import typing
from collections.abc import Callable
from typing import Any

from ketch.engine.wire_shortcuts import assigns_fields_only, constructor, returned_as_is

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
"""Default frame limit: a step of a full batch of long prompts fits; a runaway peer does not."""
MAX_DEPTH = 16
"""Deepest nesting any message has is 5; JSON nested deeper is refused before it is walked."""
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1
"""Integers fit 64 bits (a seed may use the unsigned range); a huge int never reaches numpy."""


class MessageError(ValueError):
    """A frame that is not a valid message of its protocol; the text says which field and why."""


class BadMessages:
    """Counts the frames a process refused, per peer, and logs each peer at most once a minute
    (with how many it sent since), so a flood costs a counter increment, not a log line."""

    LOG_INTERVAL_S = 60.0
    MAX_PEERS = 1024  # distinct peers remembered for rate limiting; a flood of ids reuses slots

    def __init__(self, process: str) -> None:
        self.process = process
        self.total = 0
        self.by_peer: dict[str, int] = {}
        self._logged: dict[str, tuple[float, int]] = {}  # peer -> (when, count then)

    def note(self, peer: str, error: Exception | str) -> None:
        self.total += 1
        peer = peer[:128]
        if peer not in self.by_peer and len(self.by_peer) >= self.MAX_PEERS:
            peer = "(other peers)"
        count = self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
        now = time.monotonic()
        when, then = self._logged.get(peer, (-self.LOG_INTERVAL_S, 0))
        if now - when >= self.LOG_INTERVAL_S:
            self._logged[peer] = (now, count)
            more = f" (+{count - then - 1} more since the last report)" if count - then > 1 else ""
            logger.warning("%s: refused a message from %s: %s%s", self.process, peer, error, more)


def registry(*kinds: type) -> dict[str, type]:
    return {t.__name__: t for t in kinds}


def encode(message: Any) -> bytes:
    if not dataclasses.is_dataclass(message) or isinstance(message, type):
        raise TypeError(f"{type(message).__name__} is not a message")
    return json.dumps({"type": type(message).__name__, "body": message}, default=_plain).encode()


def encode_short(message: Any) -> bytes:
    """``encode``, each dataclass's fields at their default left out (``decode`` puts them
    back): the same message in fewer bytes, for a peer of the same version (the engine's
    frames to its API server, a quarter of the size and a third of the time to parse)."""
    if not dataclasses.is_dataclass(message) or isinstance(message, type):
        raise TypeError(f"{type(message).__name__} is not a message")
    body = json.dumps({"type": type(message).__name__, "body": message}, default=_plain_short)
    return body.encode()


def _plain(value: Any) -> Any:
    """What json cannot write itself: a dataclass as the object of its fields (shallow: json
    walks them, so nothing is copied first, as ``dataclasses.asdict`` would), a set sorted."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: getattr(value, name) for name, _ in _field_defaults(type(value))}
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not part of the wire format")


def _plain_short(value: Any) -> Any:
    """``_plain``, a dataclass's fields at their default left out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        body = {}
        for name, default in _field_defaults(type(value)):
            item = getattr(value, name)
            if item is not default and (type(item) is not type(default) or item != default):
                body[name] = item
        return body
    return _plain(value)


_KEPT = object()
"""The default of a field that is always written."""


@functools.cache
def _field_defaults(kind: type) -> tuple[tuple[str, Any], ...]:
    """Each field's name and the default it is left out at: one decoding gives back exactly
    (null, an int, a str, a bool; an empty list or dict made by its factory). A float is
    always written (``-0.0 == 0.0``), as is any other default."""
    defaults = []
    for f in dataclasses.fields(kind):
        default = f.default
        if f.default_factory in (list, dict):
            default = f.default_factory()
        if default is not None and type(default) not in (int, str, bool, list, dict):
            default = _KEPT
        defaults.append((f.name, default))
    return tuple(defaults)


def decode(
    data: bytes, kinds: dict[str, type], protocol: str, max_bytes: int = MAX_MESSAGE_BYTES
) -> Any:
    """The message ``data`` encodes, of one of ``kinds``; MessageError if it is not one."""
    try:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise MessageError(f"a frame is bytes, not {type(data).__name__}")
        if len(data) > max_bytes:
            raise MessageError(f"{len(data)} bytes is over the {max_bytes}-byte limit")
        try:
            raw = json.loads(bytes(data), parse_constant=_no_constant)
        except RecursionError:
            raise MessageError("nested too deeply") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MessageError(f"not JSON: {exc}") from None
        if not isinstance(raw, dict) or set(raw) != {"type", "body"}:
            raise MessageError('not a {"type": ..., "body": ...} object')
        kind = kinds.get(raw["type"]) if isinstance(raw["type"], str) else None
        if kind is None:
            raise MessageError(f"unknown message type {str(raw['type'])[:64]!r}")
        return _message(kind, raw["body"])
    except MessageError as exc:
        raise MessageError(f"malformed {protocol} message: {exc}") from None


def _no_constant(name: str) -> Any:
    """json's hook for NaN, Infinity and -Infinity, which Python writes but JSON has not."""
    raise MessageError(f"{name} is not a finite number (JSON has no NaN or Infinity)")


Decoder = Callable[[Any, int], Any]
"""Turns one decoded JSON value into the value of one type (depth: how deep it sits)."""


class _Bad(Exception):
    """A value that does not fit; ``where`` gathers its path while the error unwinds (paths are
    only built for bad input, so a good message pays nothing for them)."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.where: list[str] = []

    def text(self, root: str) -> str:
        return f"{root}{''.join(reversed(self.where))}: {self.problem}"


def _message(kind: type, body: Any) -> Any:
    try:
        return _decoder(kind)(body, 0)
    except _Bad as exc:
        raise MessageError(exc.text(kind.__name__)) from None


@functools.cache
def _decoder(hint: Any) -> Decoder:
    """The decoder of one type, built once from its hint (and cached for every message)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return lambda value, depth: value
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(args)
    if origin is list:
        return _list_decoder(args[0])
    if origin is tuple:
        return _tuple_decoder(args)
    if origin in (set, frozenset):
        items = _list_decoder(args[0])
        return lambda value, depth: origin(items(value, depth))
    if origin is dict:
        return _dict_decoder(args)
    if dataclasses.is_dataclass(hint):
        return _dataclass_decoder(hint)
    return _scalar_decoder(hint)


def _scalar_decoder(hint: Any) -> Decoder:
    if hint is type(None):

        def none(value: Any, depth: int) -> None:
            if value is not None:
                raise _Bad(f"expected null, got {_kind(value)}")

        return none
    if hint is int:

        def integer(value: Any, depth: int) -> int:
            if type(value) is not int:
                raise _Bad(f"expected an integer, got {_kind(value)}")
            if not INT_MIN <= value <= INT_MAX:
                raise _Bad("integer out of 64-bit range")
            return value

        return integer
    if hint is float:

        def number(value: Any, depth: int) -> float:
            if type(value) is float:
                if not math.isfinite(value):  # 1e999 parses as inf
                    raise _Bad("number out of range (not finite)")
                return value
            if type(value) is not int:
                raise _Bad(f"expected a number, got {_kind(value)}")
            try:
                return float(value)
            except OverflowError:  # an integer with hundreds of digits
                raise _Bad("number out of range") from None

        return number
    if hint in (str, bool):

        def exact(value: Any, depth: int) -> Any:
            if type(value) is not hint:
                raise _Bad(f"expected {hint.__name__}, got {_kind(value)}")
            return value

        return exact
    raise TypeError(f"{hint!r} is not a wire type")  # a message class bug, found at first use


def _union_decoder(args: tuple) -> Decoder:
    nullable = type(None) in args
    options = [_decoder(a) for a in args if a is not type(None)]

    def union(value: Any, depth: int) -> Any:
        if value is None and nullable:
            return None
        errors = []
        for option in options:
            try:
                return option(value, depth)
            except _Bad as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise _Bad(f"matches none of {[e.text('') for e in errors]}")

    return union


def _items(decode: Decoder, values: list, depth: int) -> list:
    out = []
    for i, value in enumerate(values):
        try:
            out.append(decode(value, depth))
        except _Bad as exc:
            exc.where.append(f"[{i}]")
            raise
    return out


def _list_decoder(item: Any) -> Decoder:
    decode = _decoder(item)
    ints = item is int

    def sequence(value: Any, depth: int) -> list:
        if type(value) is not list:
            raise _Bad(f"expected a list, got {_kind(value)}")
        if depth >= MAX_DEPTH:
            raise _Bad("nested too deeply")
        # Token ids and block ids, the long lists: checked at C speed.
        if ints and all(type(v) is int for v in value):
            if value and (min(value) < INT_MIN or max(value) > INT_MAX):
                raise _Bad("integer out of 64-bit range")
            return value
        return _items(decode, value, depth + 1)

    return sequence


def _tuple_decoder(args: tuple) -> Decoder:
    if len(args) == 2 and args[1] is Ellipsis:
        items = _list_decoder(args[0])
        return lambda value, depth: tuple(items(value, depth))
    decoders = [_decoder(a) for a in args]

    def fixed(value: Any, depth: int) -> tuple:
        if type(value) is not list:
            raise _Bad(f"expected a list, got {_kind(value)}")
        if len(value) != len(decoders):
            raise _Bad(f"expected {len(decoders)} items, got {len(value)}")
        if depth >= MAX_DEPTH:
            raise _Bad("nested too deeply")
        out = []
        for i, (decode, item) in enumerate(zip(decoders, value, strict=True)):
            try:
                out.append(decode(item, depth + 1))
            except _Bad as exc:
                exc.where.append(f"[{i}]")
                raise
        return tuple(out)

    return fixed


def _dict_decoder(args: tuple) -> Decoder:
    key_hint, value_hint = args
    if key_hint is not str:
        raise TypeError("only string keys travel as JSON")
    decode = _decoder(value_hint)

    def mapping(value: Any, depth: int) -> dict:
        if type(value) is not dict:
            raise _Bad(f"expected an object, got {_kind(value)}")
        if depth >= MAX_DEPTH:
            raise _Bad("nested too deeply")
        out = {}
        for key, item in value.items():
            try:
                out[key] = decode(item, depth + 1)
            except _Bad as exc:
                exc.where.append(f".{key[:32]}")
                raise
        return out

    return mapping


def _dataclass_decoder(kind: type) -> Decoder:
    hints = typing.get_type_hints(kind)
    fields = [f for f in dataclasses.fields(kind) if f.init]
    decoders = {f.name: _decoder(hints[f.name]) for f in fields}
    required = frozenset(
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    # Per field, the value types its decoder returns as they are (most fields of a delta are
    # null or a plain scalar): taken without calling it, the same value either way.
    as_is = {f.name: returned_as_is(hints[f.name]) for f in fields}

    def message(value: Any, depth: int) -> Any:
        if type(value) is not dict:
            raise _Bad(f"expected an object, got {_kind(value)}")
        if depth >= MAX_DEPTH:
            raise _Bad("nested too deeply")
        values = {}
        for key, item in value.items():
            plain = as_is.get(key)
            if plain is not None:
                kind_of_item = type(item)
                if kind_of_item in plain and (
                    kind_of_item is not int or INT_MIN <= item <= INT_MAX
                ):
                    values[key] = item
                    continue
            decode = decoders.get(key)
            if decode is None:
                unknown = sorted(str(k)[:32] for k in value if k not in decoders)[:5]
                raise _Bad(f"unknown field(s) {unknown}")
            try:
                values[key] = decode(item, depth + 1)
            except _Bad as exc:
                exc.where.append(f".{key}")
                raise
        if len(values) < len(required) or not required <= values.keys():
            raise _Bad(f"missing field(s) {sorted(required - values.keys())}")
        try:
            if not plain_init:
                return kind(**values)
            return construct(values)
        except (TypeError, ValueError) as exc:  # __post_init__'s range checks
            raise _Bad(str(exc)) from None

    plain_init = assigns_fields_only(kind, fields)
    construct = constructor(kind, fields)
    return message


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", type(None): "null"}
    return names.get(type(value), type(value).__name__)
