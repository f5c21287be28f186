"""Which KV blocks a peer may write into, per request: the decode side's guard on KV transfers.

A decode engine reserves the blocks it set aside for a request, with a random nonce that only
the prefill peer it pairs with learns (inside its ``PrefillRequest``), before it sends that
request; it revokes the reservation before it frees the blocks (failure, timeout, abort), and a
reservation expires on its own. A transfer is accepted only into blocks reserved for its request
under its nonce, so a late push from a prefill pod that restarted, or one from anybody who
guessed a request id, cannot land in blocks that now hold another request's KV.

A revoke is a barrier. The receiver checks a part and marks its reservation as being written
(``begin``) under the lock, stores the part, then unmarks it (``end``); ``revoke`` removes the
reservation under the same lock, so no part passes the check after it, and reports whether a
part that passed before is still being stored. The cache manager confirms a revoke to the engine
(``Revoked``) only once none is: after that, nothing more lands in the blocks. A push whose last
part is stored uses its reservation up (no later part, nor a replayed push, passes), and
``clear`` drops every reservation when the engine (re-)attaches or goes.

Shared by the cache manager's main loop (reserve, revoke, clear) and its receiver thread (begin,
end). One object lives as long as the cache manager, across attachments, so a part still being
stored for an engine that re-attached holds back the confirmation of that request's revoke.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

MAX_RESERVATIONS = 1 << 16  # an engine has at most as many requests as KV blocks; a bound


@dataclass(frozen=True)
class Reservation:
    blocks: frozenset[int]
    nonce: str
    expires: float


class Reservations:
    """The attached engine's reservations, and the parts being stored into them right now."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._table: dict[str, Reservation] = {}
        self._writing: dict[str, int] = {}  # request id -> parts being stored now

    def reserve(self, request_id: str, blocks: list[int], nonce: str, ttl: float) -> None:
        now = time.monotonic()
        with self._cond:
            if len(self._table) >= MAX_RESERVATIONS:
                self._table = {k: r for k, r in self._table.items() if r.expires > now}
            if len(self._table) >= MAX_RESERVATIONS:
                self._table.pop(next(iter(self._table)))  # the oldest goes first
            self._table[request_id] = Reservation(frozenset(blocks), nonce, now + ttl)

    def revoke(self, request_ids: Iterable[str], timeout: float | None = None) -> bool:
        """Ends the reservations: no part passes ``begin`` for them from now on. Returns whether
        no part is being stored into them any more, after waiting up to ``timeout`` seconds for
        those that are (None: as long as it takes; 0: not at all, see ``idle``)."""
        ids = list(request_ids)
        with self._cond:
            for request_id in ids:
                self._table.pop(request_id, None)
            return self._cond.wait_for(lambda: self._idle(ids), timeout)

    def idle(self, request_ids: Iterable[str]) -> bool:
        """Whether no part is being stored for any of these requests."""
        with self._cond:
            return self._idle(request_ids)

    def clear(self) -> int:
        """Drops every reservation (the engine re-attached or went); returns how many."""
        with self._cond:
            count, self._table = len(self._table), {}
            return count

    def __len__(self) -> int:
        return len(self._table)

    def check(self, request_id: str, nonce: str, blocks: list[int]) -> str | None:
        """None if the transfer may write ``blocks`` now; otherwise why not (nothing is marked:
        use ``begin`` to write)."""
        with self._cond:
            return self._check(request_id, nonce, blocks)[1]

    def begin(self, request_id: str, nonce: str, blocks: list[int]) -> str | None:
        """Checks a part and, if it may write ``blocks``, marks its request as being written
        until ``end``: a revoke meanwhile is confirmed only after that. None, or why not."""
        with self._cond:
            reservation, error = self._check(request_id, nonce, blocks)
            if reservation is not None:
                self._writing[request_id] = self._writing.get(request_id, 0) + 1
            return error

    def end(self, request_id: str, nonce: str | None = None) -> None:
        """The part ``begin`` let through is stored (or given up). With ``nonce`` (the push's
        last part was stored), its reservation is used up: nothing more may write it."""
        with self._cond:
            count = self._writing.pop(request_id, 0) - 1
            if count > 0:
                self._writing[request_id] = count
            reservation = self._table.get(request_id)
            if nonce is not None and reservation is not None and reservation.nonce == nonce:
                del self._table[request_id]
            self._cond.notify_all()

    def _idle(self, request_ids: Iterable[str]) -> bool:
        writing = self._writing
        return not writing or not any(request_id in writing for request_id in request_ids)

    def _check(
        self, request_id: str, nonce: str, blocks: list[int]
    ) -> tuple[Reservation | None, str | None]:
        reservation = self._table.get(request_id)
        if reservation is None:
            return None, f"no KV blocks are reserved for request {request_id[:64]!r} here"
        given = nonce.encode("utf-8", "surrogatepass")
        if not hmac.compare_digest(reservation.nonce.encode(), given):
            error = f"the transfer for {request_id[:64]!r} does not carry its reservation's nonce"
            return None, error
        if reservation.expires < time.monotonic():
            return None, f"the reservation for {request_id[:64]!r} expired"
        if not reservation.blocks.issuperset(blocks):
            return None, f"blocks outside the reservation of {request_id[:64]!r}"
        return reservation, None
