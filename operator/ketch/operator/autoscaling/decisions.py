"""Coordinated autoscaling (``autoscaling.mode: ketch``): the pure decision logic.

No I/O and no clock: the loop (``loop.CoordinatedAutoscaling``) scrapes the pods, passes the
time in, and applies (or, with ``advisory``, only records) what comes out. So
every rule below is testable with a fake clock (tests/operator/test_autoscaler.py).

Per sync period and role:

1. ``recommend``: the HorizontalPodAutoscaler formula, ``ceil(ready pods * max_i(avg_i /
   target_i))`` over the role's metrics (per-pod averages over the ready pods; pods still
   starting count as idle, as the HPA does for a scale-up), with HPA's 10% tolerance, clamped to
   ``[minReplicas, maxReplicas]``.
2. ``Stabilizer.decide``: scale up to the lowest recommendation of the scale-up window (default 0 s:
   at once), scale down only to the highest recommendation of the scale-down window (default
   300 s). A sawtooth load therefore never scales down between its teeth. A change in the opposite
   direction of the last one waits for ``cooldownSeconds`` after it.
3. ``coordinate``: keeps prefill/decode pods within ``spec.autoscaling.ratio`` by raising the
   smaller side (capacity is never dropped to meet the ratio), within each role's maxReplicas.

Each step says why in a ``rule`` text, kept in ``status.autoscaling`` with the decision.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

TOLERANCE = 0.1  # as the HPA: no change while every metric is within 10% of its target
DEFAULT_UP_WINDOW = 0.0
DEFAULT_DOWN_WINDOW = 300.0
DEFAULT_COOLDOWN = 30.0
DEFAULT_SYNC = 5.0
HISTORY = 10  # decisions kept per role in status.autoscaling


@dataclasses.dataclass
class Recommendation:
    replicas: int
    rule: str
    metrics: dict[str, float]


def recommend(
    current: int,
    values: dict[str, list[float]],
    targets: dict[str, float],
    min_replicas: int,
    max_replicas: int,
) -> Recommendation | None:
    """The replica count the metrics ask for. ``values``: per metric type, one value per ready
    pod; ``targets``: per metric type, the per-pod target. None when any metric has no value."""
    if not targets or any(not values.get(name) for name in targets):
        return None
    averages = {name: sum(values[name]) / len(values[name]) for name in targets}
    wanted = {}
    for name, goal in targets.items():
        ratio = averages[name] / goal if goal > 0 else math.inf
        # Scaled from the pods that reported (the ready ones), not from the replica count: pods
        # still starting count as idle, so a scale-up is not repeated while they start (HPA).
        reporting = len(values[name])
        wanted[name] = (
            current if abs(ratio - 1.0) <= TOLERANCE else math.ceil(reporting * ratio - 1e-9)
        )
    name = max(wanted, key=lambda n: wanted[n])
    raw = wanted[name]
    replicas = min(max(raw, min_replicas), max_replicas)
    rule = f"{name} {averages[name]:g} per pod vs target {targets[name]:g}: {raw} pods"
    if replicas != raw:
        rule += f", clamped to {'minReplicas' if raw < min_replicas else 'maxReplicas'} {replicas}"
    return Recommendation(replicas, rule, averages)


class Stabilizer:
    """One role's recommendation history, stabilisation windows and cool-down."""

    def __init__(
        self,
        up_window: float = DEFAULT_UP_WINDOW,
        down_window: float = DEFAULT_DOWN_WINDOW,
        cooldown: float = DEFAULT_COOLDOWN,
    ):
        self.up_window = up_window
        self.down_window = down_window
        self.cooldown = cooldown
        self.history: list[tuple[float, int]] = []
        self.last_change: tuple[float, int] | None = None  # (time, +1 up / -1 down)

    def decide(self, now: float, current: int, recommended: int) -> tuple[int, str]:
        """(replicas, rule): where to go now, given this period's recommendation."""
        self.history.append((now, recommended))
        keep = max(self.up_window, self.down_window)
        self.history = [(t, r) for t, r in self.history if now - t <= keep]
        if recommended > current:
            lowest = min(r for t, r in self.history if now - t <= self.up_window)
            target = max(current, lowest)
            rule = "scale up"
            if target < recommended:
                rule = f"scale-up stabilisation ({self.up_window:g} s window) holds at {target}"
        elif recommended < current:
            highest = max(r for t, r in self.history if now - t <= self.down_window)
            target = min(current, highest)
            rule = "scale down"
            if target > recommended:
                rule = f"scale-down stabilisation ({self.down_window:g} s window) holds at {target}"
        else:
            return current, "at target"
        direction = (target > current) - (target < current)
        if direction and self.last_change is not None:
            when, last = self.last_change
            if last == -direction and now - when < self.cooldown:
                return current, (
                    f"cool-down: last change {now - when:g} s ago was the other way "
                    f"(cooldownSeconds {self.cooldown:g})"
                )
        return target, rule

    def changed(self, now: float, before: int, after: int) -> None:
        if after != before:
            self.last_change = (now, 1 if after > before else -1)


def coordinate(
    prefill: int,
    decode: int,
    ratio_min: float | None,
    ratio_max: float | None,
    *,
    prefill_max: int,
    decode_max: int,
    prefill_free: bool = True,
    decode_free: bool = True,
) -> tuple[int, int, str | None]:
    """(prefill, decode, rule or None): prefill/decode pods within [ratio_min, ratio_max], by
    raising the smaller side up to its maxReplicas. ``*_free``: the role is scaled by this
    autoscaler (a role with fixed replicas is never changed). A bound that can't be met is kept
    as near as possible, and the rule says so."""
    if decode <= 0 or prefill <= 0:
        return prefill, decode, None
    if ratio_min is not None and prefill / decode < ratio_min - 1e-9:
        need = math.ceil(ratio_min * decode - 1e-9)
        got = min(need, prefill_max) if prefill_free else prefill
        got = max(got, prefill)
        rule = f"ratio min {ratio_min:g}: prefill raised from {prefill} to {got}"
        if got < need:
            why = "maxReplicas" if prefill_free else "prefill is not autoscaled"
            rule += f" (needs {need}; {why}: bound not reachable)"
        return got, decode, rule if got != prefill or got < need else None
    if ratio_max is not None and prefill / decode > ratio_max + 1e-9:
        need = math.ceil(prefill / ratio_max - 1e-9)
        got = min(need, decode_max) if decode_free else decode
        got = max(got, decode)
        rule = f"ratio max {ratio_max:g}: decode raised from {decode} to {got}"
        if got < need:
            why = "maxReplicas" if decode_free else "decode is not autoscaled"
            rule += f" (needs {need}; {why}: bound not reachable)"
        return prefill, got, rule if got != decode or got < need else None
    return prefill, decode, None


def decision(
    now: str, before: int, after: int, metrics: dict[str, float], rule: str
) -> dict[str, Any]:
    return {"time": now, "from": before, "to": after, "metrics": metrics, "rule": rule}


def record(history: list[dict[str, Any]], entry: dict[str, Any]) -> bool:
    """Appends ``entry`` unless it repeats the last decision (same from, to and rule kind);
    keeps the last ``HISTORY``. True when appended."""
    if history:
        last = history[-1]
        if (last["from"], last["to"], _kind(last["rule"])) == (
            entry["from"],
            entry["to"],
            _kind(entry["rule"]),
        ):
            return False
    history.append(entry)
    del history[:-HISTORY]
    return True


def _kind(rule: str) -> str:
    """The rule without its numbers, so a hold with new metric values isn't a new decision."""
    return "".join(c for c in rule.split(";")[-1] if not (c.isdigit() or c == "."))


@dataclasses.dataclass
class RoleSpec:
    """What the autoscaler needs of one role's ``autoscaling``."""

    min_replicas: int
    max_replicas: int
    targets: dict[str, float]
    up_window: float = DEFAULT_UP_WINDOW
    down_window: float = DEFAULT_DOWN_WINDOW


def scale_order(
    decisions: dict[str, dict[str, Any]],
    ratio_min: float | None,
    ratio_max: float | None,
) -> list[str]:
    """The roles to scale, in an order whose intermediate state also keeps prefill/decode within
    the ratio (the roles are scaled one API call at a time, and anyone may look in between)."""
    roles = [r for r, d in decisions.items() if d["to"] != d["from"]]
    if set(roles) != {"prefill", "decode"}:
        return roles
    p, d = decisions["prefill"], decisions["decode"]

    def within(prefill: int, decode: int) -> bool:
        if decode <= 0:
            return False
        ratio = prefill / decode
        low = ratio_min is None or ratio >= ratio_min - 1e-9
        return low and (ratio_max is None or ratio <= ratio_max + 1e-9)

    if within(p["to"], d["from"]):
        return ["prefill", "decode"]
    if within(p["from"], d["to"]):
        return ["decode", "prefill"]
    return roles


class Coordinator:
    """The decisions of one InferenceService's coordinated roles, period after period."""

    def __init__(
        self,
        roles: dict[str, RoleSpec],
        *,
        ratio_min: float | None = None,
        ratio_max: float | None = None,
        cooldown: float = DEFAULT_COOLDOWN,
    ):
        self.roles = roles
        self.ratio_min = ratio_min
        self.ratio_max = ratio_max
        self.stabilizers = {
            role: Stabilizer(spec.up_window, spec.down_window, cooldown)
            for role, spec in roles.items()
        }

    def step(
        self,
        now: float,
        current: dict[str, int],
        values: dict[str, dict[str, list[float]]],
    ) -> dict[str, dict[str, Any]] | None:
        """Per coordinated role: {from, to, metrics, rule}. ``current``: replicas of every role
        (fixed ones too, for the ratio); ``values``: per role, per metric type, per-pod values.
        None (no scaling at all) when any coordinated role lacks metrics."""
        recs = {}
        for role, spec in self.roles.items():
            rec = recommend(
                current[role],
                values.get(role) or {},
                spec.targets,
                spec.min_replicas,
                spec.max_replicas,
            )
            if rec is None:
                return None
            recs[role] = rec
        out: dict[str, dict[str, Any]] = {}
        for role, rec in recs.items():
            to, rule = self.stabilizers[role].decide(now, current[role], rec.replicas)
            out[role] = {
                "from": current[role],
                "to": to,
                "metrics": rec.metrics,
                "rule": f"{rec.rule}; {rule}",
            }
        if "prefill" in current and "decode" in current:
            p = out["prefill"]["to"] if "prefill" in out else current["prefill"]
            d = out["decode"]["to"] if "decode" in out else current["decode"]
            fixed = RoleSpec(0, 0, {})
            p2, d2, rule = coordinate(
                p,
                d,
                self.ratio_min,
                self.ratio_max,
                prefill_max=self.roles.get("prefill", fixed).max_replicas,
                decode_max=self.roles.get("decode", fixed).max_replicas,
                prefill_free="prefill" in out,
                decode_free="decode" in out,
            )
            for role, value in (("prefill", p2), ("decode", d2)):
                if rule and role in out and (value != out[role]["to"] or "not reachable" in rule):
                    out[role]["to"] = value
                    out[role]["rule"] += f"; {rule}"
        for role, entry in out.items():
            self.stabilizers[role].changed(now, entry["from"], entry["to"])
        return out
