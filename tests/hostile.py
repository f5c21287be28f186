"""Hostile inputs for the internal ports: seeded, bounded, and shaped after the real messages.

``frames(kinds, seed, count)`` yields lists of frames: garbage bytes, wrong frame counts, JSON of
the wrong shape, nesting far past any limit, and valid-looking messages of each class in
``kinds`` with one field replaced by a wrong type or an extreme value (taken from the class's
own type hints, so a new field is fuzzed without touching this file).
"""

from __future__ import annotations

import dataclasses
import json
import random
import typing
from collections.abc import Iterator
from typing import Any

EXTREMES: list[Any] = [
    None, True, -1, 0, 2**63, -(2**63) - 1, 10**30, 1.5, float("inf"), "", "x" * 10_000,
    "\udcff", [], [None], {}, {"a": {"b": {}}}, [[[[[]]]]], -(10**400),
]  # fmt: skip


def sample_value(hint: Any, rng: random.Random, depth: int = 0) -> Any:
    """A plausible JSON value of type ``hint`` (what a correct peer would send)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, __import__("types").UnionType):
        return sample_value(rng.choice([a for a in args if a is not type(None)]), rng, depth)
    if origin in (list, set, frozenset):
        return [sample_value(args[0], rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if origin is tuple:
        items = args[:1] * 2 if len(args) == 2 and args[1] is Ellipsis else args
        return [sample_value(a, rng, depth + 1) for a in items]
    if origin is dict:
        return {f"k{i}": sample_value(args[1], rng, depth + 1) for i in range(rng.randint(0, 2))}
    if dataclasses.is_dataclass(hint):
        return sample_body(hint, rng, depth + 1)
    return {int: rng.randint(0, 64), float: rng.random(), str: f"s{rng.randint(0, 9)}",
            bool: rng.random() < 0.5}.get(hint)  # fmt: skip


def sample_body(kind: type, rng: random.Random, depth: int = 0) -> dict[str, Any]:
    hints = typing.get_type_hints(kind)
    return {f.name: sample_value(hints[f.name], rng, depth) for f in dataclasses.fields(kind)}


def _tagged(kind: type, body: Any) -> bytes:
    return json.dumps({"type": kind.__name__, "body": body}).encode()


def mutated(kinds: list[type], rng: random.Random) -> bytes:
    """A message of one of ``kinds`` with one field (or the body) broken."""
    kind = rng.choice(kinds)
    body = sample_body(kind, rng)
    choice = rng.random()
    if choice < 0.7 and body:
        body[rng.choice(list(body))] = rng.choice(EXTREMES)
    elif choice < 0.8:
        body[f"unknown_{rng.randint(0, 9)}"] = 1
    elif choice < 0.9 and body:
        del body[rng.choice(list(body))]
    else:
        body = rng.choice(EXTREMES)
    try:
        return _tagged(kind, body)
    except (ValueError, UnicodeEncodeError):  # json cannot write this value: send garbage
        return b"\xff" * 8


def frames(kinds: list[type], seed: int, count: int) -> Iterator[list[bytes]]:
    """``count`` hostile multipart messages, reproducible from ``seed``."""
    rng = random.Random(seed)
    shapes = [
        lambda: [rng.randbytes(rng.choice([0, 1, 7, 300, 70_000]))],
        lambda: [mutated(kinds, rng) for _ in range(rng.choice([0, 2, 3, 5]))] or [b""],
        lambda: [b"[" * 200_000 + b"]" * 200_000],
        lambda: [b'{"type": "' + rng.choice(kinds).__name__.encode() + b'", "body": ' +
                 b'{"a":' * 50_000 + b"1" + b"}" * 50_001],
        lambda: [json.dumps(rng.choice([*EXTREMES[:6], [1, 2], {"type": 1, "body": 2}])).encode()],
        lambda: [b'{"type": "NoSuchMessage", "body": {}}'],
        lambda: [mutated(kinds, rng)],
        lambda: [mutated(kinds, rng)],
        lambda: [mutated(kinds, rng)],
    ]  # fmt: skip
    for _ in range(count):
        yield rng.choice(shapes)()
