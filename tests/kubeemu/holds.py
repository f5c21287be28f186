"""Held requests: API requests a test makes wait, to stop a client at a known point.

A test adds a hold (``POST /_emulator/holds``: verb, resource, namespace, name; each optional)
and every matching request waits before it is served, until the holds are released
(``DELETE /_emulator/holds``) or its client goes away (the request is then never served, as a
request that never reached the server). ``GET /_emulator/holds`` says how many requests each
hold caught and how many wait now, so a test knows, without sleeping, that a client is stuck
at that call: e.g. an operator SIGKILLed while its apply of a Deployment is in flight.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kubeemu.errors import bad_request
from kubeemu.kinds import ResourceType


@dataclass
class Hold:
    verb: str | None = None  # get, list, watch, create, update, patch, apply, delete
    resource: str | None = None  # plural, "deployments" (any group)
    namespace: str | None = None
    name: str | None = None
    caught: int = 0
    waiting: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def matches(self, verb: str, rt: ResourceType, ns: str | None, name: str | None) -> bool:
        wanted = (self.verb, self.resource, self.namespace, self.name)
        actual = (verb, rt.plural, ns, name)
        return all(w is None or w == a for w, a in zip(wanted, actual, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {
            "verb": self.verb,
            "resource": self.resource,
            "namespace": self.namespace,
            "name": self.name,
            "caught": self.caught,
            "waiting": self.waiting,
        }


class Holds:
    """The holds a test set, checked before every resource request is served."""

    def __init__(self) -> None:
        self.holds: list[Hold] = []

    def add(self, spec: Any) -> Hold:
        if not isinstance(spec, dict):
            raise bad_request("a hold is an object: {verb, resource, namespace, name}")
        unknown = set(spec) - {"verb", "resource", "namespace", "name"}
        if unknown:
            raise bad_request(f"unknown hold fields: {', '.join(sorted(unknown))}")
        hold = Hold(**{k: str(v) for k, v in spec.items() if v is not None})
        self.holds.append(hold)
        return hold

    def release(self) -> None:
        """Lets every waiting request through and removes the holds."""
        for hold in self.holds:
            hold.released.set()
        self.holds.clear()

    async def wait(self, verb: str, rt: ResourceType, ns: str | None, name: str | None) -> None:
        hold = next((h for h in self.holds if h.matches(verb, rt, ns, name)), None)
        if hold is None:
            return
        hold.caught += 1
        hold.waiting += 1
        try:
            await hold.released.wait()
        finally:  # released, or cancelled because the client went away
            hold.waiting -= 1

    def to_json(self) -> dict[str, Any]:
        return {"holds": [h.to_json() for h in self.holds]}
