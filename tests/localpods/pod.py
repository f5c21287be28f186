"""One pod as local processes: its containers, their probes, restarts and termination.

A supervisor thread per pod does what a kubelet does for it: runs the init containers to
completion, starts the containers, polls startup, liveness and readiness probes at their
``periodSeconds`` (times ``time_scale``), restarts a container that exits or fails its liveness
probe with exponential back-off, and on termination runs the ``preStop`` sleep, sends SIGTERM
and, after ``terminationGracePeriodSeconds``, SIGKILL. Each container runs in its own session,
so killing it also kills the processes it started (engine, worker).

The pod also remembers when it became ready and when it last was: the Deployment controller
counts a pod available after ``minReadySeconds`` of readiness, and a Service keeps sending to a
pod for a while after it stopped being ready or was deleted (``routed``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Obj = dict[str, Any]

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
_TICK_S = 0.05


@dataclass
class _Probe:
    spec: Obj
    scale: float
    next_at: float = 0.0
    failures: int = 0

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def schedule(self, now: float) -> None:
        self.next_at = now + self.spec.get("periodSeconds", 10) * self.scale


@dataclass
class Container:
    """One container: how to run it (already localised by the pod) and its current state."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cwd: Path
    probes: dict[str, _Probe] = field(default_factory=dict)
    pre_stop_s: float = 0.0
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started: bool = False  # startup probe passed (or none)
    ready: bool = False
    next_start: float = 0.0
    started_at: float = 0.0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> bool:
        """Starts the process; False (the reason in its log) if it could not even be run."""
        with self.log_path.open("ab") as log:
            log.write(f"--- start #{self.restarts} {time.strftime('%X')}: {self.argv}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            except OSError as exc:  # like a container whose command does not exist
                log.write(f"cannot run the command: {exc}\n".encode())
                self.proc = None
                return False
        self.started_at = time.monotonic()
        self.started = "startup" not in self.probes
        self.ready = False
        now = time.monotonic()
        for probe in self.probes.values():
            probe.failures = 0
            probe.next_at = now + probe.spec.get("initialDelaySeconds", 0) * probe.scale
        return True

    def signal(self, sig: int, group: bool = False) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.proc.pid, sig)
            elif self.proc.poll() is None:
                self.proc.send_signal(sig)

    def log(self, tail: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-tail:]
        return ""


def http_probe_ok(port: int, spec: Obj) -> bool:
    """One kubelet-style HTTP probe: 200-399 within ``timeoutSeconds`` is a success."""
    get = spec["httpGet"]
    url = f"http://127.0.0.1:{port}{get.get('path', '/')}"
    try:
        with urllib.request.urlopen(url, timeout=spec.get("timeoutSeconds", 1)) as response:
            return 200 <= response.status < 400
    except Exception:  # refused, timed out, 4xx/5xx (HTTPError): all failures
        return False


class LocalPod:
    """A pod's containers under one supervisor thread."""

    def __init__(
        self,
        name: str,
        labels: dict[str, str],
        init: list[Container],
        containers: list[Container],
        probe_port: Callable[[Container, Obj], int],
        grace_s: float,
        time_scale: float,
    ) -> None:
        self.name = name
        self.labels = labels
        self.init = init
        self.containers = containers
        self._probe_port = probe_port
        self.grace_s = grace_s
        self.time_scale = time_scale
        self.terminating = False
        self.terminated = threading.Event()
        self.ready_since: float | None = None  # monotonic; None while not ready
        self.last_ready_at: float | None = None  # the last time it was seen ready
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._supervise, name=f"pod-{name}", daemon=True)

    @property
    def ready(self) -> bool:
        with self._lock:
            live = not self.terminating and not self.terminated.is_set()
            return live and all(c.ready for c in self.containers)

    def available(self, min_ready_s: float, now: float) -> bool:
        """Ready for ``min_ready_s`` without a break (the Deployment controller's available)."""
        since = self.ready_since
        return self.ready and since is not None and now - since >= min_ready_s

    def routed(self, lag_s: float, now: float) -> bool:
        """Whether a Service still sends it connections: while it is ready, and for ``lag_s``
        after it stopped being ready or was deleted, which is how late endpoint controllers and
        kube-proxy see the change on a cluster (the rendered preStop sleep covers that time)."""
        last = self.last_ready_at
        return self.ready or (last is not None and now - last < lag_s)

    def container(self, name: str) -> Container:
        return next(c for c in self.containers if c.name == name)

    def start(self) -> LocalPod:
        self._thread.start()
        return self

    def terminate(self, wait: bool = True) -> None:
        """preStop, SIGTERM, then SIGKILL after the grace period (as on pod deletion)."""
        self._note_readiness(time.monotonic())  # what the endpoints last saw
        with self._lock:
            if self.terminating:
                started = False
            else:
                self.terminating = started = True
        if started:
            threading.Thread(target=self._terminate, name=f"stop-{self.name}", daemon=True).start()
        if wait:
            self.terminated.wait(self.grace_s + 30)

    def join(self, timeout: float) -> None:
        """Waits for the supervisor thread (which starts nothing once terminating)."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def kill(self) -> None:
        """Immediate SIGKILL of everything (test teardown)."""
        self._stop.set()
        for c in [*self.init, *self.containers]:
            c.signal(signal.SIGKILL, group=True)
        self.terminated.set()

    # ---- the supervisor ----

    def _supervise(self) -> None:
        try:
            if not self._run_init():
                return
            while not self._stop.is_set() and not self.terminating:
                now = time.monotonic()
                for container in self.containers:
                    self._tend(container, now)
                self._note_readiness(now)
                time.sleep(_TICK_S)
        except Exception:
            logger.exception("pod %s: supervisor failed", self.name)

    def _note_readiness(self, now: float) -> None:
        ready = self.ready
        with self._lock:
            if not ready:
                self.ready_since = None
                return
            self.last_ready_at = now
            if self.ready_since is None:
                self.ready_since = now

    def _run_init(self) -> bool:
        for container in self.init:
            while not self._stop.is_set() and not self.terminating:
                code = container.proc.wait() if container.start() and container.proc else -1
                if code == 0:
                    break
                container.restarts += 1
                logger.warning("pod %s: init %s exited %d", self.name, container.name, code)
                time.sleep(self._backoff(container))
            else:
                return False
        return True

    def _tend(self, c: Container, now: float) -> None:
        if c.proc is None or c.proc.poll() is not None:
            if c.proc is not None:  # it exited: count the restart, wait the back-off
                code = c.proc.returncode
                c.signal(signal.SIGKILL, group=True)  # whatever it started goes with it
                c.restarts += 1
                c.ready = c.started = False
                c.next_start = now + self._backoff(c)
                logger.warning(
                    "pod %s: container %s exited %s; restart %d in %.1f s",
                    self.name, c.name, code, c.restarts, c.next_start - now,
                )  # fmt: skip
                c.proc = None
            if self.terminating or self._stop.is_set():
                return  # a pod being deleted restarts nothing
            if now >= c.next_start and not c.start():
                c.restarts += 1
                c.next_start = now + self._backoff(c)
                logger.warning("pod %s: container %s cannot start", self.name, c.name)
            return
        if not c.started:
            self._check(c, "startup", now, on_fail=lambda: self._restart(c, "startup probe"))
            return
        self._check(c, "liveness", now, on_fail=lambda: self._restart(c, "liveness probe"))
        if "readiness" in c.probes:
            self._check(c, "readiness", now, on_fail=None)
        else:
            c.ready = True

    def _check(self, c: Container, kind: str, now: float, on_fail: Callable | None) -> None:
        probe = c.probes.get(kind)
        if probe is None or not probe.due(now):
            return
        probe.schedule(now)
        ok = http_probe_ok(self._probe_port(c, probe.spec), probe.spec)
        if ok:
            probe.failures = 0
            if kind == "startup":
                c.started = True
            elif kind == "readiness":
                c.ready = True
            return
        probe.failures += 1
        if probe.failures >= probe.spec.get("failureThreshold", 3):
            if kind == "readiness":
                c.ready = False
            elif on_fail is not None:
                on_fail()

    def _restart(self, c: Container, why: str) -> None:
        logger.warning("pod %s: container %s failed its %s; killing it", self.name, c.name, why)
        c.signal(signal.SIGKILL, group=True)

    def _backoff(self, c: Container) -> float:
        return min(BACKOFF_START_S * 2 ** max(0, c.restarts - 1), BACKOFF_MAX_S) * self.time_scale

    # ---- termination ----

    def _terminate(self) -> None:
        deadline = time.monotonic() + self.grace_s
        threads = [
            threading.Thread(target=self._stop_container, args=(c, deadline), daemon=True)
            for c in self.containers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._stop.set()
        self.terminated.set()

    def _stop_container(self, c: Container, deadline: float) -> None:
        if c.pre_stop_s:
            time.sleep(min(c.pre_stop_s * self.time_scale, max(0.0, deadline - time.monotonic())))
        c.signal(signal.SIGTERM)
        while c.running and time.monotonic() < deadline:
            time.sleep(_TICK_S)
        c.signal(signal.SIGKILL, group=True)
        if c.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(5)
