"""The operator owns only what it created (security review M1, operator/ketch/operator/ownership).

An object that holds a child's name and is not controlled by the InferenceService (a person's
ConfigMap, what an earlier InferenceService of the same name left) is never applied to,
handed over or deleted: the InferenceService goes ``Degraded/ChildConflict`` naming it. A fake
API (objects by kind and name) stands in for the API server; test_ownership_e2e.py does the
same against the real one.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
import yaml
from test_autoscaling import ROOT, UID

from ketch.operator import ownership, status
from ketch.operator.cache import ServiceState
from ketch.operator.controller import Controller
from ketch.operator.managers import FIELD_MANAGER
from ketch.operator.ownership import ChildConflict
from ketch.operator.reconcile import prune
from ketch.operator.spec.parse import parse
from ketch.operator.workqueue import Work, error_reason

KEY = ("n", "s")
CHILDREN = {
    ("ConfigMap", "s-config"),
    ("NetworkPolicy", "s"),
    ("Service", "s-mixed"),
    ("Service", "s-mixed-peers"),
    ("PodDisruptionBudget", "s-mixed"),
    ("Deployment", "s-mixed"),
}


class FakeApi:
    """Objects by (kind, name) in one namespace. An apply creates or merges (metadata merged,
    the applier's managedFields entry added); ``sneak_in`` objects appear between a GET and the
    next apply of their name (someone else created them at that moment)."""

    def __init__(self, *objects: dict[str, Any], sneak_in: tuple[dict[str, Any], ...] = ()):
        self.objects = {_key(o): copy.deepcopy(o) for o in objects}
        self.sneak_in = {_key(o): copy.deepcopy(o) for o in sneak_in}
        self.calls: list[tuple[str, str, str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.statuses: list[dict[str, Any]] = []

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", kind, name, None))
        return copy.deepcopy(self.objects.get((kind, name)))

    async def apply(self, obj: dict[str, Any], *, force: bool = True, manager: str = FIELD_MANAGER):
        key = _key(obj)
        self.calls.append(("apply", *key, {"force": force, "fields": sorted(obj)}))
        if key in self.sneak_in:
            self.objects[key] = self.sneak_in.pop(key)
        old = self.objects.get(key) or {}
        old_meta = old.get("metadata") or {}
        entries = [e for e in old_meta.get("managedFields") or [] if e["manager"] != manager]
        meta = {
            **old_meta,
            **obj["metadata"],
            "uid": old_meta.get("uid") or f"uid-of-{key[1]}",
            "resourceVersion": str(len(self.calls)),
            "managedFields": [*entries, {"manager": manager, "operation": "Apply"}],
        }
        self.objects[key] = {**old, **obj, "metadata": meta}
        return copy.deepcopy(self.objects[key])

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None):
        self.calls.append(("delete", kind, name, uid))
        self.objects.pop((kind, name), None)
        return True

    async def post(self, kind: str, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.events.append(obj)
        return obj

    async def patch_status(self, kind: str, namespace: str, name: str, st: dict[str, Any]):
        self.statuses.append(st)
        return {}

    def verbs(self, *verbs: str) -> list[tuple[str, str, str, Any]]:
        return [c for c in self.calls if c[0] in verbs]


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def service_body() -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / "mixed.yaml").read_text())
    body["metadata"].update(name="s", namespace="n", uid=UID, generation=1)
    return body


def someones_configmap(**meta: Any) -> dict[str, Any]:
    """A ConfigMap named like the InferenceService's config, made by someone else."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "s-config",
            "namespace": "n",
            "uid": "theirs",
            "resourceVersion": "7",
            "managedFields": [{"manager": "kubectl-client-side-apply", "operation": "Update"}],
            **meta,
        },
        "data": {"app.properties": "color=blue\n"},
    }


def reconcile(api: FakeApi, work: Work, tracked: ServiceState | None = None, controller=None):
    """One reconcile of the InferenceService s; returns (its ChildConflict or None, tracked,
    controller)."""

    async def run():
        c = controller or Controller(api, resync_seconds=0)  # type: ignore[arg-type]
        t = tracked or c.cache.tracked.setdefault(KEY, ServiceState(body=service_body()))
        try:
            await c.reconcile(KEY, t, work)
        except ChildConflict as exc:
            return exc, t, c
        return None, t, c

    return asyncio.run(run())


def condition(st: dict[str, Any], kind: str) -> dict[str, Any]:
    return status.condition(st, kind) or {}


def test_an_object_holding_a_childs_name_is_left_alone_and_degrades_naming_it():
    theirs = someones_configmap()
    api = FakeApi(theirs)
    conflict, _, _ = reconcile(api, Work(full=True, status=True))
    assert conflict is not None
    assert set(conflict.conflicts) == {("ConfigMap", "s-config")}
    # Nothing of the generation is applied (not even the children that are free), nothing pruned.
    assert api.verbs("apply", "delete") == []
    assert api.objects[("ConfigMap", "s-config")] == theirs
    degraded = condition(api.statuses[-1], "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ChildConflict")
    assert (
        "ConfigMap n/s-config exists and is not controlled by this InferenceService"
        in (degraded["message"])
    )
    assert "kubectl-client-side-apply" in degraded["message"]
    assert condition(api.statuses[-1], "Ready")["reason"] == "ChildConflict"
    assert api.statuses[-1]["observedGeneration"] == 1
    warnings = [(e["type"], e["reason"], e["message"]) for e in api.events]
    assert [w[:2] for w in warnings] == [("Warning", "ChildConflict")]
    assert "ConfigMap n/s-config" in warnings[0][2]
    assert error_reason(conflict) == "ChildConflict"


def test_what_an_earlier_service_of_the_name_left_blocks_until_it_is_gone():
    """The garbage collector removes the children of a deleted InferenceService in the
    background; one made again at once under that name waits for it (retried), then applies."""
    old_owner = {"kind": "InferenceService", "name": "s", "uid": "earlier", "controller": True}
    api = FakeApi(someones_configmap(ownerReferences=[old_owner]))
    conflict, tracked, c = reconcile(api, Work(full=True, status=True))
    assert conflict is not None
    assert "controlled by InferenceService s (uid earlier)" in str(conflict)
    assert api.verbs("apply") == []
    del api.objects[("ConfigMap", "s-config")]  # the garbage collector
    conflict, tracked, c = reconcile(api, Work(full=True, status=True), tracked, c)
    assert conflict is None and tracked.conflicts == {}
    created = api.verbs("apply")
    assert {(kind, name) for _, kind, name, _ in created} == CHILDREN
    assert all(not how["force"] for *_, how in created)  # created, never forced onto anything
    assert condition(api.statuses[-1], "Degraded")["reason"] != "ChildConflict"
    # Once they are its own, applies are forced (drift repair takes fields back).
    api.calls.clear()
    conflict, tracked, c = reconcile(api, Work(full=True, status=True), tracked, c)
    assert conflict is None
    assert all(how["force"] for *_, how in api.verbs("apply")) and api.verbs("apply")


def test_an_object_made_by_someone_else_after_the_check_is_given_back():
    """Between the GET (nothing there) and the apply, someone creates the ConfigMap: the apply
    (not forced) merges into it without a field conflict; the operator takes its fields off
    again, applies no later stage, and reports the conflict."""
    sneaky = someones_configmap()
    sneaky["metadata"]["managedFields"] = [{"manager": "kubectl-create", "operation": "Update"}]
    api = FakeApi(sneak_in=(sneaky,))
    conflict, _, _ = reconcile(api, Work(full=True, status=True))
    assert conflict is not None and "kubectl-create" in str(conflict)
    config_applies = [c[3] for c in api.verbs("apply") if c[1:3] == ("ConfigMap", "s-config")]
    assert config_applies == [
        {"force": False, "fields": ["apiVersion", "data", "kind", "metadata"]},
        {"force": False, "fields": ["apiVersion", "kind", "metadata"]},  # the empty apply
    ]
    assert not [c for c in api.verbs("apply") if c[1] == "Deployment"]
    assert condition(api.statuses[-1], "Degraded")["reason"] == "ChildConflict"


def test_drift_is_not_put_back_onto_someone_elses_object():
    api = FakeApi()
    conflict, tracked, c = reconcile(api, Work(full=True, status=True))
    assert conflict is None
    # The operator's Service is deleted and someone makes their own under the name.
    theirs = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s-mixed", "namespace": "n", "uid": "theirs"},
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]},
    }
    api.objects[("Service", "s-mixed")] = copy.deepcopy(theirs)
    api.calls.clear()
    conflict, tracked, c = reconcile(
        api, Work(drift={("Service", "s-mixed")}, status=True), tracked, c
    )
    assert conflict is not None and set(tracked.conflicts) == {("Service", "s-mixed")}
    assert api.verbs("apply") == []
    assert api.objects[("Service", "s-mixed")] == theirs
    assert condition(api.statuses[-1], "Degraded")["reason"] == "ChildConflict"


def test_prune_deletes_only_what_the_service_controls_and_only_that_object():
    svc = parse(service_body())

    def obj(kind: str, name: str, uid: str, *owners: tuple[str, bool]) -> dict[str, Any]:
        refs = [
            {"kind": "InferenceService", "name": "s", "uid": u, "controller": c} for u, c in owners
        ]
        meta = {"name": name, "namespace": "n", "uid": uid, "ownerReferences": refs}
        return {"kind": kind, "metadata": meta}

    live = {
        ("Service", "s-old"): obj("Service", "s-old", "u1", (UID, True)),
        # a reference to the InferenceService that is not its controller: someone else's
        ("Service", "s-shared"): obj("Service", "s-shared", "u2", (UID, False)),
        ("ConfigMap", "s-left"): obj("ConfigMap", "s-left", "u3", ("earlier", True)),
    }
    api = FakeApi(obj("ScaledObject", "s-mixed", "u4", ("earlier", True)))
    deleted = asyncio.run(prune.prune_watched(api, svc, live, {}))  # type: ignore[arg-type]
    tracked = ServiceState(body=service_body(), svc=svc)  # after a restart: unwatched looked up
    unwatched = prune.prune_unwatched(api, tracked, svc, {})  # type: ignore[arg-type]
    deleted += asyncio.run(unwatched)
    assert deleted == ["Service s-old"]
    assert api.verbs("delete") == [("delete", "Service", "s-old", "u1")]  # uid precondition


def test_only_a_controller_reference_to_this_uid_makes_an_object_its_own():
    def with_refs(*refs: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"ownerReferences": list(refs)}}

    mine = {"kind": "InferenceService", "name": "s", "uid": UID, "controller": True}
    assert ownership.controlled_by(with_refs(mine), UID)
    assert not ownership.controlled_by(with_refs({**mine, "controller": False}), UID)
    assert not ownership.controlled_by(with_refs({**mine, "uid": "other"}), UID)
    assert not ownership.controlled_by(with_refs(), UID)
    assert not ownership.controlled_by(None, UID)
    assert not ownership.controlled_by(with_refs(mine), "")


def test_conflict_status_says_so_in_every_condition():
    st = status.compute(
        generation=4,
        mode="mixed",
        url="http://x",
        deployments={"mixed": None},
        pods=[],
        old=None,
        now="2026-12-01T00:00:00Z",
        conflict="ConfigMap n/s-config exists and is not controlled by this InferenceService",
    )
    reasons = {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}
    assert reasons == {
        "Ready": ("False", "ChildConflict"),
        "Progressing": ("False", "ChildConflict"),
        "Degraded": ("True", "ChildConflict"),
    }
    assert "ConfigMap n/s-config" in condition(st, "Degraded")["message"]


@pytest.mark.parametrize("code", [409, 422])
def test_a_refused_create_of_a_name_taken_meanwhile_is_a_conflict(code):
    from ketch.operator.kube import ApiError

    class Refusing(FakeApi):
        async def apply(self, obj, *, force=True, manager=FIELD_MANAGER):
            self.calls.append(("apply", *_key(obj), {"force": force}))
            self.objects[_key(obj)] = someones_configmap()
            raise ApiError(code, "Conflict", "Apply failed with 1 conflict")

    api = Refusing()
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "s-config", "namespace": "n"},
    }
    with pytest.raises(ChildConflict, match="ConfigMap n/s-config"):
        asyncio.run(ownership.create(api, UID, child))  # type: ignore[arg-type]


def test_a_conflict_is_retried_keeping_the_work_that_arrived_meanwhile():
    """A ChildConflict fails the reconcile and is retried with backoff; a spec change that
    arrives while the retry waits is not lost, and the conflict is not an API error (/healthz)."""
    from ketch.operator.metrics import OperatorMetrics
    from ketch.operator.workqueue import WorkQueue

    seen: list[Work] = []

    async def reconcile_key(key, work: Work) -> bool:
        seen.append(copy.deepcopy(work))
        if len(seen) == 1:
            raise ChildConflict({("ConfigMap", "s-config"): "taken"})
        return True

    async def run() -> WorkQueue:
        queue = WorkQueue(reconcile_key, OperatorMetrics(), max_backoff=0.2)
        queue.put(KEY, Work(status=True))
        await asyncio.sleep(0.05)  # the first attempt failed; the retry waits
        queue.put(KEY, Work(full=True))
        await queue.idle(5)
        return queue

    queue = asyncio.run(run())
    assert len(seen) == 2 and seen[-1].full and seen[-1].status
    assert queue.last_error is None
