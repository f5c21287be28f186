"""The Argo CD health check of InferenceServices (manifests/argocd/health.lua), run by a real
Lua 5.1 interpreter sandboxed as Argo CD sandboxes it (argocd_health.py):

- over every status a real operator wrote in a recorded run (tests/data/argocd/, made by
  record_argocd_statuses.py): the health recorded with it;
- over hostile and odd objects: never a Lua error, always a documented state;
- the ConfigMap in docs/install-argocd.md carries exactly the script;
- live: an InferenceService the operator made Ready is Healthy.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from argocd_health import DATA, ROOT, SCRIPT, expected, health, runtime, to_lua
from lupa.lua51 import LuaError
from test_coordinated_e2e import base, ketch_role, metrics  # noqa: F401 (fixture)
from test_e2e import cluster, operator, ready, wait_for  # noqa: F401 (fixtures)

from ketch.operator import api_names

Obj = dict[str, Any]
DOC = ROOT / "docs" / "install-argocd.md"
KEY = "resource.customizations.health.serving.ketch.dev_InferenceService"
PHASES = ("create", "rollout", "autoscale", "bad-image", "invalid-spec", "zero")


def _recorded() -> list[tuple[str, Obj]]:
    out = []
    for phase in PHASES:
        data = json.loads((DATA / f"{phase}.json").read_text())
        assert data["phase"] == phase
        out += [(f"{phase}-{i}", v) for i, v in enumerate(data["versions"])]
    return out


RECORDED = _recorded()


@pytest.mark.parametrize(("case", "version"), RECORDED, ids=[c for c, _ in RECORDED])
def test_recorded_statuses_map_to_their_health(case: str, version: Obj):
    obj = version["object"]
    assert expected(obj) == version["expected"], "the recorded label no longer follows the rule"
    status, message = health(obj)
    assert status == version["expected"], (case, message)
    if status != "Healthy":
        assert message.strip(), case
    cond = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}
    if status == "Degraded":  # the operator's reason and message, as written
        degraded = cond["Degraded"]
        assert message == f"{degraded['reason']}: {degraded['message']}"


def test_the_recording_covers_every_state_the_operator_can_cause():
    by_phase: dict[str, set[str]] = {}
    reasons = set()
    for case, version in RECORDED:
        by_phase.setdefault(case.rsplit("-", 1)[0], set()).add(version["expected"])
        for c in (version["object"].get("status") or {}).get("conditions") or []:
            if c["type"] == "Degraded" and c["status"] == "True":
                reasons.add(c["reason"])
    assert by_phase["create"] == {"Progressing", "Healthy"}
    assert by_phase["rollout"] == {"Progressing", "Healthy"}
    assert "Progressing" in by_phase["autoscale"] and "Healthy" in by_phase["autoscale"]
    assert "Degraded" in by_phase["bad-image"] and "Degraded" in by_phase["invalid-spec"]
    assert by_phase["zero"] == {"Progressing", "Suspended"}
    assert {"ImagePullError", "InvalidSpec"} <= reasons
    # a generation not yet observed, seen for real: the spec change's first version
    assert any(
        v["object"]["status"].get("observedGeneration", 0) < v["object"]["metadata"]["generation"]
        for c, v in RECORDED
        if c.startswith("rollout") and "status" in v["object"]
    )


def _svc(status: Any, generation: Any = 2, **extra: Any) -> Obj:
    meta: Obj = {"name": "x", "namespace": "llm"}
    if generation is not None:
        meta["generation"] = generation
    api = f"{api_names.GROUP}/{api_names.VERSION}"
    return {"apiVersion": api, "kind": api_names.KIND, "metadata": meta, "status": status, **extra}


def _cond(kind: str, status: Any, reason: Any = "R", message: Any = "m") -> Obj:
    return {"type": kind, "status": status, "reason": reason, "message": message}


def _ready(generation: Any = 2, roles: Any = None, *more: Obj, **fields: Any) -> Obj:
    status = {
        "observedGeneration": generation,
        "roles": roles if roles is not None else {"mixed": {"desired": 2, "ready": 2}},
        "conditions": [
            _cond("Ready", "True", "AllReplicasReady", "2/2 pods ready"),
            _cond("Progressing", "False", "Complete", "every role runs the current spec"),
            _cond("Degraded", "False", "AsExpected", "no problems seen"),
            *more,
        ],
        **fields,
    }
    return status


def _nested(depth: int, leaf: Any) -> Any:
    for i in range(depth):
        leaf = [leaf] if i % 2 else {"x": leaf}
    return leaf


BIG = 2**63 - 1  # the largest generation the API server could hold
HOSTILE: list[tuple[str, Any, str, str]] = [
    # (case, object, health, in the message)
    ("nothing", None, "Unknown", "not an object"),
    ("a string", "InferenceService", "Unknown", "not an object"),
    ("a number", 5, "Unknown", "not an object"),
    ("a list", [1, 2], "Progressing", "status"),
    ("empty object", {}, "Progressing", "waiting for the operator"),
    ("no status", _svc(None), "Progressing", "waiting for the operator"),
    ("status a string", _svc("Ready"), "Progressing", "waiting for the operator"),
    ("status a list", _svc([1]), "Progressing", "generation 2"),
    ("empty status", _svc({}), "Progressing", "generation 2"),
    ("no generation", _svc(_ready(), generation=None), "Healthy", "2/2"),
    ("generation a string", _svc(_ready(), generation="2"), "Unknown", "metadata.generation"),
    ("generation a list", _svc(_ready(), generation=[2]), "Unknown", "metadata.generation"),
    ("observed a string", _svc(_ready("2")), "Progressing", "status describes none"),
    ("observed behind", _svc(_ready(1)), "Progressing", "generation 2 (status describes 1)"),
    ("huge generation", _svc(_ready(BIG), generation=BIG), "Healthy", "2/2"),
    ("huge generation behind", _svc(_ready(2**40), generation=BIG), "Progressing", "92233720"),
    ("float generation", _svc(_ready(1e308), generation=1e308), "Healthy", "2/2"),
    ("negative generation", _svc(_ready(-5), generation=-5), "Healthy", "2/2"),
    ("conditions a map", _svc({"observedGeneration": 2, "conditions": {"type": "Ready"}}),
     "Progressing", "Ready condition"),
    ("conditions a string", _svc({"observedGeneration": 2, "conditions": "Ready"}),
     "Progressing", "Ready condition"),
    ("conditions junk", _svc({"observedGeneration": 2, "conditions": [5, "x", [], {"type": 7}]}),
     "Progressing", "Ready condition"),
    # JSON null ends a Lua array for ipairs, in Argo CD as here: nothing after it is seen
    ("null first", _svc({"observedGeneration": 2, "conditions": [None, *_ready()["conditions"]]}),
     "Progressing", "Ready condition"),
    ("ready a boolean", _svc({"observedGeneration": 2, "conditions": [_cond("Ready", True)]}),
     "Unknown", "Ready is"),
    ("ready unknown", _svc({"observedGeneration": 2, "conditions": [_cond("Ready", "Unknown")]}),
     "Unknown", "Ready is Unknown"),
    ("ready false alone", _svc({"observedGeneration": 2, "conditions": [_cond("Ready", "False")]}),
     "Progressing", "R: m"),
    ("conflict", _svc({"observedGeneration": 2,
                       "conditions": [_cond("Ready", "False", "ChildConflict", "taken")]}),
     "Degraded", "ChildConflict: taken"),
    ("degraded, message a map", _svc(_ready(2, None, _cond("Degraded", "True", "CrashLoop", {}))),
     "Healthy", "2/2"),  # the operator's own Degraded (False) comes first in the list
    ("degraded first", _svc({"observedGeneration": 2, "conditions": [
        _cond("Degraded", "True", "CrashLoop", {"a": 1}), _cond("Ready", "True")]}),
     "Degraded", "CrashLoop"),
    ("degraded, no reason", _svc({"observedGeneration": 2, "conditions": [
        _cond("Degraded", "True", None, None)]}), "Degraded", ""),
    ("huge message", _svc({"observedGeneration": 2, "conditions": [
        _cond("Degraded", "True", "CrashLoop", "x" * 1_000_000)]}), "Degraded", "xxx..."),
    ("roles short", _svc(_ready(2, {"decode": {"desired": 3, "ready": 1}, "prefill": 5})),
     "Progressing", "decode: 1 of 3 pods ready"),
    ("roles a list", _svc(_ready(2, [1, 2])), "Healthy", "2/2"),
    ("roles strings", _svc(_ready(2, {"mixed": {"desired": "3", "ready": "1"}})), "Healthy", "2/2"),
    ("roles odd keys", _svc(_ready(2, {"1": {"desired": 0, "ready": 0}, "": {}})),
     "Healthy", "2/2"),
    ("zero", _svc(_ready(2, {"mixed": {"desired": 0, "ready": 0}})), "Suspended", "scaled to zero"),
    ("zero, disaggregated", _svc(_ready(2, {"prefill": {"desired": 0, "ready": 0},
                                            "decode": {"desired": 0, "ready": 0},
                                            "router": {"desired": 1, "ready": 1}},
                                        mode="disaggregated")), "Suspended", "scaled to zero"),
    ("router alone ready", _svc(_ready(2, {"decode": {"desired": 1, "ready": 1},
                                           "router": {"desired": 1, "ready": 1}},
                                       mode="disaggregated")), "Healthy", "2/2"),
    ("no roles", _svc(_ready(2, {})), "Healthy", "2/2"),
    ("still progressing", _svc({"observedGeneration": 2, "conditions": [
        _cond("Ready", "True"), _cond("Progressing", "True", "Updating", "scaling")]}),
     "Progressing", "Updating: scaling"),
    ("scaling paused", _svc(_ready(2, None, _cond("ScalingActive", "False", "MetricsUnavailable",
                                                  "no metrics"))),
     "Healthy", "autoscaling paused: MetricsUnavailable: no metrics"),
    ("deep junk in status", _svc({**_ready(), "junk": _nested(300, "x")}), "Healthy", "2/2"),
    ("deep junk as conditions", _svc({"observedGeneration": 2, "conditions": _nested(300, 1)}),
     "Progressing", "Ready condition"),
    ("deep junk as roles", _svc(_ready(2, _nested(300, 1))), "Healthy", "2/2"),
    ("many conditions", _svc({"observedGeneration": 2, "conditions": [
        *[_cond(f"T{i}", "True") for i in range(20000)], *_ready()["conditions"]]}),
     "Healthy", "2/2"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "obj", "state", "part"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_odd_objects_never_raise_and_get_a_documented_state(case, obj, state, part):
    status, message = health(obj)
    assert (status, part in message) == (state, True), (case, message)
    if status != "Healthy":
        assert message.strip() or state == "Degraded", case  # Degraded with nothing to say
    assert len(message) < 3000


def test_the_script_is_plain_lua_51_without_libraries_argo_cd_leaves_out():
    lua = runtime()
    gone = lua.execute("return os == nil and io == nil and require == nil and load == nil")
    assert gone is True
    text = SCRIPT.read_text()
    for word in ("os.", "io.", "require", "dofile", "loadstring", "debug.", "goto", "//"):
        assert word not in re.sub(r"--[^\n]*", "", text), word
    # and an error in a script fails the harness, as it fails in Argo CD
    with pytest.raises(LuaError):
        health({}, script="return os.time()")
    with pytest.raises(AssertionError):
        health({}, script='return {status = "Fine", message = ""}')


def test_the_conversion_is_argo_cds():
    lua = runtime()
    table = to_lua(lua, {"a": [1, None, 3], "b": None, "c": 2**53 + 1})
    count = lua.eval(
        "function(t) local n = 0; for _ in ipairs(t.a) do n = n + 1 end;"
        " return n, t.a[3], t.b == nil, type(t.c) end"
    )
    assert count(table) == (1, 3.0, True, "number")
    with pytest.raises(OverflowError):
        to_lua(lua, {"generation": 10**400})


def _doc_configmaps() -> list[Obj]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    return [yaml.safe_load(b) for b in blocks if KEY in b]


def test_the_documented_configmap_carries_the_script():
    docs = _doc_configmaps()
    assert len(docs) == 1, "one ConfigMap with the health check in docs/install-argocd.md"
    cm = docs[0]
    assert (cm["apiVersion"], cm["kind"]) == ("v1", "ConfigMap")
    assert cm["metadata"]["name"] == "argocd-cm" and cm["metadata"]["namespace"] == "argocd"
    assert cm["data"][KEY] == SCRIPT.read_text(), (
        "docs/install-argocd.md and manifests/argocd/health.lua differ: copy the file into "
        "the ConfigMap (indented by 4 spaces)"
    )
    assert f"{api_names.GROUP}_{api_names.KIND}" in KEY


def test_the_documented_patch_command_installs_the_script(cluster):  # noqa: F811
    """The docs' ``kubectl patch`` line, run as written (in the test's namespace instead of
    argocd) against a real ConfigMap: the key holds the file, other settings stay."""
    if shutil.which("jq") is None:
        pytest.skip("the documented command needs jq")
    command = re.findall(r"```sh\n(kubectl -n argocd patch configmap argocd-cm.*?)```",
                         DOC.read_text(), flags=re.S)  # fmt: skip
    assert len(command) == 1
    cm = {"apiVersion": "v1", "kind": "ConfigMap",
          "metadata": {"name": "argocd-cm"}, "data": {"url": "https://argo.example"}}  # fmt: skip
    cluster.apply(cm)
    env = {**os.environ, "KUBECONFIG": str(cluster.kube.kubeconfig)}
    script = command[0].replace("-n argocd", f"-n {cluster.namespace}", 1)
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = cluster.get("configmaps", "argocd-cm")["data"]
    assert data == {"url": "https://argo.example", KEY: SCRIPT.read_text()}
    cluster.run("delete", "configmap", "argocd-cm")


def test_a_live_ready_inferenceservice_is_healthy(cluster, operator, metrics):  # noqa: F811
    body = base("argolive")
    body["spec"]["roles"]["mixed"] = {**ketch_role(), "replicas": 1}
    del body["spec"]["roles"]["mixed"]["autoscaling"]
    cluster.apply(body)
    live = wait_for(lambda: ready(cluster, "argolive"), "argolive Ready", timeout=180)
    assert health(copy.deepcopy(live)) == ("Healthy", "1/1 pods ready")
    cluster.run("delete", api_names.PLURAL, "argolive")
