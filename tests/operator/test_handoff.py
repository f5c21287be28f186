"""The replica hand-over (ketch.operator.children.handoff) and where the applier does it, with a
fake API."""

from __future__ import annotations

import asyncio
from typing import Any

import yaml
from test_autoscaling import ROOT, UID

from ketch.operator.cache import Cache, ServiceState
from ketch.operator.children import handoff
from ketch.operator.events import EventRecorder
from ketch.operator.kube import ApiError
from ketch.operator.managers import FIELD_MANAGER, HANDOFF_FIELD_MANAGER
from ketch.operator.metrics import OperatorMetrics
from ketch.operator.reconcile.child import ChildReconciler
from ketch.operator.reconcile.full import ChildApplier
from ketch.operator.spec.parse import parse


def managed(manager: str, operation: str = "Apply", subresource: str = "") -> dict[str, Any]:
    entry = {
        "manager": manager,
        "operation": operation,
        "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {}}},
    }
    if subresource:
        entry["subresource"] = subresource
    return entry


def live(*entries: dict[str, Any], replicas: int = 3) -> dict[str, Any]:
    """The operator's Deployment (its controller reference is the InferenceService's uid)."""
    owner = {"kind": "InferenceService", "name": "s", "uid": UID, "controller": True}
    return {
        "kind": "Deployment",
        "metadata": {
            "name": "s-mixed",
            "namespace": "n",
            "managedFields": list(entries),
            "ownerReferences": [owner],
        },
        "spec": {"replicas": replicas},
    }


def desired(replicas: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"template": {}}
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "s-mixed", "namespace": "n"},
        "spec": spec,
    }


class FakeApi:
    """Records applies; answers each with the object; a 409 for managers in ``conflicts``."""

    def __init__(self, deployment: dict[str, Any] | None = None, conflicts: tuple[str, ...] = ()):
        self.deployment = deployment
        self.conflicts = conflicts
        self.calls: list[tuple[str, str, str, Any]] = []

    async def apply(self, obj: dict[str, Any], *, force: bool = True, manager: str = FIELD_MANAGER):
        self.calls.append(("apply", manager, obj["kind"], obj.get("spec")))
        if manager in self.conflicts:
            raise ApiError(409, "Conflict", "Apply failed with 1 conflict")
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", "", kind, name))
        return self.deployment if kind == "Deployment" else None

    async def post(self, *args: Any) -> dict[str, Any]:
        return {}

    async def delete(self, *args: Any) -> None:
        raise AssertionError("nothing is pruned here")


def test_only_the_operators_own_apply_of_replicas_calls_for_a_handoff():
    assert handoff.owns_replicas(live(managed(FIELD_MANAGER)))
    assert not handoff.owns_replicas(live(managed(FIELD_MANAGER, "Update")))
    assert not handoff.owns_replicas(live(managed(FIELD_MANAGER, subresource="scale")))
    assert not handoff.owns_replicas(live(managed("kube-controller-manager", "Update", "scale")))
    assert handoff.needs_handoff(desired(), live(managed(FIELD_MANAGER)))
    assert not handoff.needs_handoff(desired(replicas=3), live(managed(FIELD_MANAGER)))
    assert not handoff.needs_handoff(desired(), live(managed(HANDOFF_FIELD_MANAGER)))
    assert not handoff.needs_handoff(desired(), None)  # new: nothing to keep


def test_hand_over_applies_the_live_count_alone_and_gives_way_to_a_conflict():
    def hand_over(api: FakeApi, replicas: int = 3) -> bool:
        prepared = handoff.prepare(None, desired(), live(managed(FIELD_MANAGER), replicas=replicas))  # type: ignore[arg-type]
        return asyncio.run(ChildReconciler(api, Cache(), OperatorMetrics()).apply_first(prepared))  # type: ignore[arg-type]

    api = FakeApi()
    assert hand_over(api, replicas=5)
    assert api.calls == [("apply", HANDOFF_FIELD_MANAGER, "Deployment", {"replicas": 5})]
    taken = FakeApi(conflicts=(HANDOFF_FIELD_MANAGER,))
    assert not hand_over(taken)


def autoscaled_service() -> ServiceState:
    body = yaml.safe_load((ROOT / "examples" / "mixed.yaml").read_text())
    body["metadata"].update(name="s", namespace="n", uid=UID, generation=2)
    body["spec"]["roles"]["mixed"]["autoscaling"] = {"mode": "hpa", "maxReplicas": 4}
    return ServiceState(body=body, svc=parse(body), applied_generation=1)


def applies(api: FakeApi, cache: Cache, tracked: ServiceState) -> list[tuple[str, str, str]]:
    applier = ChildApplier(api, cache, EventRecorder(api), OperatorMetrics())  # type: ignore[arg-type]
    asyncio.run(applier.apply_all(("n", "s"), tracked, 2))
    return [(verb, manager, kind) for verb, manager, kind, _ in api.calls if kind == "Deployment"]


def test_the_applier_hands_over_before_it_drops_replicas():
    cached = live(managed(FIELD_MANAGER))
    cache = Cache(children={("n", "s"): {("Deployment", "s-mixed"): cached}})
    api = FakeApi()
    assert applies(api, cache, autoscaled_service()) == [
        ("apply", HANDOFF_FIELD_MANAGER, "Deployment"),
        ("apply", FIELD_MANAGER, "Deployment"),
    ]


def test_a_cold_cache_reads_the_deployment_and_a_done_handoff_is_not_repeated():
    api = FakeApi(deployment=live(managed(HANDOFF_FIELD_MANAGER)))
    assert applies(api, Cache(), autoscaled_service()) == [
        ("get", "", "Deployment"),
        ("apply", FIELD_MANAGER, "Deployment"),
    ]
