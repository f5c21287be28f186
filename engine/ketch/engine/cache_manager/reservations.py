"""Which KV blocks a peer may write into, per request: the decode side's guard on KV transfers.

A decode engine reserves the blocks it set aside for a request, with a random nonce that only
the prefill peer it pairs with learns (inside its ``PrefillRequest``), before it sends that
request; it revokes the reservation before it frees the blocks (failure, timeout, abort), and a
reservation expires on its own. A transfer is accepted only into blocks reserved for its request
under its nonce, so a late push from a prefill pod that restarted, or one from anybody who
guessed a request id, cannot land in blocks that now hold another request's KV.

Shared by the cache manager's main loop (reserve, revoke) and its receiver thread (check).
"""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass

MAX_RESERVATIONS = 1 << 16  # an engine has at most as many requests as KV blocks; a bound


@dataclass(frozen=True)
class Reservation:
    blocks: frozenset[int]
    nonce: str
    expires: float


class Reservations:
    """The attached engine's reservations (a new engine starts with none)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: dict[str, Reservation] = {}

    def reserve(self, request_id: str, blocks: list[int], nonce: str, ttl: float) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._table) >= MAX_RESERVATIONS:
                self._table = {k: r for k, r in self._table.items() if r.expires > now}
            if len(self._table) >= MAX_RESERVATIONS:
                self._table.pop(next(iter(self._table)))  # the oldest goes first
            self._table[request_id] = Reservation(frozenset(blocks), nonce, now + ttl)

    def revoke(self, request_ids: list[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._table.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._table)

    def check(self, request_id: str, nonce: str, blocks: list[int]) -> str | None:
        """None if the transfer may write ``blocks``; otherwise why not."""
        with self._lock:
            reservation = self._table.get(request_id)
        if reservation is None:
            return f"no KV blocks are reserved for request {request_id[:64]!r} here"
        given = nonce.encode("utf-8", "surrogatepass")
        if not hmac.compare_digest(reservation.nonce.encode(), given):
            return f"the transfer for {request_id[:64]!r} does not carry its reservation's nonce"
        if reservation.expires < time.monotonic():
            return f"the reservation for {request_id[:64]!r} expired"
        if not reservation.blocks.issuperset(blocks):
            return f"blocks outside the reservation of {request_id[:64]!r}"
        return None
