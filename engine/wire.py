"""Tagged JSON, the wire format of every message between Ketch's processes (never pickle).

A message is a dataclass; on the wire it is ``{"type": <class name>, "body": <its fields>}``, so
either side can be replaced, or inspected with a plain ZMQ client, without sharing Python
objects.

Decoding never trusts the peer. One codec serves every protocol, driven by the message classes'
own type hints: the size of the frame, the nesting depth, the type of every field (``int`` is
never a bool, and fits 64 bits; ``float`` is a number; lists, tuples, sets, dicts, unions,
optionals and nested dataclasses recursively), unknown and missing fields; the class's
``__post_init__`` then checks ranges. Anything that fails is a ``MessageError`` naming the
protocol and the field, for the caller to count and drop or answer: never a crash in a loop.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import os
import pathlib
import struct
import time
import types
import typing
from collections.abc import Iterable
from typing import Any

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
    body = dataclasses.asdict(message)
    return json.dumps({"type": type(message).__name__, "body": body}, default=_plain).encode()


def _plain(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not part of the wire format")


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
            raw = json.loads(bytes(data))
        except RecursionError:
            raise MessageError("nested too deeply") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MessageError(f"not JSON: {exc}") from None
        if not isinstance(raw, dict) or set(raw) != {"type", "body"}:
            raise MessageError('not a {"type": ..., "body": ...} object')
        kind = kinds.get(raw["type"]) if isinstance(raw["type"], str) else None
        if kind is None:
            raise MessageError(f"unknown message type {str(raw['type'])[:64]!r}")
        return _dataclass(kind, raw["body"], kind.__name__, 0)
    except MessageError as exc:
        raise MessageError(f"malformed {protocol} message: {exc}") from None


def from_json(hint: Any, value: Any, path: str) -> Any:
    """``value`` (decoded JSON) as the type ``hint`` describes; MessageError naming ``path``."""
    return _value(hint, value, path, 0)


def _value(hint: Any, value: Any, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise MessageError(f"{path}: nested too deeply")
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if hint is type(None):
        if value is not None:
            raise MessageError(f"{path}: expected null, got {_kind(value)}")
        return None
    if origin in (typing.Union, types.UnionType):
        return _union(typing.get_args(hint), value, path, depth)
    if origin is list:
        return _list(typing.get_args(hint)[0], value, path, depth)
    if origin is tuple:
        return _tuple(typing.get_args(hint), value, path, depth)
    if origin in (set, frozenset):
        return origin(_list(typing.get_args(hint)[0], value, path, depth))
    if origin is dict:
        return _dict(typing.get_args(hint), value, path, depth)
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, value, path, depth)
    return _scalar(hint, value, path)


def _scalar(hint: Any, value: Any, path: str) -> Any:
    if hint is int:
        if type(value) is not int:
            raise MessageError(f"{path}: expected an integer, got {_kind(value)}")
        if not INT_MIN <= value <= INT_MAX:
            raise MessageError(f"{path}: integer out of 64-bit range")
        return value
    if hint is float:
        if type(value) not in (int, float):
            raise MessageError(f"{path}: expected a number, got {_kind(value)}")
        try:
            return float(value)
        except OverflowError:  # an integer with hundreds of digits
            raise MessageError(f"{path}: number out of range") from None
    if hint in (str, bool):
        if type(value) is not hint:
            raise MessageError(f"{path}: expected {hint.__name__}, got {_kind(value)}")
        return value
    raise MessageError(f"{path}: {hint!r} is not a wire type")  # a message class bug


def _union(options: tuple, value: Any, path: str, depth: int) -> Any:
    if value is None and type(None) in options:
        return None
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return _value(option, value, path, depth)
        except MessageError as exc:
            errors.append(str(exc))
    raise MessageError(errors[0] if len(errors) == 1 else f"{path}: matches none of {errors}")


def _list(item: Any, value: Any, path: str, depth: int) -> list:
    if type(value) is not list:
        raise MessageError(f"{path}: expected a list, got {_kind(value)}")
    # Token ids and block ids, the long lists: checked at C speed.
    if item is int and all(type(v) is int for v in value):
        if value and (min(value) < INT_MIN or max(value) > INT_MAX):
            raise MessageError(f"{path}: integer out of 64-bit range")
        return value
    return [_value(item, v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]


def _tuple(items: tuple, value: Any, path: str, depth: int) -> tuple:
    if type(value) is not list:
        raise MessageError(f"{path}: expected a list, got {_kind(value)}")
    if len(items) == 2 and items[1] is Ellipsis:
        return tuple(_value(items[0], v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
    if len(value) != len(items):
        raise MessageError(f"{path}: expected {len(items)} items, got {len(value)}")
    return tuple(
        _value(h, v, f"{path}[{i}]", depth + 1)
        for i, (h, v) in enumerate(zip(items, value, strict=True))
    )


def _dict(args: tuple, value: Any, path: str, depth: int) -> dict:
    if type(value) is not dict:
        raise MessageError(f"{path}: expected an object, got {_kind(value)}")
    key_hint, value_hint = args
    if key_hint is not str:
        raise MessageError(f"{path}: only string keys travel as JSON")
    return {k: _value(value_hint, v, f"{path}.{k[:32]}", depth + 1) for k, v in value.items()}


def _dataclass(kind: type, value: Any, path: str, depth: int) -> Any:
    if type(value) is not dict:
        raise MessageError(f"{path}: expected an object, got {_kind(value)}")
    hints, required = _fields(kind)
    unknown = set(value) - set(hints)
    if unknown:
        raise MessageError(f"{path}: unknown field(s) {sorted(str(k)[:32] for k in unknown)[:5]}")
    missing = required - set(value)
    if missing:
        raise MessageError(f"{path}: missing field(s) {sorted(missing)}")
    fields = {k: _value(hints[k], v, f"{path}.{k}", depth + 1) for k, v in value.items()}
    try:
        return kind(**fields)
    except (TypeError, ValueError) as exc:  # __post_init__'s range checks
        raise MessageError(f"{path}: {exc}") from None


@functools.cache
def _fields(kind: type) -> tuple[dict[str, Any], frozenset[str]]:
    """A message class's field types (resolved once) and the names that have no default."""
    hints = typing.get_type_hints(kind)
    fields = dataclasses.fields(kind)
    required = frozenset(
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    return {f.name: hints[f.name] for f in fields if f.init}, required


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", type(None): "null"}
    return names.get(type(value), type(value).__name__)


PEER_KEY_ENV = "KETCH_PEER_KEY"
PEER_AUTH_WINDOW_S = 30.0
"""How far a sealed message's timestamp may be from the receiver's clock (either way)."""
_STAMP = struct.Struct(">Q16s")  # timestamp (ns since the epoch), random nonce
SEAL_BYTES = _STAMP.size + 32  # + HMAC-SHA256


def read_peer_key(file: str | None, flag: str = "--peer-key-file") -> bytes | None:
    """The peer key from ``file`` (surrounding whitespace stripped), else from $KETCH_PEER_KEY;
    None: no key (trusted network only). ValueError for a missing, empty or short file."""
    if file:
        path = pathlib.Path(file)
        if not path.is_file():
            raise ValueError(f"{flag} {path} does not exist")
        key = path.read_bytes().strip()
        source = f"{flag} {path}"
    else:
        key = os.environ.get(PEER_KEY_ENV, "").strip().encode()
        source = f"${PEER_KEY_ENV}"
        if not key:
            return None
    if len(key) < 16:
        raise ValueError(f"{source} holds {len(key)} bytes; a peer key needs at least 16")
    return key


class PeerAuth:
    """HMAC-SHA256 seals for the messages on ports that leave the pod (pd-comm, kv-transfer).

    ``seal`` returns one extra frame (timestamp, random nonce, MAC over a channel label and
    every frame, length-prefixed) sent after a message's frames; ``check`` verifies it in
    constant time, refuses a timestamp more than ``window`` seconds from this clock, and a nonce
    it has seen within the window (a replay). The channel label binds a seal to one direction of
    one protocol, so a captured answer cannot be sent back as a request. One instance per thread.
    """

    MAX_SEEN = 1 << 20  # nonces remembered per window; only a key holder can fill it

    def __init__(
        self, key: bytes, window: float = PEER_AUTH_WINDOW_S, clock: Any = time.time
    ) -> None:
        self._key = key
        self._window_ns = int(window * 1e9)
        self._clock = clock
        self._seen: set[bytes] = set()
        self._expiry: collections.deque[tuple[int, bytes]] = collections.deque()

    def _mac(self, channel: bytes, stamp: bytes, frames: Iterable[Any]) -> bytes:
        mac = hmac.new(self._key, channel, hashlib.sha256)
        mac.update(stamp)
        for frame in frames:
            view = memoryview(frame)
            mac.update(view.nbytes.to_bytes(8, "big"))
            mac.update(view)
        return mac.digest()

    def seal(self, channel: bytes, *frames: Any) -> bytes:
        stamp = _STAMP.pack(int(self._clock() * 1e9), os.urandom(16))
        return stamp + self._mac(channel, stamp, frames)

    def check(self, channel: bytes, frames: Iterable[Any], seal: Any) -> str | None:
        """None if ``seal`` is a fresh, valid seal of ``frames``; else why it is refused."""
        seal = bytes(seal)
        if len(seal) != SEAL_BYTES:
            return f"no valid peer-key seal ({len(seal)} bytes instead of {SEAL_BYTES})"
        stamp, mac = seal[: _STAMP.size], seal[_STAMP.size :]
        when, nonce = _STAMP.unpack(stamp)
        if not hmac.compare_digest(mac, self._mac(channel, stamp, frames)):
            return "bad peer-key MAC (a peer without this InferenceService's key?)"
        now = int(self._clock() * 1e9)
        if abs(now - when) > self._window_ns:
            return f"sealed {(now - when) / 1e9:.1f} s from now, outside the replay window"
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(self._expiry.popleft()[1])
        if nonce in self._seen:
            return "a replayed message (its nonce was seen within the window)"
        if len(self._seen) >= self.MAX_SEEN:
            return "too many messages within the replay window"
        self._seen.add(nonce)
        self._expiry.append((now + 2 * self._window_ns, nonce))
        return None
