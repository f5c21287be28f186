"""Coordinated autoscaling (``mode: ketch``): the operator's own scaling loop per InferenceService.

Every ``spec.autoscaling.syncPeriodSeconds`` the loop scrapes the ready pods of each coordinated
role (``scrape``), lets ``decisions.Coordinator`` decide (pure logic), scales through the
Deployments' ``scale`` subresource unless advisory, and keeps its part of the status: the last
decisions per role and the ``ScalingActive`` condition. ``CoordinatedAutoscaling`` reads the
controller's ``Cache`` and tells the controller when its part of the status changed; the
controller writes it with the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from ketch.operator import ownership
from ketch.operator import status as status_mod
from ketch.operator.autoscaling import decisions, scrape
from ketch.operator.autoscaling.settings import CoordinatedSettings
from ketch.operator.cache import Cache, Key, Obj, ServiceState
from ketch.operator.kube import ApiError, KubeClient
from ketch.operator.labels import LABEL_ROLE

logger = logging.getLogger("ketch.operator")


@dataclasses.dataclass
class Autoscale:
    """The coordinated autoscaler of one InferenceService: its loop and its part of the status."""

    settings: CoordinatedSettings | None  # what the loop was started with; another restarts it
    task: asyncio.Task[None] | None = None
    status: Obj = dataclasses.field(default_factory=dict)  # status.autoscaling
    condition: Obj | None = None  # the ScalingActive condition


@dataclasses.dataclass
class _Run:
    """What one loop carries from period to period."""

    settings: CoordinatedSettings
    coordinator: decisions.Coordinator
    session: aiohttp.ClientSession
    fresh: dict[str, float]  # role -> when its metrics were last complete
    windows: scrape.Windows


class CoordinatedAutoscaling:
    """The coordinated autoscalers of all InferenceServices, one loop each."""

    def __init__(self, client: KubeClient, cache: Cache, changed: Callable[[Key], None]):
        self.client = client
        self.cache = cache
        self.changed = changed  # called when a loop changed its part of the status
        self.states: dict[Key, Autoscale] = {}

    def sync(self, key: Key, tracked: ServiceState) -> None:
        """Starts, restarts or stops the InferenceService's loop to match the spec just applied."""
        assert tracked.svc is not None
        settings = CoordinatedSettings.from_spec(tracked.svc)
        state = self.states.get(key)
        if state is not None and state.settings == settings:
            return
        if settings is None:
            self.stop(key)
            return
        if state is not None and state.task is not None:
            state.task.cancel()
        state = Autoscale(settings=settings)
        state.status = {
            "advisory": settings.advisory,
            "roles": {r.role: {"decisions": []} for r in settings.roles},
        }
        old = (tracked.last_status or {}).get("autoscaling") or {}
        for role, part in (old.get("roles") or {}).items():  # keep the history over restarts
            if role in state.status["roles"]:
                state.status["roles"][role]["decisions"] = list(part.get("decisions") or [])
        state.condition = status_mod.condition(tracked.last_status, "ScalingActive")
        self.states[key] = state
        state.task = asyncio.get_running_loop().create_task(self._loop(key, state, settings))

    def stop(self, key: Key) -> None:
        state = self.states.pop(key, None)
        if state is not None and state.task is not None:
            state.task.cancel()

    def stop_all(self) -> None:
        for key in list(self.states):
            self.stop(key)

    async def _loop(self, key: Key, state: Autoscale, settings: CoordinatedSettings) -> None:
        coordinator = settings.coordinator()
        started = time.monotonic()
        # No cookies kept from one pod's answer for the next (each page is the tenant's).
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            run = _Run(
                settings,
                coordinator,
                session,
                fresh={role: started for role in coordinator.roles},
                windows=scrape.Windows(),
            )
            while True:
                try:
                    await self._once(key, state, run)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the next period tries again; the condition says why
                    logger.warning("%s/%s: autoscaling failed: %s", *key, exc)
                    # The API server's words; of anything else only its class (no text that
                    # may have come from a pod reaches status).
                    why = str(exc) if isinstance(exc, ApiError) else type(exc).__name__
                    self._set_condition(key, state, False, "ScalingFailed", why[:1000])
                await asyncio.sleep(settings.sync_period)

    async def _once(self, key: Key, state: Autoscale, run: _Run) -> None:
        tracked = self.cache.tracked.get(key)
        if tracked is None or tracked.svc is None:
            return
        svc = tracked.svc
        live = self.cache.live(key)
        current = {}
        for role in svc.roles:
            dep = live.get(("Deployment", f"{svc.name}-{role}"))
            if not ownership.controlled_by(dep, svc.uid):
                return  # not created yet (or another's object of that name: never scaled)
            current[role] = int((dep.get("spec") or {}).get("replicas", 1))
        t = time.monotonic()
        values = await self._scrape(key, state, run, t)
        if values is None:
            return
        found = run.coordinator.step(t, current, values)
        if found is None:
            return
        await self._scale(key, svc.namespace, svc.name, run, found)
        self._record(key, state, found)
        period, advisory = run.settings.sync_period, run.settings.advisory
        self._set_condition(
            key,
            state,
            True,
            "Advisory" if advisory else "MetricsAvailable",
            ("advisory: decisions are recorded, not applied; " if advisory else "")
            + f"scraping {', '.join(run.coordinator.roles)} every {period:g} s",
        )

    async def _scrape(
        self, key: Key, state: Autoscale, run: _Run, t: float
    ) -> dict[str, dict[str, list[float]]] | None:
        """Per role, per metric type, one value per ready pod; None when a role has none."""
        pods = list(self.cache.pods.get(key, {}).values())
        run.windows.forget({(p.get("metadata") or {}).get("name", "") for p in pods})
        values: dict[str, dict[str, list[float]]] = {}
        problems = []
        for role, spec in run.coordinator.roles.items():
            role_pods = [
                p
                for p in pods
                if ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_ROLE) == role
            ]
            got = await scrape.scrape_role(
                run.session,
                role_pods,
                run.settings.metrics_port,
                list(spec.targets),
                run.settings.scrape_timeout,
                windows=run.windows,
                now=t,
            )
            if got.errors:
                problems.append(f"{role}: " + "; ".join(got.errors))
            else:
                run.fresh[role] = t
                values[role] = got.values
        if not problems:
            return values
        period = run.settings.sync_period
        stale = [r for r in run.coordinator.roles if t - run.fresh[r] > 2 * period]
        if stale:
            self._set_condition(
                key,
                state,
                False,
                "MetricsUnavailable",
                f"no fresh metrics for {', '.join(stale)} for over {2 * period:g} s, so no "
                "role is scaled: " + " | ".join(problems),
            )
        return None

    async def _scale(
        self, key: Key, namespace: str, name: str, run: _Run, found: dict[str, dict[str, Any]]
    ) -> None:
        if run.settings.advisory:
            return
        coordinator = run.coordinator
        for role in decisions.scale_order(found, coordinator.ratio_min, coordinator.ratio_max):
            d = found[role]
            await self.client.scale("Deployment", namespace, f"{name}-{role}", d["to"])
            logger.info("%s/%s: %s scaled %d -> %d: %s", *key, role, d["from"], d["to"], d["rule"])

    def _record(self, key: Key, state: Autoscale, found: dict[str, dict[str, Any]]) -> None:
        stamp = status_mod.now()
        for role, d in found.items():
            if d["to"] == d["from"] and d["rule"].endswith("at target"):
                continue
            entry = decisions.decision(stamp, d["from"], d["to"], d["metrics"], d["rule"])
            history = state.status["roles"][role]["decisions"]
            if decisions.record(history, entry):
                self.changed(key)

    def _set_condition(
        self, key: Key, state: Autoscale, ok: bool, reason: str, message: str
    ) -> None:
        tracked = self.cache.tracked.get(key)
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
            self.changed(key)
