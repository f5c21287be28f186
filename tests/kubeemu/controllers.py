"""A small kube-controller-manager: Deployments get Pods, Pods get a status, and Deployments get
the status an operator reads (replicas, conditions), shaped by per-Deployment fault modes.

Event-driven: the store calls `on_event` synchronously for every change; a background task
reconciles the Deployments marked dirty, in batches. Only changed statuses are written.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from kubeemu.fieldsets import canon, dcopy
from kubeemu.store import CONTROLLER_MANAGER, ApiError, Store, now_rfc3339

log = logging.getLogger("kubeemu.controllers")

DEPLOYMENTS = ("apps", "deployments")
PODS = ("", "pods")
FAULT_MODES = ("ready", "crashloop", "imagepull", "unschedulable", "pending")
_HASH_CHARS = "bcdfghjklmnpqrstvwxz2456789"


@dataclass
class Fault:
    mode: str = "ready"
    ready_delay: float = 0.0
    since: float = 0.0  # monotonic time the mode was set


def template_hash(template: dict[str, Any]) -> str:
    """A stable `pod-template-hash` for a pod template (10 chars, like the real controller)."""
    digest = hashlib.sha256(canon(template).encode()).digest()
    return "".join(_HASH_CHARS[b % len(_HASH_CHARS)] for b in digest[:10])


def _resolve_int_or_percent(value: Any, total: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        try:
            pct = int(value[:-1])
        except ValueError:
            return 0
        exact = pct * total / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


POD_IP_PREFIX = "10.244"  # server.py --pod-ip-prefix: e.g. 127.3 makes pods reachable on lo


class DeploymentController:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.faults: dict[tuple[str, str], Fault] = {}
        self.dirty: set[tuple[str, str]] = set()
        self.loose_pods: set[tuple[str, str]] = set()  # pods not owned by a Deployment
        self.pod_born: dict[str, float] = {}  # pod uid -> monotonic creation time
        self.rollout_start: dict[tuple[str, str], tuple[str, float]] = {}
        self.timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self.wake = asyncio.Event()
        self._ip_next = 1
        self._task: asyncio.Task[None] | None = None
        store.listeners.append(self.on_event)

    # ------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def on_event(self, key: tuple[str, str], etype: str, obj: dict[str, Any], prev: Any) -> None:
        meta = obj["metadata"]
        if key == DEPLOYMENTS:
            self._mark((meta.get("namespace", ""), meta["name"]))
        elif key == PODS:
            owner = _deployment_owner(obj)
            if owner is not None:
                self._mark((meta.get("namespace", ""), owner))
            elif etype != "DELETED":
                self.loose_pods.add((meta.get("namespace", ""), meta["name"]))
                self.wake.set()
            if etype == "DELETED":
                self.pod_born.pop(meta.get("uid", ""), None)

    def _mark(self, key: tuple[str, str]) -> None:
        self.dirty.add(key)
        self.wake.set()

    def set_fault(self, namespace: str, deployment: str, mode: str, ready_delay: float = 0) -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {mode!r}; one of {', '.join(FAULT_MODES)}")
        self.faults[(namespace, deployment)] = Fault(
            mode, float(ready_delay or 0), time.monotonic()
        )
        self._mark((namespace, deployment))

    def _schedule(self, key: tuple[str, str], delay: float) -> None:
        """Look at a Deployment again after `delay` seconds (a readiness delay, a deadline)."""
        old = self.timers.get(key)
        loop = asyncio.get_running_loop()
        when = loop.time() + max(delay, 0.01)
        if old is not None and not old.cancelled() and old.when() <= when:
            return
        if old is not None:
            old.cancel()
        self.timers[key] = loop.call_at(when, self._mark, key)

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await asyncio.sleep(0.02)  # let a burst of writes settle into one pass
            batch, self.dirty = self.dirty, set()
            loose, self.loose_pods = self.loose_pods, set()
            for key in sorted(batch):
                try:
                    self.reconcile(*key)
                except ApiError as exc:
                    log.warning("reconcile %s/%s: %s", key[0], key[1], exc.message)
                except Exception:
                    log.exception("reconcile %s/%s failed", *key)
            for ns, name in sorted(loose):
                try:
                    self._run_loose_pod(ns, name)
                except Exception:
                    log.exception("pod %s/%s failed", ns, name)

    # ------------------------------------------------------------------------------------------

    def reconcile(self, ns: str, name: str) -> None:
        store = self.store
        dep = store.peek(DEPLOYMENTS, ns, name)
        if dep is None:  # faults stay: they may be set before the Deployment exists
            self.rollout_start.pop((ns, name), None)
            return
        meta = dep["metadata"]
        if meta.get("deletionTimestamp"):
            return
        spec = dep.get("spec") or {}
        template = spec.get("template") or {}
        tmpl_hash = template_hash(template)
        want = int(spec.get("replicas", 1) or 0)
        pods = self._pods_of(dep)
        current = [p for p in pods if _labels(p).get("pod-template-hash") == tmpl_hash]
        old = [p for p in pods if _labels(p).get("pod-template-hash") != tmpl_hash]
        fault = self.faults.get((ns, name), Fault())
        pod_rt = store.rt("", "pods")

        # rollout bookkeeping (for Progressing / ProgressDeadlineExceeded)
        started = self.rollout_start.get((ns, name))
        if started is None or started[0] != tmpl_hash:
            self.rollout_start[(ns, name)] = (tmpl_hash, time.monotonic())

        # scale the current revision
        for _ in range(want - len(current)):
            current.append(self._create_pod(dep, template, tmpl_hash, fault))
        if len(current) > want:
            extra = sorted(current, key=lambda p: p["metadata"]["creationTimestamp"])[want:]
            for p in extra:
                self._delete_pod(pod_rt, p)
            current = [p for p in current if p not in extra]

        # pod statuses of the current revision follow the fault mode
        now = time.monotonic()
        next_check: float | None = None
        ready_current = 0
        for p in current:
            live = store.peek(PODS, ns, p["metadata"]["name"])
            if live is None:
                continue
            born = max(self.pod_born.get(live["metadata"]["uid"], 0.0), fault.since)
            wait = born + fault.ready_delay - now
            ready_now = fault.mode == "ready" and wait <= 0
            if fault.mode == "ready" and wait > 0:
                next_check = wait if next_check is None else min(next_check, wait)
            status = self._pod_status(live, fault.mode, ready_now)
            store.internal_status(PODS, ns, live["metadata"]["name"], status)
            if ready_now:
                ready_current += 1

        # old revisions go once the new one is fully ready (or right away for Recreate / 0)
        strategy = (spec.get("strategy") or {}).get("type", "RollingUpdate")
        if old and (ready_current >= want or strategy == "Recreate"):
            for p in old:
                self._delete_pod(pod_rt, p)
            old = []

        ready_old = sum(1 for p in old if _pod_ready(store.peek(PODS, ns, p["metadata"]["name"])))
        deadline = spec.get("progressDeadlineSeconds", 600)
        since = self.rollout_start[(ns, name)][1]
        status = self._deployment_status(
            dep,
            tmpl_hash,
            want,
            len(current) + len(old),
            len(current),
            ready_current + ready_old,
            now - since,
            deadline,
        )
        store.internal_status(DEPLOYMENTS, ns, name, status)
        complete = ready_current == want and not old
        if not complete and isinstance(deadline, int):
            remaining = since + deadline - now
            if remaining > 0:
                next_check = remaining if next_check is None else min(next_check, remaining)
        if next_check is not None:
            self._schedule((ns, name), next_check + 0.01)

    def _pods_of(self, dep: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for key, ns, name in list(self.store.dependents.get(dep["metadata"]["uid"], ())):
            if key != PODS:
                continue
            pod = self.store.peek(PODS, ns, name)
            if pod is not None and not pod["metadata"].get("deletionTimestamp"):
                out.append(pod)
        return out

    def _create_pod(
        self, dep: dict[str, Any], template: dict[str, Any], tmpl_hash: str, fault: Fault
    ) -> dict[str, Any]:
        meta = dep["metadata"]
        tmeta = template.get("metadata") or {}
        labels = {**(tmeta.get("labels") or {}), "pod-template-hash": tmpl_hash}
        pod_meta: dict[str, Any] = {
            "generateName": f"{meta['name']}-{tmpl_hash}-",
            "namespace": meta["namespace"],
            "labels": labels,
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        }
        if tmeta.get("annotations"):
            pod_meta["annotations"] = dict(tmeta["annotations"])
        spec = dcopy(template.get("spec") or {})
        if fault.mode != "unschedulable":
            spec["nodeName"] = "kubeemu-node-1"
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": spec}
        pod, _ = self.store.create(
            self.store.rt("", "pods"),
            meta["namespace"],
            body,
            manager=CONTROLLER_MANAGER,
            field_validation="Ignore",
        )
        self.pod_born[pod["metadata"]["uid"]] = time.monotonic()
        return pod

    def _delete_pod(self, pod_rt: Any, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if self.store.peek(PODS, meta["namespace"], meta["name"]) is not None:
            self.store.delete(pod_rt, meta["namespace"], meta["name"])

    def _run_loose_pod(self, ns: str, name: str) -> None:
        """A Pod nobody manages (created directly, or by a ReplicaSet/Job): it just runs."""
        pod = self.store.peek(PODS, ns, name)
        if pod is None or pod["metadata"].get("deletionTimestamp") or _deployment_owner(pod):
            return
        self.store.internal_status(PODS, ns, name, self._pod_status(pod, "ready", True))

    # ------------------------------------------------------------------------------------------
    # status shapes

    def _pod_ip(self, pod: dict[str, Any]) -> str:
        ip = (pod.get("status") or {}).get("podIP")
        if ip:
            return ip
        n = self._ip_next
        self._ip_next += 1
        return f"{POD_IP_PREFIX}.{(n // 250) % 250}.{n % 250 + 1}"

    def _pod_status(self, pod: dict[str, Any], mode: str, ready: bool) -> dict[str, Any]:
        old = pod.get("status") or {}
        stamp = now_rfc3339()
        old_conds = {c.get("type"): c for c in old.get("conditions") or []}
        containers = (pod.get("spec") or {}).get("containers") or []
        start = old.get("startTime") or pod["metadata"].get("creationTimestamp") or stamp

        def cond(ctype: str, ok: bool, reason: str | None = None, message: str | None = None):
            prev = old_conds.get(ctype)
            value = "True" if ok else "False"
            c: dict[str, Any] = {
                "type": ctype,
                "status": value,
                "lastProbeTime": None,
                "lastTransitionTime": prev["lastTransitionTime"]
                if prev and prev.get("status") == value
                else stamp,
            }
            if reason:
                c["reason"] = reason
            if message:
                c["message"] = message
            return c

        if mode == "unschedulable":
            resource = _requested_extended_resource(containers) or "nvidia.com/gpu"
            msg = (
                f"0/3 nodes are available: 3 Insufficient {resource}. preemption: 0/3 nodes "
                "are available: 3 No preemption victims found for incoming pod."
            )
            return {
                "phase": "Pending",
                "qosClass": _qos(containers),
                "conditions": [cond("PodScheduled", False, "Unschedulable", msg)],
            }

        names = [c.get("name", "") for c in containers]
        unready_msg = f"containers with unready status: [{' '.join(names)}]"
        pod_ip = self._pod_ip(pod)
        base = {
            "hostIP": "172.18.0.2",
            "hostIPs": [{"ip": "172.18.0.2"}],
            "podIP": pod_ip,
            "podIPs": [{"ip": pod_ip}],
            "qosClass": _qos(containers),
            "startTime": start,
        }
        old_cs = {c.get("name"): c for c in old.get("containerStatuses") or []}
        statuses = []
        for i, c in enumerate(containers):
            cname, image = c.get("name", ""), c.get("image", "")
            cid = (
                "containerd://"
                + hashlib.sha256(f"{pod['metadata'].get('uid')}/{cname}".encode()).hexdigest()
            )
            cs: dict[str, Any] = {
                "name": cname,
                "image": image,
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "started": False,
            }
            prev = old_cs.get(cname) or {}
            running_since = ((prev.get("state") or {}).get("running") or {}).get(
                "startedAt"
            ) or stamp
            if mode == "ready":
                cs.update(
                    containerID=cid,
                    imageID=f"{image}@sha256:{'0' * 64}",
                    ready=ready,
                    started=True,
                    state={"running": {"startedAt": running_since}},
                    lastState={},
                )
            elif mode == "crashloop" and i == 0:
                cs.update(
                    containerID=cid,
                    imageID=f"{image}@sha256:{'0' * 64}",
                    restartCount=5,
                    state={
                        "waiting": {
                            "reason": "CrashLoopBackOff",
                            "message": f"back-off 5m0s restarting failed container={cname} "
                            f"pod={pod['metadata']['name']}_{pod['metadata']['namespace']}"
                            f"({pod['metadata'].get('uid')})",
                        }
                    },
                    lastState={
                        "terminated": {
                            "exitCode": 1,
                            "reason": "Error",
                            "startedAt": start,
                            "finishedAt": start,
                            "containerID": cid,
                        }
                    },
                )
            elif mode == "crashloop":
                cs.update(
                    containerID=cid,
                    imageID=f"{image}@sha256:{'0' * 64}",
                    ready=True,
                    started=True,
                    state={"running": {"startedAt": running_since}},
                    lastState={},
                )
            elif mode == "imagepull":
                cs["state"] = {
                    "waiting": {
                        "reason": "ImagePullBackOff",
                        "message": f'Back-off pulling image "{image}"',
                    }
                }
                cs["lastState"] = {}
            else:  # pending
                cs["state"] = {"waiting": {"reason": "ContainerCreating"}}
                cs["lastState"] = {}
            statuses.append(cs)
        all_ready = all(cs["ready"] for cs in statuses) and mode == "ready" and ready
        phase = "Running" if mode in ("ready", "crashloop") else "Pending"
        conds = [
            cond("PodReadyToStartContainers", mode != "pending"),
            cond("Initialized", True),
            cond(
                "Ready",
                all_ready,
                None if all_ready else "ContainersNotReady",
                None if all_ready else unready_msg,
            ),
            cond(
                "ContainersReady",
                all_ready,
                None if all_ready else "ContainersNotReady",
                None if all_ready else unready_msg,
            ),
            cond("PodScheduled", True),
        ]
        return {"phase": phase, "conditions": conds, **base, "containerStatuses": statuses}

    def _deployment_status(
        self,
        dep: dict[str, Any],
        tmpl_hash: str,
        want: int,
        total: int,
        updated: int,
        ready: int,
        rollout_age: float,
        deadline: Any,
    ) -> dict[str, Any]:
        spec = dep.get("spec") or {}
        old = dep.get("status") or {}
        stamp = now_rfc3339()
        strategy = spec.get("strategy") or {}
        max_unavailable = 0
        if strategy.get("type", "RollingUpdate") == "RollingUpdate" and want > 0:
            ru = strategy.get("rollingUpdate") or {}
            max_unavailable = _resolve_int_or_percent(ru.get("maxUnavailable", "25%"), want, False)
        available = ready
        unavailable = max(0, max(want, total) - available)
        old_conds = {c.get("type"): c for c in old.get("conditions") or []}

        def cond(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
            prev = old_conds.get(ctype)
            value = "True" if ok else "False"
            same = prev is not None and prev.get("status") == value
            unchanged = same and prev.get("reason") == reason and prev.get("message") == message
            return {
                "type": ctype,
                "status": value,
                "lastUpdateTime": prev.get("lastUpdateTime", stamp)
                if unchanged and prev
                else stamp,
                "lastTransitionTime": prev.get("lastTransitionTime", stamp)
                if same and prev
                else stamp,
                "reason": reason,
                "message": message,
            }

        rs_name = f"{dep['metadata']['name']}-{tmpl_hash}"
        is_available = available >= want - max_unavailable
        available_cond = cond(
            "Available",
            is_available,
            "MinimumReplicasAvailable" if is_available else "MinimumReplicasUnavailable",
            "Deployment has minimum availability."
            if is_available
            else "Deployment does not have minimum availability.",
        )
        complete = updated == want and available >= want and total == want
        if complete:
            progressing = cond(
                "Progressing",
                True,
                "NewReplicaSetAvailable",
                f'ReplicaSet "{rs_name}" has successfully progressed.',
            )
        elif isinstance(deadline, int) and rollout_age > deadline:
            progressing = cond(
                "Progressing",
                False,
                "ProgressDeadlineExceeded",
                f'ReplicaSet "{rs_name}" has timed out progressing.',
            )
        else:
            progressing = cond(
                "Progressing", True, "ReplicaSetUpdated", f'ReplicaSet "{rs_name}" is progressing.'
            )
        status: dict[str, Any] = {"observedGeneration": dep["metadata"].get("generation", 1)}
        for k, v in (
            ("replicas", total),
            ("updatedReplicas", updated),
            ("readyReplicas", ready),
            ("availableReplicas", available),
            ("unavailableReplicas", unavailable),
        ):
            if v:
                status[k] = v
        status["conditions"] = [available_cond, progressing]
        return status


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj["metadata"].get("labels") or {}


def _deployment_owner(pod: dict[str, Any]) -> str | None:
    for ref in pod["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == "Deployment" and ref.get("apiVersion", "").startswith("apps/"):
            return ref.get("name")
    return None


def _pod_ready(pod: dict[str, Any] | None) -> bool:
    if pod is None:
        return False
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def _requested_extended_resource(containers: list[dict[str, Any]]) -> str | None:
    for c in containers:
        res = c.get("resources") or {}
        for section in ("limits", "requests"):
            for name in res.get(section) or {}:
                if "/" in name:
                    return name
    return None


def _qos(containers: list[dict[str, Any]]) -> str:
    any_res = False
    guaranteed = True
    for c in containers:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        if req or lim:
            any_res = True
        if (
            not lim
            or any(req.get(k, lim[k]) != lim[k] for k in lim)
            or not {"cpu", "memory"} <= set(lim)
        ):
            guaranteed = False
    if not any_res:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def describe_faults(ctrl: DeploymentController) -> list[dict[str, Any]]:
    return [
        {"namespace": ns, "deployment": name, "mode": f.mode, "readyDelaySeconds": f.ready_delay}
        for (ns, name), f in sorted(ctrl.faults.items())
    ]


__all__ = ["FAULT_MODES", "DeploymentController", "describe_faults", "template_hash"]
