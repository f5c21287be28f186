"""Tagged JSON, the wire format of every message between Ketch's processes (never pickle).

A message is a dataclass; on the wire it is ``{"type": <class name>, "body": <its fields>}``, so
either side can be replaced, or inspected with a plain ZMQ client, without sharing Python
objects. Decoding never trusts the peer: anything malformed is a ValueError naming the protocol.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

Convert = Callable[[type, dict[str, Any]], dict[str, Any]]
"""Turns a decoded body's plain JSON values back into field values (nested dataclasses etc.)."""


def registry(*types: type) -> dict[str, type]:
    return {t.__name__: t for t in types}


def encode(message: Any) -> bytes:
    body = dataclasses.asdict(message)
    return json.dumps({"type": type(message).__name__, "body": body}).encode()


def decode(data: bytes, types: dict[str, type], convert: Convert, protocol: str) -> Any:
    try:
        raw = json.loads(data)
        kind = types.get(raw["type"])
        if kind is None:
            raise ValueError(f"unknown message type {raw['type']!r}")
        return kind(**convert(kind, dict(raw["body"])))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed {protocol} message: {exc}") from exc
