"""The node agent's pure parts: environment and command resolution, pod phase and conditions,
image references, quantities and mounts order."""

from __future__ import annotations

from fractions import Fraction

import pytest

from localcluster.nodeagent import envs, status
from localcluster.nodeagent.images import ImageTable, PullError, normalise
from localcluster.nodeagent.node import parse_taint

POD = {
    "metadata": {
        "name": "web-1", "namespace": "shop", "uid": "u-1",
        "labels": {"app": "web"}, "annotations": {"note": 'say "hi"'},
    },
    "spec": {"nodeName": "n1", "serviceAccountName": "sa"},
    "status": {"podIP": "10.244.0.5", "podIPs": [{"ip": "10.244.0.5"}], "hostIP": "10.244.0.1"},
}  # fmt: skip


def test_expand() -> None:
    m = {"A": "1", "B": "two"}
    assert envs.expand("$(A)-$(B)", m) == "1-two"
    assert envs.expand("$(C)", m) == "$(C)"
    assert envs.expand("$$(A)", m) == "$(A)"
    assert envs.expand("$$$(A)", m) == "$1"
    assert envs.expand("a$b$", m) == "a$b$"
    assert envs.expand("$(A", m) == "$(A"


def test_quantities() -> None:
    assert envs.parse_quantity("100m") == Fraction(1, 10)
    assert envs.parse_quantity("1Gi") == 2**30
    assert envs.parse_quantity("2e3") == 2000
    assert envs.parse_quantity("1.5") == Fraction(3, 2)
    with pytest.raises(ValueError):
        envs.parse_quantity("1X")


def test_fields() -> None:
    assert envs.field_value(POD, "metadata.labels['app']") == "web"
    assert envs.field_value(POD, "metadata.annotations['note']") == 'say "hi"'
    assert envs.field_value(POD, "metadata.annotations") == 'note="say \\"hi\\""\n'
    assert envs.field_value(POD, "status.podIPs") == "10.244.0.5"
    assert envs.field_value(POD, "spec.serviceAccountName") == "sa"
    with pytest.raises(envs.ConfigError):
        envs.field_value(POD, "spec.bogus")


def _ref(name: str, key: str, **extra: object) -> dict:
    return {"name": name, "key": key, **extra}


def _res(resource: str, divisor: str) -> dict:
    return {"resource": resource, "divisor": divisor}


def test_container_env_order_and_sources() -> None:
    data = {
        ("configmap", "cm"): {"X": "from-cm", "bad=name": "skip"},
        ("secret", "s"): {"K": b"pw"},
    }

    def lookup(kind: str, name: str):
        return data.get((kind, name))

    container = {
        "name": "c",
        "resources": {"limits": {"memory": "1Gi"}, "requests": {"cpu": "250m"}},
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "P_"}],
        "env": [
            {"name": "A", "value": "a"},
            {"name": "B", "value": "$(A)-$(P_X)-$(LATER)-$(SVC_SERVICE_HOST)"},
            {"name": "LATER", "value": "l"},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "K"}}},
            {"name": "OPT", "valueFrom": {"configMapKeyRef": _ref("no", "k", optional=True)}},
            {"name": "MEM", "valueFrom": {"resourceFieldRef": _res("limits.memory", "1Mi")}},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": _res("requests.cpu", "1m")}},
            {"name": "CPUL", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "EMPTY"},
        ],
    }  # fmt: skip
    svc = envs.service_env([], "10.96.0.1", True) | {"SVC_SERVICE_HOST": "1.2.3.4"}
    env = envs.container_env(POD, container, lookup, svc, {"cpu": "2", "memory": "8Gi"})
    assert env["P_X"] == "from-cm" and "P_bad=name" not in env
    assert env["B"] == "a-from-cm-$(LATER)-1.2.3.4"
    assert env["IP"] == "10.244.0.5" and env["PW"] == "pw" and "OPT" not in env
    assert env["MEM"] == "1024" and env["CPU"] == "250" and env["CPUL"] == "2"
    assert env["EMPTY"] == ""
    assert env["KUBERNETES_SERVICE_HOST"] == "10.96.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == "443"
    assert env["KUBERNETES_PORT_443_TCP"] == "tcp://10.96.0.1:443"
    assert list(env)[:3] == ["P_X", "A", "B"]
    missing = {
        "name": "c",
        "env": [{"name": "Z", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "nope"}}}],
    }
    with pytest.raises(envs.ConfigError, match="couldn't find key nope in ConfigMap shop/cm"):
        envs.container_env(POD, missing, lookup, {}, {})
    with pytest.raises(envs.ConfigError, match='secret "gone" not found'):
        envs.container_env(
            POD, {"name": "c", "envFrom": [{"secretRef": {"name": "gone"}}]}, lookup, {}, {}
        )


def test_service_links() -> None:
    svc = {
        "metadata": {"name": "my-db"},
        "spec": {"clusterIP": "10.96.0.7", "ports": [{"name": "pg", "port": 5432}]},
    }
    headless = {"metadata": {"name": "h"}, "spec": {"clusterIP": "None", "ports": [{"port": 1}]}}
    env = envs.service_env([svc, headless], "10.96.0.1", True)
    assert env["MY_DB_SERVICE_HOST"] == "10.96.0.7" and env["MY_DB_SERVICE_PORT_PG"] == "5432"
    assert env["MY_DB_PORT"] == "tcp://10.96.0.7:5432" and "H_SERVICE_HOST" not in env
    assert "MY_DB_SERVICE_HOST" not in envs.service_env([svc], "10.96.0.1", False)


def test_command_line() -> None:
    env = {"X": "x"}
    assert envs.command_line({"command": ["a", "$(X)"], "args": ["$$(X)"]}, ["e"], ["c"], env) == [
        "a",
        "x",
        "$(X)",
    ]
    assert envs.command_line({"command": ["a"]}, ["e"], ["c"], env) == ["a"]
    assert envs.command_line({"args": ["$(X)"]}, ["e"], ["c"], env) == ["e", "x"]
    assert envs.command_line({}, ["e"], ["c"], env) == ["e", "c"]


def _st(name: str, state: dict, last: dict | None = None, ready: bool = False) -> dict:
    return {"name": name, "state": state, "lastState": last or {}, "ready": ready}


RUN = {"running": {"startedAt": "t"}}
WAIT = {"waiting": {"reason": "ContainerCreating"}}


def _term(code: int) -> dict:
    return {"terminated": {"exitCode": code}}


def test_phase() -> None:
    spec = {"containers": [{"name": "a"}], "initContainers": [{"name": "i"}]}
    assert status.phase(spec, [_st("i", RUN)], [_st("a", WAIT)], False) == "Pending"
    assert status.phase(spec, [_st("i", _term(0))], [_st("a", RUN)], False) == "Running"
    never = {**spec, "restartPolicy": "Never"}
    assert status.phase(never, [_st("i", _term(1))], [_st("a", WAIT)], False) == "Failed"
    backoff = {"waiting": {"reason": "CrashLoopBackOff"}}
    assert status.phase(spec, [_st("i", backoff, _term(1))], [_st("a", WAIT)], False) == "Pending"
    plain = {"containers": [{"name": "a"}]}
    assert status.phase(plain, [], [_st("a", backoff, _term(1))], False) == "Running"
    assert (
        status.phase({**plain, "restartPolicy": "Never"}, [], [_st("a", _term(0))], False)
        == "Succeeded"
    )
    assert (
        status.phase({**plain, "restartPolicy": "Never"}, [], [_st("a", _term(2))], False)
        == "Failed"
    )
    assert (
        status.phase({**plain, "restartPolicy": "OnFailure"}, [], [_st("a", _term(2))], False)
        == "Running"
    )
    assert status.phase(plain, [], [_st("a", _term(143))], True) == "Failed"
    assert status.phase(plain, [], [_st("a", _term(0))], True) == "Succeeded"


def test_conditions_keep_transition_times_and_foreign_conditions() -> None:
    spec = {"containers": [{"name": "a"}, {"name": "b"}], "initContainers": [{"name": "i"}]}
    old = [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": "t0"},
        {"type": "Initialized", "status": "True", "lastTransitionTime": "t1"},
    ]
    conds = status.conditions(
        old,
        spec,
        [_st("i", _term(0))],
        [_st("a", RUN, ready=True), _st("b", RUN)],
        "Running",
        True,
        "t2",
    )
    by = {c["type"]: c for c in conds}
    assert by["PodScheduled"]["lastTransitionTime"] == "t0"
    assert by["Initialized"] == {
        "type": "Initialized",
        "status": "True",
        "lastProbeTime": None,
        "lastTransitionTime": "t1",
    }
    assert by["Ready"]["status"] == "False" and by["Ready"]["reason"] == "ContainersNotReady"
    assert by["Ready"]["message"] == "containers with unready status: [b]"
    assert by["ContainersReady"]["lastTransitionTime"] == "t2"
    assert by["PodReadyToStartContainers"]["status"] == "True"
    conds = status.conditions(
        old, spec, [_st("i", RUN)], [_st("a", WAIT), _st("b", WAIT)], "Pending", True, "t3"
    )
    by = {c["type"]: c for c in conds}
    assert by["Initialized"]["message"] == "containers with incomplete status: [i]"


def test_qos() -> None:
    assert status.qos_class({"containers": [{"name": "a"}]}) == "BestEffort"
    g = {"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "1", "memory": "1Gi"}}
    assert status.qos_class({"containers": [{"resources": g}]}) == "Guaranteed"
    assert (
        status.qos_class({"containers": [{"resources": {"requests": {"cpu": "1"}}}]}) == "Burstable"
    )


def test_images(tmp_path) -> None:
    assert normalise("python:3.11") == "docker.io/library/python:3.11"
    assert normalise("busybox") == "docker.io/library/busybox:latest"
    assert normalise("ghcr.io/a/b:1") == "ghcr.io/a/b:1"
    assert normalise("localhost:5000/x") == "localhost:5000/x:latest"
    table = ImageTable(None)
    engine = table.resolve("ghcr.io/ketch-dev/ketch-engine:0.1.0")
    assert engine.uid == 1000 and engine.gid == 1000 and engine.cmd == ["ketch", "--help"]
    assert engine.path[0].endswith("/.venv/bin") and engine.env["KETCH_EXTENSION_DIR"]
    assert table.resolve("python:3.11").cmd == ["python3"]
    with pytest.raises(PullError, match="nothing:1"):
        table.resolve("nothing:1")
    custom = tmp_path / "images.json"
    custom.write_text('[{"image": "demo/*", "path": ["/opt/x"], "env": {"A": "1"}}]')
    table = ImageTable(custom)
    image = table.resolve("demo/app:1")
    assert image.base_env()["PATH"].startswith("/opt/x:") and image.env == {"A": "1"}


def test_taints() -> None:
    assert parse_taint("a=b:NoSchedule") == {"key": "a", "value": "b", "effect": "NoSchedule"}
    assert parse_taint("a:NoExecute") == {"key": "a", "effect": "NoExecute"}
    with pytest.raises(ValueError):
        parse_taint("a=b")
