"""The pod worker: one thread per pod, doing what the kubelet's pod worker and runtime manager do.

The worker syncs its pod every half second or when woken (a watch event, a probe result):

1. sandbox: the network namespace and address (``network``), then the volumes and etc files
   (``volumes``); failures are retried and shown as FailedCreatePodSandBox/FailedMount events;
2. init containers, one after another, each to exit 0; a failing one is restarted with back-off
   unless ``restartPolicy`` is Never (then the pod fails);
3. containers: started (image, environment, mounts, user resolved at each start), probed
   (startup, then liveness and readiness), restarted per ``restartPolicy`` with the kubelet's
   back-off (the first restart at once, then ``backoff_base`` doubling up to ``backoff_max``
   after the previous restart, reset after ten minutes without a restart; CrashLoopBackOff
   meanwhile); a failed liveness or startup probe kills the container like a deletion would
   (preStop, SIGTERM, SIGKILL after the grace period);
4. status: patched (JSON merge patch of ``/status``) when it changed, at most every
   ``REPORT_INTERVAL_S``;
5. termination, on deletion (or agent stop): probes stop, each running container gets its
   preStop hook and SIGTERM, and SIGKILL when the grace period (``deletionGracePeriodSeconds``,
   counted from when the worker saw the deletion, preStop included, at least 2 s after SIGTERM
   as in the kubelet) is over; then the sandbox is torn down, the final status (terminal phase)
   reported and the pod deleted with grace period 0 and its uid as precondition.

A pod whose containers all finished for good gets phase Succeeded or Failed and its sandbox is
torn down at once; the object stays until someone deletes it.

A kubelet splits this among the pod workers, PLEG (container events from the runtime), the
probe, status and volume managers; it also enforces activeDeadlineSeconds, resizes pods in
place and restarts containers whose spec changed, none of which this does. A started agent
takes over its pods' statuses (restart counts, last states) and runs their containers again:
its containers died with the previous agent, as if the pod sandbox had changed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localcluster.nodeagent import envs, status
from localcluster.nodeagent.api import ApiError, now, pod_path
from localcluster.nodeagent.images import Image, PullError
from localcluster.nodeagent.network import NetworkError
from localcluster.nodeagent.probes import ProbeWorker, run_handler
from localcluster.nodeagent.runtime import Process, StartError, exec_in
from localcluster.nodeagent.volumes import (
    PodFiles,
    Sources,
    VolumeError,
    host_path,
    object_data,
)

logger = logging.getLogger(__name__)

Obj = dict[str, Any]
TICK_S = 0.5
REPORT_INTERVAL_S = 0.5
RETRY_S = 5.0  # a configuration or sandbox error is retried after this long
BACKOFF_RESET_S = 600.0
MIN_KILL_GRACE_S = 2.0
CACHE_TTL_S = 5.0


@dataclass
class Container:
    """One container's spec and runtime state; ``api_status()`` is its containerStatus."""

    spec: Obj
    init: bool
    state: Obj
    restarts: int = 0
    created: bool = False  # a start was attempted before: the next one is a restart
    proc: Process | None = None
    image_id: str = ""
    container_id: str = ""
    last_state: Obj = field(default_factory=dict)
    started: bool = False
    done: bool = False  # an init container that succeeded
    killing: bool = False
    probes: dict[str, ProbeWorker] = field(default_factory=dict)
    exec_base: Obj = field(default_factory=dict)
    backoff_s: float = 0.0
    last_start: float = 0.0
    not_before: float = 0.0
    pull_backoff_s: float = 0.0
    last_exit: int | None = None

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def ready(self) -> bool:
        if self.proc is None or not self.started or self.killing:
            return False
        probe = self.probes.get("readiness")
        return probe is None or bool(probe.result)

    def api_status(self) -> Obj:
        out: Obj = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": self.image_id,
            "ready": self.ready,
            "restartCount": self.restarts,
            "started": self.proc is not None and self.started,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            out["containerID"] = self.container_id
        return out

    def stop_probes(self) -> None:
        for probe in self.probes.values():
            probe.stop()
        self.probes.clear()


class PodWorker:
    """Runs one pod (see the module docstring); ``host`` is the agent."""

    def __init__(self, host: Any, pod: Obj) -> None:
        self.host = host
        self.pod = pod
        meta = pod["metadata"]
        self.uid, self.ns, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.key = f"{self.ns}/{self.name}"
        self.files = PodFiles(host.layout.directory / "pods", pod)
        spec = pod["spec"]
        self.host_network = bool(spec.get("hostNetwork"))
        self.containers = [
            *(
                Container(c, True, _waiting("PodInitializing"))
                for c in spec.get("initContainers", [])
            ),
            *(Container(c, False, _waiting("ContainerCreating")) for c in spec["containers"]),
        ]
        self.ip: str | None = None
        self.sandbox_ready = False
        self.sandbox_error_at = 0.0
        self.start_time = (pod.get("status") or {}).get("startTime") or now()
        self.terminal: str | None = None
        self.deleting = False
        self.removed = False  # the object is gone from the API
        self.shutdown = False  # the agent is stopping
        self.grace_deadline: float | None = None
        self.kill_now = False  # the agent got a second signal
        self.wake = threading.Event()
        self.finished = threading.Event()
        self._last_sent: Obj | None = None
        self._last_sent_at = 0.0
        self._cache: dict[tuple[str, str], tuple[float, Any]] = {}
        self._events: dict[tuple[str, str], float] = {}
        old_phase = (pod.get("status") or {}).get("phase")
        self.frozen = old_phase in ("Succeeded", "Failed")  # never run again, status kept
        if self.frozen:
            self.terminal = old_phase
        self._resume(pod)
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.key}", daemon=True)

    def _resume(self, pod: Obj) -> None:
        """Takes over what the API says of the containers (an earlier agent ran them): restart
        counts and last states carry on, finished init containers stay done, containers that
        ran are restarted (or, if their restartPolicy says not to, stay terminated)."""
        old = pod.get("status") or {}
        by_name = {
            s["name"]: s
            for s in [*old.get("initContainerStatuses", []), *old.get("containerStatuses", [])]
        }
        for c in self.containers:
            s = by_name.get(c.name)
            if not s:
                continue
            c.restarts, c.image_id = s.get("restartCount", 0), s.get("imageID", "")
            c.last_state = s.get("lastState") or {}
            state = s.get("state") or {}
            if "running" in state:  # lost with the earlier agent
                state = {"terminated": {
                    "exitCode": 137, "reason": "ContainerStatusUnknown",
                    "message": "The container could not be located when the node agent restarted",
                    "startedAt": state["running"].get("startedAt"), "finishedAt": now(),
                }}  # fmt: skip
            if "terminated" in state:
                c.state, c.created = state, True
                c.last_exit = state["terminated"].get("exitCode", 1)
                c.done = c.init and c.last_exit == 0
            elif c.last_state.get("terminated"):
                c.created = True
                c.last_exit = c.last_state["terminated"].get("exitCode", 1)

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        self.thread.start()

    def update(self, pod: Obj) -> None:
        """A newer version of the pod from the watch."""
        if _older(pod, self.pod):
            return
        self.pod = pod
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if pod["metadata"].get("deletionTimestamp") and not self.deleting:
            self._begin_termination(grace)
        elif self.deleting and grace is not None and self.grace_deadline is not None:
            # deleted again with a shorter grace period (e.g. --force): the kubelet shortens it
            self.grace_deadline = min(self.grace_deadline, time.monotonic() + float(grace))
        self.wake.set()

    def removed_from_api(self) -> None:
        """The pod object is gone (deleted with grace period 0, or by someone else)."""
        self.removed = True
        if not self.deleting:
            self._begin_termination(self.pod["metadata"].get("deletionGracePeriodSeconds"))
        self.wake.set()

    def stop_for_shutdown(self, grace_cap_s: float) -> None:
        self.shutdown = True
        if not self.deleting:
            self._begin_termination(None, cap=grace_cap_s)
        self.wake.set()

    def kill(self) -> None:
        """Skip what is left of the grace periods: SIGKILL now."""
        self.kill_now = True
        self.wake.set()

    def _deadline(self) -> float:
        return self.grace_deadline if self.grace_deadline is not None else time.monotonic()

    def _begin_termination(self, grace: int | None, cap: float | None = None) -> None:
        self.deleting = True
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        seconds = float(grace) if cap is None else min(float(grace), cap)
        self.grace_deadline = time.monotonic() + seconds

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            if self.pod["metadata"].get("deletionTimestamp"):
                self._begin_termination(self.pod["metadata"].get("deletionGracePeriodSeconds"))
            while not self.deleting:
                pause = TICK_S
                try:
                    self._sync()
                except Exception as exc:  # a bug or a surprise: this pod waits, no other
                    logger.exception("pod %s: sync failed", self.key)
                    self.event("Warning", "FailedSync", f"error syncing pod: {exc}")
                    pause = RETRY_S
                self._report()
                self.wake.wait(pause)
                self.wake.clear()
            self._terminate()
        except Exception:
            logger.exception("pod %s: worker failed", self.key)
        finally:
            self.finished.set()

    def _sync(self) -> None:
        if self.terminal:
            return
        if not self.sandbox_ready:
            if time.monotonic() < self.sandbox_error_at + RETRY_S:
                return
            if not self._create_sandbox():
                return
        with contextlib.suppress(Exception):
            self.files.refresh_tokens(self._token)
        if self._sync_init():
            for c in self.containers:
                if not c.init:
                    self._sync_container(c)
        phase = self._phase()
        if phase in ("Succeeded", "Failed") and all(c.proc is None for c in self.containers):
            self.terminal = phase
            for c in self.containers:
                c.stop_probes()
            self._teardown(keep_files=True)

    def _phase(self, terminal: bool = False) -> str:
        inits = [c.api_status() for c in self.containers if c.init]
        regular = [c.api_status() for c in self.containers if not c.init]
        return self.terminal or status.phase(self.pod["spec"], inits, regular, terminal)

    # ------------------------------------------------------------------ sandbox
    def _create_sandbox(self) -> bool:
        layout = self.host.layout
        try:
            if self.host_network:
                self.ip = str(layout.gateway)
            else:
                self.ip = self.host.network.setup(self.uid)
        except (NetworkError, OSError) as exc:
            self.sandbox_error_at = time.monotonic()
            self.event("Warning", "FailedCreatePodSandBox", f"Failed to create pod sandbox: {exc}")
            return False
        self.sandbox_ready = True
        self.wake.set()
        try:
            sources = Sources(self._lookup, self._token, self._claim, self.host.allocatable)
            self.files.prepare(self._view(), sources)
            self.files.write_etc(self.pod, self.ip, str(layout.dns_ip), "cluster.local")
        except (VolumeError, OSError, ApiError) as exc:
            self.sandbox_ready = False
            self.sandbox_error_at = time.monotonic()
            self.event("Warning", "FailedMount", str(exc))
            return False
        return True

    def _teardown(self, keep_files: bool = False) -> None:
        """Removes the network namespace and veth, unmounts and (unless kept) removes files."""
        for c in self.containers:
            if c.proc is not None:
                c.proc.cleanup()
        if not self.host_network:
            with contextlib.suppress(Exception):
                # stopped with the agent: its address stays reserved for when it runs again
                self.host.network.teardown(self.uid, release=not self.shutdown)
        self.sandbox_ready = False
        if not keep_files:
            self.files.remove(self.host.config.keep_logs)

    # ------------------------------------------------------------------ containers
    def _sync_init(self) -> bool:
        """Advances the init containers; True once all have succeeded."""
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.containers:
            if not c.init or c.done:
                continue
            if c.spec.get("restartPolicy") == "Always":  # a native sidecar
                self._sync_container(c)
                if not c.started:
                    return False
                continue
            if c.proc is not None:
                code = c.proc.poll()
                if code is None:
                    return False
                self._exited(c, code)
                if code == 0:
                    c.done = True
                    continue
            if c.last_exit is not None and policy == "Never":
                return False
            self._maybe_start(c)
            return False
        return True

    def _sync_container(self, c: Container) -> None:
        if c.proc is not None:
            code = c.proc.poll()
            if code is None:
                self._check_probes(c)
                return
            self._exited(c, code)
        policy = c.spec.get("restartPolicy") or self.pod["spec"].get("restartPolicy", "Always")
        if c.created and (policy == "Never" or (policy == "OnFailure" and c.last_exit == 0)):
            return
        self._maybe_start(c)

    def _exited(self, c: Container, code: int) -> None:
        assert c.proc is not None
        c.proc.cleanup()
        c.stop_probes()
        c.state = {"terminated": {
            "exitCode": code, "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.state.get("running", {}).get("startedAt", now()),
            "finishedAt": now(), "containerID": c.container_id,
        }}  # fmt: skip
        c.proc, c.started, c.killing, c.last_exit = None, False, False, code
        logger.info("pod %s: container %s exited %d", self.key, c.name, code)
        self.wake.set()

    def _maybe_start(self, c: Container) -> None:
        """Starts ``c`` unless it waits for its back-off; shows why it waits otherwise."""
        mono = time.monotonic()
        if mono < c.not_before:
            return
        if c.created:
            limit = self.host.config.backoff_max
            expired = mono - c.last_start > BACKOFF_RESET_S
            if c.backoff_s and not expired and mono < c.last_start + c.backoff_s:
                c.not_before = c.last_start + c.backoff_s
                self._move_to_last_state(c)
                delay = round(c.backoff_s)
                c.state = _waiting(
                    "CrashLoopBackOff",
                    f"back-off {delay}s restarting failed container={c.name} "
                    f"pod={self.name}_{self.ns}({self.uid})",
                )
                who = f"{c.name} in pod {self.name}_{self.ns}({self.uid})"
                self.event("Warning", "BackOff", f"Back-off restarting failed container {who}", c)
                return
            base = self.host.config.backoff_base
            c.backoff_s = base if not c.backoff_s or expired else min(2 * c.backoff_s, limit)
        self._start(c)

    def _move_to_last_state(self, c: Container) -> None:
        if "terminated" in c.state:
            c.last_state = dict(c.state)

    def _start(self, c: Container) -> None:
        spec = c.spec
        try:
            image = self.host.images.resolve(spec.get("image", ""))
            took = self.host.images.pulled(image)
        except PullError as exc:
            self._pull_failed(c, str(exc))
            return
        c.pull_backoff_s = 0.0
        ref = image.reference
        if took is not None:
            self.event("Normal", "Pulled", f'Successfully pulled image "{ref}" in {took:.3f}s', c)
        elif c.state.get("waiting", {}).get("reason") in ("ContainerCreating", "PodInitializing"):
            self.event("Normal", "Pulled", f'Container image "{ref}" already present on machine', c)
        try:
            launch = self._launch_spec(c, image)
        except (envs.ConfigError, VolumeError, ApiError, OSError, ValueError) as exc:
            c.not_before = time.monotonic() + RETRY_S
            c.state = _waiting("CreateContainerConfigError", str(exc))
            self.event("Warning", "Failed", f"Error: {exc}", c)
            return
        self._move_to_last_state(c)
        if c.created:
            c.restarts += 1
        c.created = True
        c.last_start = time.monotonic()
        c.image_id = image.image_id
        log = self.files.dir / c.name / f"{c.restarts}.log"
        try:
            c.proc = Process.start(launch, log, self.files.dir / c.name / "pid")
        except (StartError, OSError) as exc:
            c.container_id = ""
            c.state = {"terminated": {
                "exitCode": 128, "reason": "StartError", "message": str(exc),
                "startedAt": "1970-01-01T00:00:00Z", "finishedAt": now(),
            }}  # fmt: skip
            c.last_exit = 128
            self.event("Warning", "Failed", f"Error: {exc}", c)
            return
        c.container_id = f"ketch://{c.proc.pid}"
        c.state = {"running": {"startedAt": now()}}
        c.started = "startupProbe" not in spec
        self.event("Normal", "Created", f"Created container: {c.name}", c)
        self.event("Normal", "Started", f"Started container {c.name}", c)
        post = spec.get("lifecycle", {}).get("postStart")
        if post:
            ok, message = run_handler(post, spec, self.ip or "", self._exec_fn(c), 30.0)
            if not ok:
                self.event("Warning", "FailedPostStartHook", message, c)
                self._kill_async(c, "FailedPostStartHook")
                return
        if "startupProbe" in spec:
            self._start_probe(c, "startup")
        else:
            self._start_probe(c, "liveness")
            self._start_probe(c, "readiness")

    def _pull_failed(self, c: Container, message: str) -> None:
        mono = time.monotonic()
        if c.pull_backoff_s and c.state.get("waiting", {}).get("reason") == "ErrImagePull":
            c.state = _waiting(
                "ImagePullBackOff", f'Back-off pulling image "{c.spec.get("image")}": {message}'
            )
            self.event("Normal", "BackOff", f'Back-off pulling image "{c.spec.get("image")}"', c)
            c.not_before = mono + c.pull_backoff_s
            return
        base, limit = self.host.config.backoff_base, self.host.config.backoff_max
        c.pull_backoff_s = min(2 * c.pull_backoff_s, limit) if c.pull_backoff_s else base
        c.state = _waiting("ErrImagePull", message)
        self.event(
            "Warning", "Failed", f'Failed to pull image "{c.spec.get("image")}": {message}', c
        )
        self.event("Warning", "Failed", "Error: ErrImagePull", c)
        c.not_before = mono + min(1.0, base)

    def _launch_spec(self, c: Container, image: Image) -> Obj:
        """What launch.py needs: argv, env, user, mounts (ConfigError etc. if it cannot)."""
        pod, spec = self._view(), c.spec
        pod_sc = pod["spec"].get("securityContext") or {}
        sc = spec.get("securityContext") or {}
        service_env = envs.service_env(
            self._services(), str(self.host.kubernetes_ip),
            pod["spec"].get("enableServiceLinks", True),
        )  # fmt: skip
        env_vars = envs.container_env(pod, spec, self._lookup, service_env, self.host.allocatable)
        argv = envs.command_line(spec, image.entrypoint, image.cmd, env_vars)
        uid = _first(sc.get("runAsUser"), pod_sc.get("runAsUser"), image.uid, 0)
        gid = _first(sc.get("runAsGroup"), pod_sc.get("runAsGroup"))
        if gid is None:
            gid = image.gid if image.uid == uid and image.gid is not None else _passwd_gid(uid)
        if _first(sc.get("runAsNonRoot"), pod_sc.get("runAsNonRoot")) and uid == 0:
            who = f'pod: "{self.name}_{self.ns}({self.uid})", container: {c.name}'
            raise envs.ConfigError(f"container has runAsNonRoot and image will run as root ({who})")
        groups = list(dict.fromkeys(
            [*pod_sc.get("supplementalGroups", []),
             *([pod_sc["fsGroup"]] if pod_sc.get("fsGroup") is not None else [])]
        ))  # fmt: skip
        hostname = pod["spec"].get("hostname") or self.name
        base_env = image.base_env() | {"HOSTNAME": hostname, "HOME": _home(uid, image)}
        full_env = base_env | env_vars
        mounts, masks = self.files.container_mounts(pod, spec, image, env_vars)
        for m in mounts:
            if m.create == "host":
                self.host.mountpoints.ensure(m.target, directory=_is_dir(m.source))
        common = {
            "env": full_env,
            "cwd": spec.get("workingDir") or image.working_dir,
            "uid": int(uid), "gid": int(gid), "groups": [int(g) for g in groups],
            "noNewPrivs": sc.get("allowPrivilegeEscalation") is False,
            "dropCaps": "ALL" in ((sc.get("capabilities") or {}).get("drop") or []),
        }  # fmt: skip
        c.exec_base = common
        return {
            **common,
            "argv": argv,
            "netns": None
            if self.host_network
            else f"/run/netns/{self.host.network.netns(self.uid)}",
            "hostname": socket.gethostname() if self.host_network else hostname,
            "mounts": [{**m.as_json(), "create": m.create} for m in mounts],
            "masks": masks,
            "readOnlyRoot": bool(sc.get("readOnlyRootFilesystem")),
        }

    # ------------------------------------------------------------------ probes and kills
    def _exec_fn(self, c: Container) -> Any:
        def run(argv: list[str], timeout: float) -> tuple[int | None, str]:
            if c.proc is None:
                return 1, "container is not running"
            return exec_in(c.proc, argv, c.exec_base, timeout)

        return run

    def _start_probe(self, c: Container, kind: str) -> None:
        spec = c.spec.get(f"{kind}Probe")
        if not spec or c.proc is None:
            return
        worker = ProbeWorker(
            kind, spec, c.spec, self.ip or "", self._exec_fn(c), c.proc.started_at,
            on_change=self.wake.set,
            on_failure=lambda k, msg: self.event(
                "Warning", "Unhealthy", f"{k.capitalize()} probe failed: {msg}", c
            ),
        )  # fmt: skip
        c.probes[kind] = worker
        worker.start()

    def _check_probes(self, c: Container) -> None:
        if c.killing:
            return
        if not c.started:
            probe = c.probes.get("startup")
            if probe is not None and probe.result:
                c.started = True
                probe.stop()
                self._start_probe(c, "liveness")
                self._start_probe(c, "readiness")
            elif probe is not None and probe.result is False:
                self.event(
                    "Normal",
                    "Killing",
                    f"Container {c.name} failed startup probe, will be restarted",
                    c,
                )
                self._kill_async(c, "startup probe")
            return
        probe = c.probes.get("liveness")
        if probe is not None and probe.result is False:
            self.event(
                "Normal",
                "Killing",
                f"Container {c.name} failed liveness probe, will be restarted",
                c,
            )
            self._kill_async(c, "liveness probe")

    def _kill_async(self, c: Container, why: str) -> None:
        c.killing = True
        for kind in ("startup", "liveness"):
            if kind in c.probes:
                c.probes.pop(kind).stop()
        spec = c.spec.get("livenessProbe") or {}
        grace = spec.get("terminationGracePeriodSeconds") or self.pod["spec"].get(
            "terminationGracePeriodSeconds", 30
        )
        deadline = time.monotonic() + float(grace)
        threading.Thread(
            target=self._stop_container,
            args=(c, lambda: deadline),
            name=f"kill-{c.name}",
            daemon=True,
        ).start()
        logger.info("pod %s: killing container %s (%s)", self.key, c.name, why)

    def _stop_container(self, c: Container, deadline: Any) -> None:
        """preStop, SIGTERM to the main process, SIGKILL to the group at ``deadline()`` (at
        least MIN_KILL_GRACE_S after SIGTERM, unless ``kill_now``)."""
        proc = c.proc
        if proc is None or proc.poll() is not None:
            return
        pre = c.spec.get("lifecycle", {}).get("preStop")
        if pre and not self.kill_now:
            budget = max(0.0, deadline() - time.monotonic())
            ok, message = run_handler(pre, c.spec, self.ip or "", self._exec_fn(c), budget)
            if not ok:
                self.event("Warning", "FailedPreStopHook", f"PreStopHook failed: {message}", c)
        proc.signal_main(signal.SIGTERM)
        term_at = time.monotonic()
        while proc.poll() is None and not self.kill_now:
            if time.monotonic() >= max(deadline(), term_at + MIN_KILL_GRACE_S):
                break
            proc.wait(0.1)
        if proc.poll() is None:
            proc.signal(signal.SIGKILL)
            proc.wait(10)
        self.wake.set()

    # ------------------------------------------------------------------ termination
    def _terminate(self) -> None:
        assert self.grace_deadline is not None
        running = [c for c in self.containers if c.proc is not None]
        for c in self.containers:
            c.stop_probes()
        if running:
            names = ", ".join(c.name for c in running)
            self.event("Normal", "Killing", f"Stopping container {names}")
        threads = [
            threading.Thread(target=self._stop_container, args=(c, self._deadline), daemon=True)
            for c in running
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(TICK_S)
            self._reap()
            self._report()
        self._reap()
        self._teardown()
        if self.shutdown and not self.removed and not self.pod["metadata"].get("deletionTimestamp"):
            self._report(force=True)
            return
        if self.removed:
            return
        if not self.terminal:
            self.terminal = self._phase(terminal=True)
        self._report(force=True)
        try:
            self.host.api.delete(
                pod_path(self.ns, self.name),
                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )
            logger.info("pod %s: deleted", self.key)
        except ApiError as exc:
            if exc.status not in (404, 409):
                logger.warning("pod %s: final delete failed: %s", self.key, exc)

    def _reap(self) -> None:
        for c in self.containers:
            if c.proc is not None:
                code = c.proc.poll()
                if code is not None:
                    self._exited(c, code)

    # ------------------------------------------------------------------ status
    def _view(self) -> Obj:
        """The pod with this node's addresses in its status (for the downward API)."""
        st = dict(self.pod.get("status") or {})
        gateway = str(self.host.layout.gateway)
        st |= {"hostIP": gateway, "hostIPs": [{"ip": gateway}]}
        if self.ip:
            st |= {"podIP": self.ip, "podIPs": [{"ip": self.ip}]}
        return {**self.pod, "status": st}

    def build_status(self) -> Obj:
        spec = self.pod["spec"]
        inits = [c.api_status() for c in self.containers if c.init]
        regular = [c.api_status() for c in self.containers if not c.init]
        # A deleted pod ends Succeeded or Failed; one stopped with the agent is only not running.
        stopped = all(c.proc is None for c in self.containers)
        phase = self._phase(terminal=self.deleting and not self.shutdown and stopped)
        gen = self.pod["metadata"].get("generation")
        old = (self.pod.get("status") or {}).get("conditions") or []
        conds = status.conditions(old, spec, inits, regular, phase, self.sandbox_ready, now(), gen)
        gateway = str(self.host.layout.gateway)
        out: Obj = {
            "phase": phase,
            "conditions": conds,
            "hostIP": gateway,
            "hostIPs": [{"ip": gateway}],
            "startTime": self.start_time,
            "qosClass": (self.pod.get("status") or {}).get("qosClass") or status.qos_class(spec),
            "containerStatuses": regular,
        }
        if inits:
            out["initContainerStatuses"] = inits
        if self.ip:
            out |= {"podIP": self.ip, "podIPs": [{"ip": self.ip}]}
        if gen is not None:
            out["observedGeneration"] = gen
        return out

    def _report(self, force: bool = False) -> None:
        if self.removed or self.frozen:
            return
        new = self.build_status()
        comparable = _without_times(new)
        if comparable == self._last_sent:
            return
        mono = time.monotonic()
        if not force and mono - self._last_sent_at < REPORT_INTERVAL_S:
            return
        try:
            patched = self.host.api.patch(pod_path(self.ns, self.name, "status"), {"status": new})
        except (ApiError, OSError) as exc:
            if isinstance(exc, ApiError) and exc.status == 404:
                self.removed_from_api()
            else:  # tried again in a few seconds
                logger.warning("pod %s: status update failed: %s", self.key, exc)
                self._last_sent_at = mono + RETRY_S
            return
        self._last_sent, self._last_sent_at = comparable, mono
        if patched.get("metadata", {}).get("uid") == self.uid:
            self.pod = patched

    # ------------------------------------------------------------------ API sources
    def _cached(self, key: tuple[str, str], fetch: Any) -> Any:
        hit = self._cache.get(key)
        if hit and time.monotonic() - hit[0] < CACHE_TTL_S:
            return hit[1]
        value = fetch()
        self._cache[key] = (time.monotonic(), value)
        return value

    def _lookup(self, kind: str, name: str) -> dict[str, str | bytes] | None:
        plural = {"configmap": "configmaps", "secret": "secrets"}[kind]

        def fetch() -> Any:
            try:
                obj = self.host.api.get(f"/api/v1/namespaces/{self.ns}/{plural}/{name}")
            except ApiError as exc:
                if exc.status == 404:
                    return None
                raise
            return object_data(kind, obj)

        return self._cached((kind, name), fetch)

    def _claim(self, name: str) -> Path:
        """The host path of a PersistentVolumeClaim's volume (hostPath or local)."""
        try:
            pvc = self.host.api.get(f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims/{name}")
        except ApiError as exc:
            if exc.status == 404:
                raise envs.ConfigError(f'persistentvolumeclaim "{name}" not found') from exc
            raise
        volume = (pvc.get("spec") or {}).get("volumeName")
        if (pvc.get("status") or {}).get("phase") != "Bound" or not volume:
            raise envs.ConfigError(f'persistentvolumeclaim "{name}" is not bound')
        pv = self.host.api.get(f"/api/v1/persistentvolumes/{volume}")["spec"]
        source = pv.get("hostPath") or pv.get("local")
        if not source:
            raise envs.ConfigError(f"PersistentVolume {volume}: only hostPath and local volumes")
        return host_path(source)

    def _services(self) -> list[Obj]:
        def fetch() -> list[Obj]:
            try:
                return self.host.api.get(f"/api/v1/namespaces/{self.ns}/services")["items"]
            except (ApiError, OSError) as exc:
                logger.warning("pod %s: cannot list services: %s", self.key, exc)
                return []

        if self.pod["spec"].get("enableServiceLinks", True) is False:
            return []
        return self._cached(("services", ""), fetch)

    def _token(self, audience: str | None, expiration: int) -> tuple[str, float]:
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience] if audience else None,
                "expirationSeconds": expiration,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": self.name,
                    "uid": self.uid,
                },
            },
        }
        answer = self.host.api.post(
            f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token", body
        )
        return answer["status"]["token"], float(expiration)

    # ------------------------------------------------------------------ events
    def event(self, kind: str, reason: str, message: str, c: Container | None = None) -> None:
        """Posts an Event about the pod (repeats of one reason and message at most every 30 s)."""
        key = (reason, message)
        mono = time.monotonic()
        if mono - self._events.get(key, -1e9) < 30:
            return
        self._events[key] = mono
        field_path = ""
        if c is not None:
            field_path = f"spec.{'initContainers' if c.init else 'containers'}{{{c.name}}}"
        self.host.post_event(self.pod, kind, reason, message, field_path)


def _waiting(reason: str, message: str = "") -> Obj:
    state: Obj = {"reason": reason}
    if message:
        state["message"] = message
    return {"waiting": state}


def _without_times(st: Obj) -> Obj:
    return {
        **st,
        "conditions": [
            {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in st["conditions"]
        ],
    }


def _older(new: Obj, old: Obj) -> bool:
    a, b = new["metadata"].get("resourceVersion", ""), old["metadata"].get("resourceVersion", "")
    return a.isdigit() and b.isdigit() and int(a) < int(b)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _passwd_gid(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return 0


def _home(uid: int, image: Image) -> str:
    if "HOME" in image.env:
        return image.env["HOME"]
    try:
        return pwd.getpwuid(uid).pw_dir
    except KeyError:
        return "/"


def _is_dir(source: str | None) -> bool:
    return source is None or os.path.isdir(source)
