"""The controller's work queue: per InferenceService, serialised, coalesced, retried.

Work for one InferenceService runs one piece at a time; what arrives meanwhile folds into the
next piece (so a burst of events costs one reconcile), and InferenceServices never wait on each
other. A failed reconcile is retried with exponential backoff, per InferenceService, and keeps
the work that arrived while it waited.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from ketch.operator.cache import ChildKey, Key
from ketch.operator.kube import ApiError
from ketch.operator.metrics import OperatorMetrics
from ketch.operator.ownership import ChildConflict

logger = logging.getLogger("ketch.operator")


@dataclasses.dataclass
class Work:
    """What one reconcile must do (see ``controller``): the flags of all the events it covers."""

    full: bool = False
    drift: set[ChildKey] = dataclasses.field(default_factory=set)
    status: bool = False

    def merge(self, other: Work) -> None:
        self.full |= other.full
        self.drift |= other.drift
        self.status |= other.status


# Runs one piece of work; False when the InferenceService is no longer tracked (nothing ran).
Reconcile = Callable[[Key, Work], Awaitable[bool]]


class WorkQueue:
    """Pending work and one worker task per InferenceService."""

    def __init__(self, reconcile: Reconcile, metrics: OperatorMetrics, max_backoff: float = 60.0):
        self.reconcile = reconcile
        self.metrics = metrics
        self.max_backoff = max_backoff
        self.last_error: str | None = None  # of the last failed reconcile, until one succeeds
        self._pending: dict[Key, Work] = {}
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._failures: dict[Key, int] = {}

    def put(self, key: Key, work: Work) -> None:
        pending = self._pending.get(key)
        if pending is None:
            self._pending[key] = work
        else:
            pending.merge(work)
        if key not in self._tasks:
            self._tasks[key] = asyncio.get_running_loop().create_task(self._worker(key))

    def forget(self, key: Key) -> None:
        """Drops the queued work of an InferenceService that is gone."""
        self._pending.pop(key, None)
        self._failures.pop(key, None)

    @property
    def busy(self) -> bool:
        """True while work is queued or running."""
        return bool(self._tasks or self._pending)

    async def idle(self, timeout: float = 30.0) -> None:
        """Waits until no work is queued or running (for tests and the benchmark)."""
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._tasks.values())

    async def _worker(self, key: Key) -> None:
        try:
            while key in self._pending:
                work = self._pending.pop(key)
                try:
                    if await self.reconcile(key, work):
                        self._failures.pop(key, None)
                        self.last_error = None
                except Exception as exc:  # one InferenceService's failure stays its own
                    await self._retry_later(key, work, exc)
        finally:
            self._tasks.pop(key, None)

    async def _retry_later(self, key: Key, work: Work, exc: Exception) -> None:
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        reason = error_reason(exc)
        self.metrics.errors.labels(reason).inc()
        if not isinstance(exc, ChildConflict):  # the InferenceService's problem, not the API's
            self.last_error = str(exc)
        delay = min(self.max_backoff, 0.5 * 2 ** min(failures, 10))
        logger.warning(
            "%s/%s: reconcile failed (%s), retrying in %.1f s: %s", *key, reason, delay, exc
        )
        work.merge(self._pending.pop(key, Work()))
        await asyncio.sleep(delay)
        work.merge(self._pending.pop(key, Work()))  # and what arrived while it waited
        self._pending[key] = work


def error_reason(exc: Exception) -> str:
    """The ``reason`` label of a failed reconcile."""
    if isinstance(exc, ChildConflict):
        return ChildConflict.__name__
    if isinstance(exc, ApiError):
        return {409: "Conflict", 422: "Invalid", 403: "Forbidden", 404: "NotFound"}.get(
            exc.status, "ApiError"
        )
    if isinstance(exc, OSError | asyncio.TimeoutError):
        return "Unreachable"
    return "Internal"
