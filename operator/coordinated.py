"""Coordinated autoscaling (``mode: ketch``): the operator's own scaling loop per InferenceService.

Every ``spec.autoscaling.syncPeriodSeconds`` the loop scrapes the ready pods of each coordinated
role (``scrape.py``), lets ``autoscaler.Coordinator`` decide (pure logic), scales through the
Deployments' ``scale`` subresource unless advisory, and keeps its part of the status: the last
decisions per role and the ``ScalingActive`` condition. ``CoordinatedScaling`` is mixed into the
``Controller``, which owns the caches it reads and writes the status it produces.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from ketch.operator import autoscaler, objects, scrape
from ketch.operator import status as status_mod
from ketch.operator.spec import ServiceSpec

if TYPE_CHECKING:
    from ketch.operator.controller import Tracked
    from ketch.operator.kube import KubeClient

logger = logging.getLogger("ketch.operator")

Key = tuple[str, str]  # (namespace, name)
Obj = dict[str, Any]


@dataclasses.dataclass
class Autoscale:
    """The coordinated autoscaler of one InferenceService: its loop and its part of the status."""

    settings: Any  # what the loop was started with; another value restarts it
    task: asyncio.Task[None] | None = None
    status: Obj = dataclasses.field(default_factory=dict)  # status.autoscaling
    condition: Obj | None = None  # the ScalingActive condition


def _quantity(value: Any) -> float:
    text = str(value)
    for suffix, scale in (
        ("Ki", 2**10),
        ("Mi", 2**20),
        ("Gi", 2**30),
        ("Ti", 2**40),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
    ):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def coordinated_settings(svc: ServiceSpec) -> tuple[Any, ...] | None:
    """The coordinated-autoscaling part of the spec (hashable), or None without a 'ketch' role."""
    roles = []
    for role in svc.roles:
        spec = svc.role(role).get("autoscaling") or {}
        if spec.get("mode") != "ketch":
            continue
        behavior = spec.get("behavior") or {}
        roles.append(
            (
                role,
                int(spec.get("minReplicas", 1)),
                int(spec["maxReplicas"]),
                tuple((m["type"], _quantity(m["target"])) for m in spec["metrics"]),
                float((behavior.get("scaleUp") or {}).get("stabilizationWindowSeconds", 0)),
                float((behavior.get("scaleDown") or {}).get("stabilizationWindowSeconds", 300)),
            )
        )
    if not roles:
        return None
    top = svc.spec.get("autoscaling") or {}
    ratio = top.get("ratio") or {}
    port = svc.ports.get("metrics") or svc.ports["http"]
    return (
        tuple(roles),
        float(top.get("syncPeriodSeconds", autoscaler.DEFAULT_SYNC)),
        float(top.get("cooldownSeconds", autoscaler.DEFAULT_COOLDOWN)),
        bool(top.get("advisory", False)),
        ratio.get("min"),
        ratio.get("max"),
        int(port),
    )


class CoordinatedScaling:
    """The per-InferenceService scaling loops; needs the Controller's caches and client."""

    client: KubeClient
    tracked: dict[Key, Tracked]
    children: dict[Key, dict[tuple[str, str], Obj]]
    pods: dict[Key, dict[str, Obj]]
    autoscale: dict[Key, Autoscale]

    def _status_changed(self, key: Key) -> None:
        raise NotImplementedError

    def _sync_autoscaler(self, key: Key, tracked: Tracked) -> None:
        """Starts, restarts or stops the InferenceService's coordinated autoscaler to match the
        spec just applied."""
        assert tracked.svc is not None
        settings = coordinated_settings(tracked.svc)
        state = self.autoscale.get(key)
        if state is not None and state.settings == settings:
            return
        if settings is None:
            self._stop_autoscaler(key)
            return
        if state is not None and state.task is not None:
            state.task.cancel()
        state = Autoscale(settings=settings)
        state.status = {
            "advisory": settings[3],
            "roles": {r[0]: {"decisions": []} for r in settings[0]},
        }
        old = (tracked.written_status or tracked.body.get("status") or {}).get("autoscaling") or {}
        for role, part in (old.get("roles") or {}).items():  # keep the history over restarts
            if role in state.status["roles"]:
                state.status["roles"][role]["decisions"] = list(part.get("decisions") or [])
        old_condition = status_mod.condition(
            tracked.written_status or tracked.body.get("status"), "ScalingActive"
        )
        state.condition = old_condition
        self.autoscale[key] = state
        state.task = asyncio.get_running_loop().create_task(self._autoscaler(key, state))

    def _stop_autoscaler(self, key: Key) -> None:
        state = self.autoscale.pop(key, None)
        if state is not None and state.task is not None:
            state.task.cancel()

    async def _autoscaler(self, key: Key, state: Autoscale) -> None:
        roles, period, cooldown, advisory, ratio_min, ratio_max, port = state.settings
        coordinator = autoscaler.Coordinator(
            {
                role: autoscaler.RoleSpec(low, high, dict(targets), up, down)
                for role, low, high, targets, up, down in roles
            },
            ratio_min=None if ratio_min is None else float(ratio_min),
            ratio_max=None if ratio_max is None else float(ratio_max),
            cooldown=cooldown,
        )
        started = time.monotonic()
        fresh = {role: started for role in coordinator.roles}
        windows = scrape.Windows()
        timeout = max(0.2, min(2.0, period * 0.8))
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    await self._autoscale_once(
                        key,
                        state,
                        coordinator,
                        session,
                        fresh,
                        windows,
                        period,
                        advisory,
                        port,
                        timeout,
                    )
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the next period tries again; the condition says why
                    logger.warning("%s/%s: autoscaling failed: %s", *key, exc)
                    self._set_scaling(key, state, False, "ScalingFailed", str(exc)[:1000])
                await asyncio.sleep(period)

    async def _autoscale_once(
        self,
        key: Key,
        state: Autoscale,
        coordinator: autoscaler.Coordinator,
        session: aiohttp.ClientSession,
        fresh: dict[str, float],
        windows: scrape.Windows,
        period: float,
        advisory: bool,
        port: int,
        timeout: float,
    ) -> None:
        tracked = self.tracked.get(key)
        if tracked is None or tracked.svc is None:
            return
        svc = tracked.svc
        live = self.children.get(key, {})
        current = {}
        for role in svc.roles:
            dep = live.get(("Deployment", f"{svc.name}-{role}"))
            if dep is None:
                return  # not created yet
            current[role] = int((dep.get("spec") or {}).get("replicas", 1))
        pods = list(self.pods.get(key, {}).values())
        windows.forget({(p.get("metadata") or {}).get("name", "") for p in pods})
        t = time.monotonic()
        values: dict[str, dict[str, list[float]]] = {}
        problems = []
        for role, spec in coordinator.roles.items():
            role_pods = [
                p
                for p in pods
                if ((p.get("metadata") or {}).get("labels") or {}).get(objects.LABEL_ROLE) == role
            ]
            got = await scrape.scrape_role(
                session, role_pods, port, list(spec.targets), timeout, windows=windows, now=t
            )
            if got.errors:
                problems.append(f"{role}: " + "; ".join(got.errors))
            else:
                fresh[role] = t
                values[role] = got.values
        if problems:
            stale = [r for r in coordinator.roles if t - fresh[r] > 2 * period]
            if stale:
                self._set_scaling(
                    key,
                    state,
                    False,
                    "MetricsUnavailable",
                    f"no fresh metrics for {', '.join(stale)} for over {2 * period:g} s, so no "
                    "role is scaled: " + " | ".join(problems),
                )
            return
        decisions = coordinator.step(t, current, values)
        if decisions is None:
            return
        stamp = status_mod.now()
        if not advisory:
            order = autoscaler.scale_order(decisions, coordinator.ratio_min, coordinator.ratio_max)
            for role in order:
                d = decisions[role]
                await self.client.scale("Deployment", svc.namespace, f"{svc.name}-{role}", d["to"])
                logger.info(
                    "%s/%s: %s scaled %d -> %d: %s", *key, role, d["from"], d["to"], d["rule"]
                )
        for role, d in decisions.items():
            if d["to"] == d["from"] and d["rule"].endswith("at target"):
                continue
            entry = autoscaler.decision(stamp, d["from"], d["to"], d["metrics"], d["rule"])
            history = state.status["roles"][role]["decisions"]
            if autoscaler.record(history, entry):
                self._status_changed(key)
        self._set_scaling(
            key,
            state,
            True,
            "Advisory" if advisory else "MetricsAvailable",
            ("advisory: decisions are recorded, not applied; " if advisory else "")
            + f"scraping {', '.join(coordinator.roles)} every {period:g} s",
        )

    def _set_scaling(self, key: Key, state: Autoscale, ok: bool, reason: str, message: str) -> None:
        tracked = self.tracked.get(key)
        generation = (tracked.applied_generation or 0) if tracked else 0
        before = state.condition or {}
        cond = {
            "type": "ScalingActive",
            "status": "True" if ok else "False",
            "reason": reason,
            "message": message,
            "observedGeneration": generation,
        }
        same = before.get("status") == cond["status"]
        cond["lastTransitionTime"] = (same and before.get("lastTransitionTime")) or status_mod.now()
        if cond != before:
            state.condition = cond
            self._status_changed(key)
