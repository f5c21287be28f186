"""Work the API server must not do on its event loop: bounded pools that run it elsewhere.

The event loop also answers ``/health``, ``/ready`` and ``/metrics`` and feeds every stream, so
nothing slow may run on it. Two kinds of slow work come with requests:

- **CPU-bound Python** (GBNF conversion, JSON Schema meta-validation, grammar compilation):
  it holds the GIL, so a thread would still starve the loop. ``ProcessPool`` runs it in a few
  spawned worker processes, each job under a wall-clock budget: a job over it is answered
  ``JobTimeout`` and its worker is killed (it cannot go on burning CPU) and replaced by a fresh
  one when next needed.
- **Work in native code that releases the GIL** (tokenizing and detokenizing long texts with
  ``tokenizers``), and rendering long chats (jinja is Python, but cheap per byte and bounded by
  the body's size; the API server shortens the GIL's switch interval so the loop gets it back
  within a millisecond): ``ThreadJobs``, a small thread pool.

Both are bounded: past the jobs they run, at most ``max_waiting`` wait for a turn, and any more
are refused at once with ``Busy`` (503 with Retry-After, code ``instance_unavailable``: nothing
was done, another instance may take the request). Both run at a lower CPU priority (nice +10)
than the event loop's thread, so on a busy machine the probes' answers come first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from ketch.engine.lifecycle import exit_with_parent

logger = logging.getLogger(__name__)

NOT_ACCEPTED = "instance_unavailable"  # the error code of a refusal before any work
START_TIMEOUT_S = 120.0
"""How long a new worker process may take to import and initialise (not a job's budget)."""
BACKGROUND_NICE = 10
"""How much lower than the event loop's the priority of the offloaded work is (Linux nice)."""


def lower_priority(thread: bool = True) -> None:
    """Lowers the calling thread's CPU priority (``thread=False``: the whole process's) by
    ``BACKGROUND_NICE``. On Linux each thread has its own nice value, and threads it starts
    (``tokenizers``' worker pool, say) inherit it."""
    with contextlib.suppress(OSError, AttributeError):
        who = threading.get_native_id() if thread else 0
        current = os.getpriority(os.PRIO_PROCESS, who)
        os.setpriority(os.PRIO_PROCESS, who, min(current + BACKGROUND_NICE, 19))


class Busy(Exception):
    """Every worker is busy and the queue is full: the API server answers 503 with
    Retry-After and code ``instance_unavailable`` (``NOT_ACCEPTED``)."""

    def __init__(self, what: str) -> None:
        self.message = f"the server is busy {what}; retry shortly or on another instance"
        super().__init__(self.message)


class StartFailed(Busy):
    """A worker process could not be started: 503 as well (the server's fault, not the
    request's; nothing is remembered about the job)."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.message = message


class JobTimeout(Exception):
    """The job ran past its budget; its worker was killed."""


class JobFailed(Exception):
    """The job raised in its worker (``TypeName: message``, no traceback), or the worker died."""


class ThreadJobs:
    """A few threads for work off the event loop (mostly in native code that releases the
    GIL); at most ``max_waiting`` jobs queue beyond those running."""

    def __init__(self, busy: str, threads: int = 2, max_waiting: int = 64) -> None:
        self.busy = busy
        self._threads = threads
        self._max_waiting = max_waiting
        self._executor = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="offload", initializer=lower_priority
        )
        self._pending = 0  # submitted and not finished (running or queued)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a thread. A caller that goes away does not free the turn early: the
        job holds it until it really ends, so the bound is on threads' work, not on callers."""
        if self._pending >= self._threads + self._max_waiting:
            raise Busy(self.busy)
        self._pending += 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        future.add_done_callback(self._done)
        return await asyncio.shield(future)

    def _done(self, _: object) -> None:
        self._pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection


class ProcessPool:
    """Up to ``workers`` spawned processes running module-level functions, one job each at a
    time, each job within a wall-clock budget; ``max_waiting`` more jobs may queue.

    Workers start when first needed and run ``init(*init_args)`` first (its time is not a
    job's). They die with this process (``PR_SET_PDEATHSIG``) and with ``close``."""

    def __init__(
        self,
        name: str,
        workers: int,
        max_waiting: int,
        busy: str = "",
        init: Callable[..., None] | None = None,
        init_args: tuple[Any, ...] = (),
    ) -> None:
        self.name = name
        self._busy = busy or f"with {name} work"
        self._size = workers
        self._max_waiting = max_waiting
        self._init = init
        self._init_args = init_args
        self._context = multiprocessing.get_context("spawn")
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._count = 0  # worker places taken: idle, busy, or being started
        self._waiting: deque[asyncio.Future[_Worker | None]] = deque()
        # One thread per running job: it writes the job, waits for the answer, reads it.
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self.killed = 0  # workers killed for running past a job's budget
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """The worker processes alive now."""
        return [w.process.pid for w in self._all if w.process.pid is not None]

    async def run(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
        """``fn(*args)`` in a worker; ``JobTimeout`` past ``timeout`` seconds, ``JobFailed`` if
        it raised (or its worker died), ``Busy`` if the queue is full. A caller that goes away
        does not stop the job: it runs to its end or its budget, then frees its worker."""
        if self._closed:
            raise JobFailed("the worker pool is closed")
        worker = await self._acquire()
        job = asyncio.ensure_future(self._job(worker, fn, args, timeout))
        return await asyncio.shield(job)

    async def _acquire(self) -> _Worker | None:
        """An idle worker, or None: a free place to start one in."""
        if self._idle:
            return self._idle.pop()
        if self._count < self._size:
            self._count += 1
            return None
        if len(self._waiting) >= self._max_waiting:
            raise Busy(self._busy)
        turn: asyncio.Future[_Worker | None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            return await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release(turn.result())  # handed over as the caller left: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(turn)
            raise

    def _release(self, worker: _Worker | None) -> None:
        """Hands ``worker`` (None: its place, the process gone) to the next in the queue."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(worker)
                return
        if worker is None:
            self._count -= 1
        else:
            self._idle.append(worker)

    async def _job(
        self, worker: _Worker | None, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
    ) -> Any:
        loop = asyncio.get_running_loop()
        if worker is not None and not worker.process.is_alive():  # died idle: not this job's
            self._all.discard(worker)
            await loop.run_in_executor(self._threads, _reap, worker)
            worker = None
        if worker is None:
            try:
                worker = await self._start()
            except BaseException:
                self._release(None)
                raise
        try:
            kind, value = await loop.run_in_executor(
                self._threads, _exchange, worker.conn, (fn, args), timeout
            )
        except (EOFError, OSError) as exc:  # it died (killed, out of memory, crashed)
            await self._discard(worker)
            raise JobFailed(f"the worker process died ({type(exc).__name__})") from None
        if kind == "timeout":
            self.killed += 1
            logger.warning(
                "%s: a job ran past its %.3g s budget; killed its worker (pid %s)",
                self.name, timeout, worker.process.pid,
            )  # fmt: skip
            await self._discard(worker)
            raise JobTimeout(f"over the budget of {timeout:g} s")
        self._release(worker)
        if kind == "error":
            raise JobFailed(value)
        return value

    async def _start(self) -> _Worker:
        # Started from the event loop's thread, never a pool thread: PR_SET_PDEATHSIG fires
        # when the *thread* that forked a process exits, and pool threads come and go.
        parent, child = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_serve,
            args=(child, os.getpid(), self._init, self._init_args),
            name=f"ketch-{self.name}",
            daemon=True,
        )
        process.start()
        child.close()
        worker = _Worker(process, parent)
        self._all.add(worker)
        loop = asyncio.get_running_loop()
        try:
            kind, value = await loop.run_in_executor(
                self._threads, _answer, parent, START_TIMEOUT_S
            )
        except (EOFError, OSError):
            kind, value = "error", "it exited"
        if kind != "ready":
            await self._discard(worker)
            logger.error("a %s worker process did not start: %s", self.name, value)
            raise StartFailed(f"a {self.name} worker process did not start; retry shortly")
        return worker

    async def _discard(self, worker: _Worker) -> None:
        """Kills ``worker``'s process and frees its place (a new one starts when needed)."""
        self._all.discard(worker)
        await asyncio.get_running_loop().run_in_executor(self._threads, _reap, worker)
        self._release(None)

    def close(self) -> None:
        """Kills every worker now (the server is stopping)."""
        self._closed = True
        for worker in list(self._all):
            with contextlib.suppress(Exception):
                worker.process.kill()
        for turn in self._waiting:
            if not turn.done():
                turn.cancel()
        self._threads.shutdown(wait=False, cancel_futures=True)


def _exchange(conn: Connection, job: tuple[Any, ...], timeout: float) -> tuple[str, Any]:
    conn.send(job)
    return _answer(conn, timeout)


def _answer(conn: Connection, timeout: float) -> tuple[str, Any]:
    if not conn.poll(timeout):
        return "timeout", None
    return conn.recv()


def _reap(worker: _Worker) -> None:
    with contextlib.suppress(Exception):
        worker.process.kill()
    worker.process.join(5)
    worker.conn.close()


def _serve(
    conn: Connection, parent_pid: int, init: Callable[..., None] | None, init_args: tuple
) -> None:
    """A worker process: ``init``, then run jobs until the pipe closes. Every failure goes back
    as ``("error", "TypeName: message")``; nothing here logs a traceback."""
    exit_with_parent(parent_pid, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops its workers itself
    lower_priority(thread=False)
    try:
        if init is not None:
            init(*init_args)
    except Exception as exc:
        conn.send(("error", _describe(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", fn(*args))
        except Exception as exc:
            reply = ("error", _describe(exc))
        try:
            conn.send(reply)
        except (OSError, ValueError):  # the parent is gone, or the answer cannot be sent
            return


def _describe(exc: BaseException, limit: int = 500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + "..."
