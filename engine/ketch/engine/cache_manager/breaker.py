"""A circuit breaker for one push destination: stop spending sender time on a peer that is down.

``closed`` (pushes go) -> after ``threshold`` consecutive failures -> ``open``: pushes fail at
once, without touching the network, for ``cooldown`` seconds -> ``half-open``: the next push is
let through as a probe; its success closes the circuit, its failure opens it for another
cooldown. Only failures of the destination count (no acknowledgement in time, a broken
connection, an answer without a valid seal); a peer that answers and refuses a push is
reachable, and a push whose deadline passed says nothing about the peer.

Not thread-safe: ``push.Pusher`` calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


@dataclass
class CircuitBreaker:
    """The failure count and open/half-open state of one destination."""

    threshold: int
    cooldown: float
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False  # the half-open probe is on its way
    last_error: str = ""

    def state(self, now: float) -> str:
        if self.opened_at is None:
            return CLOSED
        if self.probing or now - self.opened_at >= self.cooldown:
            return HALF_OPEN
        return OPEN

    def refusal(self, now: float, busy: bool = False) -> str | None:
        """Why a push must fail fast now (open, or half-open with its probe out or, ``busy``,
        queued), else None."""
        state = self.state(now)
        if state == CLOSED or (state == HALF_OPEN and not self.probing and not busy):
            return None
        if state == HALF_OPEN:
            return "a probe push is on its way; others fail until it succeeds"
        left = self.cooldown - (now - (self.opened_at or now))
        return (
            f"its last {self.failures} pushes failed (last: {self.last_error}); pushes to it "
            f"fail at once for {left:.1f} s more, then one probe is tried"
        )

    def start(self, now: float) -> str | None:
        """A push is about to go: None lets it (as the probe when half-open), else why not."""
        refusal = self.refusal(now)
        if refusal is None and self.opened_at is not None:
            self.probing = True
        return refusal

    def succeeded(self) -> None:
        self.failures, self.opened_at, self.probing, self.last_error = 0, None, False, ""

    def failed(self, now: float, error: str) -> None:
        self.failures += 1
        self.last_error = error[:200]
        if self.probing or self.failures >= self.threshold:
            self.opened_at, self.probing = now, False

    def ended(self) -> None:
        """A push that went ended neither way (its deadline passed): a probe may go again."""
        self.probing = False
