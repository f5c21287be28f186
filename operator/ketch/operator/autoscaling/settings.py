"""The coordinated-autoscaling part of an InferenceService's spec (``mode: ketch``), frozen.

``CoordinatedSettings.from_spec`` reads it once per applied generation. Two settings are equal
exactly when the loop would run the same way, so a generation that changes nothing here keeps
the running loop and its stabilisation history; any other value restarts it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ketch.operator.autoscaling import decisions
from ketch.operator.spec.model import ServiceSpec

_SUFFIXES = (
    ("Ki", 2**10),
    ("Mi", 2**20),
    ("Gi", 2**30),
    ("Ti", 2**40),
    ("m", 1e-3),
    ("k", 1e3),
    ("M", 1e6),
    ("G", 1e9),
    ("T", 1e12),
)


def quantity(value: Any) -> float:
    """A Kubernetes quantity (``800m``, ``48Gi``, ``4``) as a number."""
    text = str(value)
    for suffix, scale in _SUFFIXES:
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


@dataclasses.dataclass(frozen=True)
class RoleSettings:
    """One coordinated role's ``autoscaling``: bounds, per-pod targets, stabilisation windows."""

    role: str
    min_replicas: int
    max_replicas: int
    targets: tuple[tuple[str, float], ...]  # (metric type, per-pod target), in spec order
    up_window: float
    down_window: float

    @classmethod
    def from_spec(cls, role: str, spec: dict[str, Any]) -> RoleSettings:
        behavior = spec.get("behavior") or {}
        return cls(
            role=role,
            min_replicas=int(spec.get("minReplicas", 1)),
            max_replicas=int(spec["maxReplicas"]),
            targets=tuple((m["type"], quantity(m["target"])) for m in spec["metrics"]),
            up_window=float((behavior.get("scaleUp") or {}).get("stabilizationWindowSeconds", 0)),
            down_window=float(
                (behavior.get("scaleDown") or {}).get("stabilizationWindowSeconds", 300)
            ),
        )

    def spec(self) -> decisions.RoleSpec:
        return decisions.RoleSpec(
            self.min_replicas,
            self.max_replicas,
            dict(self.targets),
            self.up_window,
            self.down_window,
        )


@dataclasses.dataclass(frozen=True)
class CoordinatedSettings:
    """What one InferenceService's coordinated autoscaler runs with."""

    roles: tuple[RoleSettings, ...]
    sync_period: float
    cooldown: float
    advisory: bool
    ratio_min: float | None
    ratio_max: float | None
    metrics_port: int

    @classmethod
    def from_spec(cls, svc: ServiceSpec) -> CoordinatedSettings | None:
        """The settings, or None when no role has ``autoscaling.mode: ketch``."""
        autoscaled = {role: svc.role(role).get("autoscaling") or {} for role in svc.roles}
        roles = tuple(
            RoleSettings.from_spec(role, spec)
            for role, spec in autoscaled.items()
            if spec.get("mode") == "ketch"
        )
        if not roles:
            return None
        top = svc.spec.get("autoscaling") or {}
        ratio = top.get("ratio") or {}
        return cls(
            roles=roles,
            sync_period=float(top.get("syncPeriodSeconds", decisions.DEFAULT_SYNC)),
            cooldown=float(top.get("cooldownSeconds", decisions.DEFAULT_COOLDOWN)),
            advisory=bool(top.get("advisory", False)),
            ratio_min=None if ratio.get("min") is None else float(ratio["min"]),
            ratio_max=None if ratio.get("max") is None else float(ratio["max"]),
            metrics_port=int(svc.ports.get("metrics") or svc.ports["http"]),
        )

    @property
    def scrape_timeout(self) -> float:
        """Per pod and period: long enough for a busy engine, short of the next period."""
        return max(0.2, min(2.0, self.sync_period * 0.8))

    def coordinator(self) -> decisions.Coordinator:
        return decisions.Coordinator(
            {r.role: r.spec() for r in self.roles},
            ratio_min=self.ratio_min,
            ratio_max=self.ratio_max,
            cooldown=self.cooldown,
        )
