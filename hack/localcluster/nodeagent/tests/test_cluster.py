"""The node agent against a real control plane (``localcluster.controlplane``): what a kubelet's
users see. Needs root and the built control plane (skipped otherwise); about a minute.

One cluster for the module (no service proxy), the agent's back-off base 1 s. Each test makes
its pods in a namespace of its own.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from localcluster import controlplane
from localcluster.kubeapi import ApiError, KubeApi
from localcluster.layout import Layout

Obj = dict[str, Any]
TOLERATE = [{"key": "ketch.dev/local-node", "operator": "Exists"}]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the node agent needs root")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Layout, KubeApi]]:
    try:
        controlplane.binaries()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    layout = Layout(tmp_path_factory.mktemp("cluster"), tag="nat", index=58)
    controlplane.start(
        layout, service_proxy=False, watch_pid=os.getpid(), agent_args=("--backoff-base", "1")
    )
    api = KubeApi(layout.admin_kubeconfig)
    try:
        yield layout, api
    finally:
        api.close()
        controlplane.stop(layout.directory)
    assert not [n for n in _netns() if n.startswith(layout.netns_prefix)]
    assert not _processes_under(layout.directory / "pods")


@pytest.fixture
def ns(cluster: tuple[Layout, KubeApi]) -> str:
    _, api = cluster
    name = f"t-{uuid.uuid4().hex[:8]}"
    api.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    wait(lambda: _get(api, f"/api/v1/namespaces/{name}/serviceaccounts/default"), 30, "default SA")
    return name


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _processes_under(directory: Path) -> list[int]:
    """Processes whose working directory or open log is under ``directory``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(directory) in os.readlink(entry / "fd" / "1"):
                    found.append(int(entry.name))
    return found


def _get(api: KubeApi, path: str) -> Obj | None:
    try:
        return api.get(path)
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def wait(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


def pod(name: str, containers: list[Obj], **spec: Any) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"tolerations": TOLERATE, "containers": containers, **spec},
    }


def create(api: KubeApi, ns: str, obj: Obj, plural: str = "pods", group: str = "api/v1") -> Obj:
    return api.request("POST", f"/{group}/namespaces/{ns}/{plural}", obj)


def status_of(api: KubeApi, ns: str, name: str) -> Obj:
    return (_get(api, f"/api/v1/namespaces/{ns}/pods/{name}") or {}).get("status", {})


def test_deployment_ready_reachable_and_deleted_gracefully(cluster, ns) -> None:
    _, api = cluster
    web = {
        "name": "web",
        "image": "python:3.11",
        "command": ["python3", "-m", "http.server", "8080"],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        "lifecycle": {"preStop": {"sleep": {"seconds": 1}}},
    }
    template = {"metadata": {"labels": {"app": "web"}}, "spec": pod("x", [web])["spec"]}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}}, "template": template},
    }
    create(api, ns, deployment, "deployments", "apis/apps/v1")
    path = f"/apis/apps/v1/namespaces/{ns}/deployments/web"
    wait(lambda: api.get(path).get("status", {}).get("readyReplicas") == 2, 60, "2 ready")
    pods = api.get(f"/api/v1/namespaces/{ns}/pods")["items"]
    for p in pods:
        with urllib.request.urlopen(f"http://{p['status']['podIP']}:8080/", timeout=5) as r:
            assert r.status == 200
        assert p["status"]["hostIP"] == str(cluster[0].gateway)
    victim = pods[0]["metadata"]
    api.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{victim['name']}")
    wait(lambda: not _get(api, f"/api/v1/namespaces/{ns}/pods/{victim['name']}"), 30, "gone")
    wait(lambda: api.get(path).get("status", {}).get("readyReplicas") == 2, 60, "2 ready again")


def test_failures_show_as_on_a_kubelet(cluster, ns) -> None:
    _, api = cluster
    busybox = {"image": "busybox:1.36"}
    create(api, ns, pod("crash", [{"name": "c", **busybox, "command": ["sh", "-c", "exit 3"]}]))
    create(api, ns, pod("noimage", [{"name": "c", "image": "example.com/none:1"}]))
    init = [{"name": "setup", **busybox, "command": ["sh", "-c", "exit 1"]}]
    sleeper = [{"name": "c", **busybox, "command": ["sleep", "100"]}]
    create(api, ns, pod("initfail", sleeper, initContainers=init, restartPolicy="Never"))
    create(api, ns, pod("initloop", sleeper, initContainers=init))

    def crashloop() -> bool:
        s = status_of(api, ns, "crash").get("containerStatuses", [{}])[0]
        waiting = s.get("state", {}).get("waiting", {})
        return waiting.get("reason") == "CrashLoopBackOff" and s["restartCount"] >= 2

    wait(crashloop, 30, "CrashLoopBackOff")
    last = status_of(api, ns, "crash")["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 3 and last["reason"] == "Error"

    def pull_backoff() -> Any:
        st = status_of(api, ns, "noimage")
        state = st.get("containerStatuses", [{}])[0].get("state", {})
        return st.get("phase") == "Pending" and state.get("waiting", {}).get("reason")

    assert wait(pull_backoff, 30, "image pull failure") in ("ErrImagePull", "ImagePullBackOff")
    wait(lambda: pull_backoff() == "ImagePullBackOff", 30, "ImagePullBackOff")

    def init_failed() -> bool:
        st = status_of(api, ns, "initfail")
        term = st.get("initContainerStatuses", [{}])[0].get("state", {}).get("terminated", {})
        return st.get("phase") == "Failed" and term.get("reason") == "Error"

    wait(init_failed, 30, "Init:Error")

    def init_loop() -> bool:
        s = status_of(api, ns, "initloop").get("initContainerStatuses", [{}])[0]
        return s.get("state", {}).get("waiting", {}).get("reason") == "CrashLoopBackOff"

    wait(init_loop, 30, "Init:CrashLoopBackOff")
    assert status_of(api, ns, "initloop")["phase"] == "Pending"


CHECKS = r"""
import os, socket, pathlib
assert (os.getuid(), os.getgid()) == (1000, 1000), (os.getuid(), os.getgid())
assert 2000 in os.getgroups() and 3000 in os.getgroups()
assert socket.gethostname() == "checks"
assert open("/etc/config/greeting").read() == "hello"
assert open("/etc/secret/key").read() == "s3cret"
assert os.environ["GREETING"] == "hello" and os.environ["KEY"] == "s3cret"
assert os.environ["NAME_AND_NS"] == "checks/" + open("/etc/info/namespace").read()
assert os.environ["KUBERNETES_SERVICE_PORT"] == "443"
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
assert sorted(os.listdir(sa)) == ["ca.crt", "namespace", "token"]
assert open(sa + "/token").read().count(".") == 2
assert "search " + os.environ["NS"] + ".svc.cluster.local" in open("/etc/resolv.conf").read()
for path in ("/etc/config/x", "/not-writable"):
    try:
        open(path, "w")
    except OSError:
        pass
    else:
        raise AssertionError(path + " is writable")
pathlib.Path("/scratch/ok").write_text("ok")
assert not os.path.exists("/root/.kube")
"""


def test_environment_volumes_and_user(cluster, ns) -> None:
    _, api = cluster
    create(api, ns, {"metadata": {"name": "cfg"}, "data": {"greeting": "hello"}}, "configmaps")
    create(api, ns, {"metadata": {"name": "sec"}, "stringData": {"key": "s3cret"}}, "secrets")
    ref = {"fieldRef": {"fieldPath": "metadata.namespace"}}
    container = {
        "name": "checks",
        "image": "ghcr.io/ketch-dev/ketch-operator:0.1.0",
        "command": ["python", "-c", CHECKS],
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
        "env": [
            {"name": "GREETING", "value": "$(CFG_greeting)"},
            {"name": "NS", "valueFrom": ref},
            {"name": "NAME_AND_NS", "value": "checks/$(NS)"},
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "key"}}},
        ],
        "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False},
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/config"},
            {"name": "secret", "mountPath": "/etc/secret"},
            {"name": "info", "mountPath": "/etc/info"},
            {"name": "scratch", "mountPath": "/scratch"},
        ],
    }
    volumes = [
        {"name": "config", "configMap": {"name": "cfg"}},
        {"name": "secret", "secret": {"secretName": "sec"}},
        {"name": "scratch", "emptyDir": {}},
        {
            "name": "info",
            "downwardAPI": {"items": [{"path": "namespace", "fieldRef": ref["fieldRef"]}]},
        },
    ]
    security = {
        "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
        "fsGroup": 3000, "supplementalGroups": [2000],
    }  # fmt: skip
    spec = {"restartPolicy": "Never", "volumes": volumes, "securityContext": security}
    create(api, ns, pod("checks", [container], **spec))
    phase = wait(
        lambda: (
            status_of(api, ns, "checks").get("phase") in ("Succeeded", "Failed")
            and status_of(api, ns, "checks")["phase"]
        ),
        60,
        "the checks to finish",
    )
    logs = sorted((cluster[0].directory / "pods").glob(f"{ns}_checks_*/checks/0.log"))
    assert phase == "Succeeded", logs[0].read_text()[-2000:] if logs else "no log"


def test_liveness_failure_restarts_and_claims_mount(cluster, ns, tmp_path) -> None:
    layout, api = cluster
    (tmp_path / "model.txt").write_text("weights")
    pv = {
        "metadata": {"name": f"pv-{ns}"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "hostPath": {"path": str(tmp_path), "type": "Directory"},
        },
    }
    api.request("POST", "/api/v1/persistentvolumes", pv)
    pvc = {
        "metadata": {"name": "models"},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": f"pv-{ns}",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    create(api, ns, pvc, "persistentvolumeclaims")
    container = {
        "name": "c",
        "image": "busybox:1",
        "command": ["sh", "-c", "cat /models/model.txt; touch /tmp/alive; sleep 3600"],
        "livenessProbe": {
            "exec": {"command": ["sh", "-c", "test -f /tmp/alive && rm /tmp/alive"]},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    }
    volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}]
    create(api, ns, pod("live", [container], volumes=volumes, terminationGracePeriodSeconds=1))

    def restarted() -> bool:
        statuses = status_of(api, ns, "live").get("containerStatuses", [{}])
        return statuses[0].get("restartCount", 0) >= 1

    wait(restarted, 60, "a restart after failed liveness probes")
    logs = sorted((layout.directory / "pods").glob(f"{ns}_live_*/c/0.log"))
    assert logs and "weights" in logs[0].read_text()


def test_agent_restart_keeps_pods(cluster, ns) -> None:
    layout, api = cluster
    sleeper = {"name": "c", "image": "busybox:1", "command": ["sleep", "3600"]}
    create(api, ns, pod("keep", [sleeper]))
    wait(lambda: status_of(api, ns, "keep").get("phase") == "Running", 30, "running")
    before = status_of(api, ns, "keep")
    controlplane.restart(layout.directory, "node-agent")

    def running_again() -> Any:
        st = status_of(api, ns, "keep")
        s = st.get("containerStatuses", [{}])[0]
        return "running" in s.get("state", {}) and s.get("restartCount") == 1 and st

    after = wait(running_again, 60, "the pod running again")
    assert after["podIP"] == before["podIP"]
    assert (
        after["containerStatuses"][0]["containerID"]
        != before["containerStatuses"][0]["containerID"]
    )


def test_logs_through_the_api_server(cluster, ns) -> None:
    """kubectl logs: the API server's pods/log proxied to the agent's containerLogs endpoint,
    with the kubelet's parameters; nobody but the API server's kubelet client is answered."""
    layout, api = cluster
    script = "echo one; echo two; echo three; exit 4"
    c = [{"name": "c", "image": "busybox:1.36", "command": ["sh", "-c", script]}]
    create(api, ns, pod("talker", c))
    wait(
        lambda: status_of(api, ns, "talker").get("containerStatuses", [{}])[0].get("restartCount"),
        30,
        "a restart",
    )
    logs = f"/api/v1/namespaces/{ns}/pods/talker/log"
    assert api.request("GET", f"{logs}?container=c") == "one\ntwo\nthree\n"
    assert api.request("GET", f"{logs}?previous=true") == "one\ntwo\nthree\n"
    assert api.request("GET", f"{logs}?tailLines=1") == "three\n"
    assert api.request("GET", f"{logs}?limitBytes=2") == "on"
    with pytest.raises(ApiError) as refused:
        api.request("GET", f"/api/v1/namespaces/{ns}/pods/talker/log?container=nope")
    assert refused.value.status == 400 and "nope" in refused.value.body
    # the endpoint itself, as someone other than the API server (the admin's certificate)
    ctx = ssl.create_default_context(cafile=str(layout.pki / "ca.crt"))
    ctx.load_cert_chain(str(layout.pki / "admin.crt"), str(layout.pki / "admin.key"))
    url = f"https://{layout.gateway}:10250/containerLogs/{ns}/talker/c"
    with pytest.raises(urllib.error.HTTPError) as forbidden:
        urllib.request.urlopen(url, context=ctx, timeout=10)
    assert forbidden.value.code == 403
