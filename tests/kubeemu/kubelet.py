"""A kubelet for every pod: what its containers do is what a test said they do.

A test sets a `PodBehaviour` for one pod, for the pods of one Deployment, or for every pod that
runs an image (the most specific wins; without one, pods run and turn ready at once). Readiness
is not instant when the behaviour says so: "ready" pods pass their readiness probe
`ready_delay` seconds after their containers started, "never-ready" pods never do, and init
containers can fail (see podstatus.POD_MODES). The kubelet remembers when each pod turned ready,
which the ReplicaSet controller needs for `minReadySeconds`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubeemu.podstatus import POD_MODES, RUNNING_MODES, is_ready, pod_status
from kubeemu.store import Store
from kubeemu.timefmt import now_rfc3339

PODS = ("", "pods")
REPLICASETS = ("apps", "replicasets")
SCOPES = ("pod", "deployment", "image")


@dataclass(frozen=True)
class PodBehaviour:
    """What a pod's containers do: `mode` (podstatus.POD_MODES), how long the readiness probe
    takes to pass once they run, and which init container fails in the init-* modes."""

    mode: str = "ready"
    ready_delay: float = 0.0
    init_container: str = ""

    def __post_init__(self) -> None:
        if self.mode not in POD_MODES:
            raise ValueError(f"unknown pod mode {self.mode!r}; one of {', '.join(POD_MODES)}")
        if self.ready_delay < 0:
            raise ValueError("readyDelaySeconds must be >= 0")


class Behaviours:
    """The behaviours tests set, by scope: ("pod", ns, name), ("deployment", ns, name) or
    ("image", "", image)."""

    def __init__(self) -> None:
        self.rules: dict[tuple[str, str, str], PodBehaviour] = {}

    def set(self, scope: str, namespace: str, name: str, behaviour: PodBehaviour) -> None:
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; one of {', '.join(SCOPES)}")
        self.rules[(scope, "" if scope == "image" else namespace, name)] = behaviour

    def of(self, pod: dict[str, Any], deployment: str | None) -> PodBehaviour:
        meta = pod["metadata"]
        ns = meta.get("namespace", "")
        found = self.rules.get(("pod", ns, meta["name"]))
        if found is None and deployment:
            found = self.rules.get(("deployment", ns, deployment))
        if found is None and self.rules:
            spec = pod.get("spec") or {}
            for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
                found = found or self.rules.get(("image", "", c.get("image", "")))
        return found or PodBehaviour()

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "scope": scope,
                "namespace": ns,
                scope: name,
                "mode": b.mode,
                "readyDelaySeconds": b.ready_delay,
                "initContainer": b.init_container,
            }
            for (scope, ns, name), b in sorted(self.rules.items())
        ]


class Kubelet:
    """Writes every pod's status from its behaviour; asks to look again when a delay ends."""

    def __init__(
        self,
        store: Store,
        behaviours: Behaviours,
        schedule: Callable[[tuple[str, str], tuple[str, str], float], None],
        pod_ip_prefix: str = "10.244",
    ) -> None:
        self.store = store
        self.behaviours = behaviours
        self.schedule = schedule
        self.pod_ip_prefix = pod_ip_prefix
        self.started: dict[str, float] = {}  # pod uid -> monotonic time its containers started
        self.ready_since: dict[str, float] = {}  # pod uid -> monotonic time it turned ready
        self._ip_next = 1

    def sync(self, ns: str, name: str) -> None:
        pod = self.store.peek(PODS, ns, name)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            return
        uid = pod["metadata"]["uid"]
        behaviour = self.behaviours.of(pod, self.deployment_of(pod))
        now = time.monotonic()
        ready = False
        if behaviour.mode in RUNNING_MODES:
            started = self.started.setdefault(uid, now)
            wait = started + behaviour.ready_delay - now
            ready = behaviour.mode == "ready" and wait <= 0
            if behaviour.mode == "ready" and wait > 0:
                self.schedule(PODS, (ns, name), wait)
        else:
            self.started.pop(uid, None)
        status = pod_status(
            pod, behaviour.mode, ready, self._pod_ip(pod), now_rfc3339(), behaviour.init_container
        )
        self.store.internal_status(PODS, ns, name, status)
        if ready and uid not in self.ready_since:
            self.ready_since[uid] = now
        elif not ready:
            self.ready_since.pop(uid, None)

    def forget(self, uid: str) -> None:
        self.started.pop(uid, None)
        self.ready_since.pop(uid, None)

    def ready_for(self, pod: dict[str, Any], now: float) -> float | None:
        """Seconds the pod has been ready (None when it is not)."""
        if not is_ready(pod):
            return None
        since = self.ready_since.get(pod["metadata"]["uid"])
        return float("inf") if since is None else now - since  # made ready by someone else

    def deployment_of(self, pod: dict[str, Any]) -> str | None:
        """The Deployment whose ReplicaSet runs this pod, if any."""
        ns = pod["metadata"].get("namespace", "")
        rs = controller_of(pod, "ReplicaSet")
        if rs is None:
            return None
        owner = self.store.peek(REPLICASETS, ns, rs)
        return controller_of(owner, "Deployment") if owner is not None else None

    def _pod_ip(self, pod: dict[str, Any]) -> str:
        ip = (pod.get("status") or {}).get("podIP")
        if ip:
            return ip
        n = self._ip_next
        self._ip_next += 1
        return f"{self.pod_ip_prefix}.{(n // 250) % 250}.{n % 250 + 1}"


def controller_of(obj: dict[str, Any], kind: str) -> str | None:
    """The name of the `kind` that controls `obj` (its controller owner reference)."""
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == kind and ref.get("controller"):
            return ref.get("name")
    return None
