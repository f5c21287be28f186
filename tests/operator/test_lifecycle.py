"""What a cluster does to an operator every day: `ketch-operator run` as a process, against an
API server of its own (a fresh emulator for this module; the session's cluster when
KETCH_TEST_KUBECONFIG is set, where the emulator-only faults skip).

- SIGKILL in the middle of a reconcile (the emulator holds the operator's apply of the
  Deployment, so the kill lands between two children), then a restart: the children converge,
  nothing is duplicated, and Ready never goes True -> False -> True without a spec change;
- every watch expired (410 Gone, as etcd compaction does): the operator lists again and
  reconciles what changes after it;
- cluster-wide (no --namespace): two InferenceServices of one name in two namespaces are
  reconciled independently, and deleting one leaves the other;
- a role switched from fixed replicas to autoscaling keeps its replica count: the Deployment
  never drops below it (server-side apply hand-over, operator/ketch/operator/handoff.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import operator_rbac
import pytest
from test_e2e import Cluster, condition, cpu_example, fresh_namespace, ready, wait_for

from ketch.operator import crd
from ketch.operator.kube import FIELD_MANAGER, HANDOFF_FIELD_MANAGER
from kubeemu import Emulator, start_emulator
from procs import free_ports

EXE = str(Path(sys.executable).parent / "ketch-operator")
OWNED_KINDS = ("configmaps", "services", "deployments", "poddisruptionbudgets", "networkpolicies")
ISVC_PATH = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{{ns}}/{crd.PLURAL}"


class Operator:
    """`ketch-operator run --standalone` as a process, signed in as its ServiceAccount with the
    manifests' RBAC: the single-namespace overlay for the namespaces given, or cluster-wide."""

    def __init__(self, kube: Any, namespaces: list[str], log: Path):
        (self.metrics_port,) = free_ports(1)
        self.log = log
        kubeconfig = operator_rbac.install(
            kube,
            namespaces[0] if namespaces else "default",
            log.with_suffix(".rbac"),
            cluster_wide=not namespaces,
        )
        args = [f"--namespace={ns}" for ns in namespaces]
        args += ["--metrics-port", str(self.metrics_port), "--log-level", "INFO"]
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        self.proc = subprocess.Popen(
            [EXE, "run", "--standalone", *args],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        wait_for(self.healthy, "the operator to serve /healthz", timeout=60)

    def healthy(self) -> bool:
        import urllib.request

        try:
            url = f"http://127.0.0.1:{self.metrics_port}/healthz"
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def metric(self, line_start: str) -> float:
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return 0.0
        found = [line for line in text.splitlines() if line.startswith(line_start)]
        return float(found[0].split()[-1]) if found else 0.0

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                raise
        return self.proc.returncode


@pytest.fixture(scope="module")
def api(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh emulator for this module (cluster-wide operators must see only these tests'
    objects), or the session's real cluster."""
    if os.environ.get("KETCH_TEST_KUBECONFIG"):
        yield request.getfixturevalue("kube")
        return
    emu = start_emulator()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture
def cluster(api: Any) -> Iterator[Cluster]:
    with fresh_namespace(api, "life") as c:
        yield c


@pytest.fixture
def operators() -> Iterator[list[Operator]]:
    """Operators a test starts; any still running at the end are stopped."""
    started: list[Operator] = []
    yield started
    for op in started:
        if op.proc.poll() is None:
            op.stop(signal.SIGKILL)


def owned(cluster: Cluster, namespace: str) -> Counter[tuple[str, str, str]]:
    """(kind, owner kind, owner name) of every object in ``namespace`` with an owner."""
    out: Counter[tuple[str, str, str]] = Counter()
    for kind in (*OWNED_KINDS, "replicasets", "pods", "horizontalpodautoscalers"):
        result = cluster.run("get", kind, "-n", namespace, "-o", "json", ns=False)
        for item in json.loads(result.stdout)["items"]:
            for ref in item["metadata"].get("ownerReferences") or []:
                out[(item["kind"], ref["kind"], ref["name"])] += 1
    return out


def history(kube: Emulator, path: str, since: str, name: str) -> list[dict[str, Any]]:
    """Every version of one object since resourceVersion ``since``, from the watch history."""
    events = kube.watch(
        path,
        {"resourceVersion": since, "timeoutSeconds": 1, "fieldSelector": f"metadata.name={name}"},
    )
    out = []
    for event in events:
        assert event["type"] != "ERROR", event
        out.append(event["object"])
    return out


def ready_flaps(versions: list[dict[str, Any]]) -> list[str]:
    """Each Ready True -> False that no spec change (new generation) explains."""
    flaps = []
    last: tuple[str, int] | None = None  # (Ready status, generation) last seen
    for body in versions:
        status = condition(body, "Ready").get("status")
        generation = body["metadata"]["generation"]
        if status is None:
            continue
        if last == ("True", generation) and status == "False":
            flaps.append(f"generation {generation}: {condition(body, 'Ready')}")
        last = (status, generation)
    return flaps


def merge_patch(cluster: Cluster, name: str, patch: dict[str, Any]) -> None:
    cluster.run("patch", crd.PLURAL, name, "--type", "merge", "-p", json.dumps(patch))


def list_version(kube: Emulator, path: str) -> str:
    return kube.get(path).ok()["metadata"]["resourceVersion"]


# --------------------------------------------------------------------------- SIGKILL


def test_sigkill_mid_reconcile_then_restart(cluster, operators, tmp_path):
    kube, ns = cluster.kube, cluster.namespace
    if not kube.is_emulator:
        pytest.skip("holding a request needs the emulator")
    path = ISVC_PATH.format(ns=ns)
    since = list_version(kube, path)
    operators.append(Operator(kube, [ns], tmp_path / "first.log"))
    kube.hold(verb="apply", resource="deployments", namespace=ns)
    try:
        cluster.apply(cpu_example("crash"))
        wait_for(lambda: kube.holds()[0]["waiting"] == 1, "the operator's Deployment apply")
        mid = set(owned(cluster, ns))
        assert ("ConfigMap", "InferenceService", "crash") in mid  # applied before the kill
        assert ("Deployment", "InferenceService", "crash") not in mid
        assert operators[0].stop(signal.SIGKILL) == -signal.SIGKILL
        wait_for(lambda: kube.holds()[0]["waiting"] == 0, "the killed operator's apply dropped")
    finally:
        kube.release()
    assert cluster.get("deployment", "crash-mixed") is None  # the apply in flight never landed

    second = Operator(kube, [ns], tmp_path / "second.log")
    operators.append(second)
    wait_for(lambda: ready(cluster, "crash"), "crash Ready after the restart")
    counts = owned(cluster, ns)
    pods = [n for (kind, _, _), n in counts.items() if kind == "Pod"]
    assert pods == [2], counts  # the 2 replicas, of one ReplicaSet
    assert {k: n for k, n in counts.items() if k[0] != "Pod"} == {
        ("ConfigMap", "InferenceService", "crash"): 1,
        ("NetworkPolicy", "InferenceService", "crash"): 1,
        ("Service", "InferenceService", "crash"): 2,
        ("PodDisruptionBudget", "InferenceService", "crash"): 1,
        ("Deployment", "InferenceService", "crash"): 1,
        ("ReplicaSet", "Deployment", "crash-mixed"): 1,
    }, counts

    # Killed again while idle, and restarted with its Deployment watch slow to list (held):
    # the new process reconciles before it has seen the Deployment, and must not flip Ready.
    assert second.stop(signal.SIGKILL) == -signal.SIGKILL
    kube.hold(verb="list", resource="deployments", namespace=ns)
    try:
        third = Operator(kube, [ns], tmp_path / "third.log")
        operators.append(third)
        wait_for(lambda: kube.holds()[0]["waiting"] == 1, "the Deployment list held")
        wait_for(
            lambda: third.metric('ketch_operator_reconciles_total{kind="full"}') >= 1,
            "the restarted operator's first reconcile",
        )
        # a pod event meanwhile: a status-only reconcile, still without the Deployment watch
        pod = cluster.items("pods", "app.kubernetes.io/instance=crash")[0]["metadata"]["name"]
        cluster.run("label", "pod", pod, "touched=yes")
        wait_for(
            lambda: third.metric('ketch_operator_reconciles_total{kind="status"}') >= 1,
            "a status reconcile after the pod event",
        )
    finally:
        kube.release()
    wait_for(lambda: ready(cluster, "crash"), "crash still Ready")
    assert owned(cluster, ns) == counts
    versions = history(kube, path, since, "crash")
    assert ready_flaps(versions) == []
    statuses = [condition(b, "Ready").get("status") for b in versions]
    assert statuses[-1] == "True"
    assert "False" not in statuses[statuses.index("True") :], statuses
    assert third.stop() == 0, third.output()


# --------------------------------------------------------------------------- 410 Gone


def test_watch_expiry_then_the_operator_resumes(cluster, operators, tmp_path):
    kube, ns = cluster.kube, cluster.namespace
    if not kube.is_emulator:
        pytest.skip("expiring watches needs the emulator")
    op = Operator(kube, [ns], tmp_path / "operator.log")
    operators.append(op)
    cluster.apply(cpu_example("expiry"))
    wait_for(lambda: ready(cluster, "expiry"), "expiry Ready")
    lists_before = kube.stats()["requests_by_agent"].get("kopf", {}).get("list", 0)

    # every watch kopf holds (the InferenceServices and each child kind) ends with a 410
    assert kube.expire_watches() >= 1 + len(OWNED_KINDS)
    wait_for(
        lambda: kube.stats()["requests_by_agent"]["kopf"].get("list", 0) >= lists_before + 6,
        "kopf to list again after the 410s",
    )

    # a spec change made after the 410 is reconciled
    merge_patch(cluster, "expiry", {"spec": {"engine": {"maxNumSeqs": 7}}})
    body = wait_for(
        lambda: (b := ready(cluster, "expiry")) and b["metadata"]["generation"] == 2 and b,
        "generation 2 reconciled after the 410",
    )
    assert body["status"]["observedGeneration"] == 2
    config = cluster.get("configmap", "expiry-config")
    assert "max_num_seqs: 7" in json.dumps(config["data"])
    # and a child deleted after it is put back: the child watches resumed too
    cluster.run("delete", "service", "expiry-mixed")
    wait_for(lambda: cluster.get("service", "expiry-mixed"), "the Service restored")
    assert op.stop() == 0, op.output()
    assert "Error in the watch-stream" not in op.output()


# --------------------------------------------------------------------------- cluster-wide


def test_cluster_wide_same_name_in_two_namespaces(api, operators, tmp_path):
    with fresh_namespace(api, "east") as east, fresh_namespace(api, "west") as west:
        operators.append(Operator(api, [], tmp_path / "operator.log"))
        for c, replicas in ((east, 1), (west, 2)):
            body = cpu_example("twin")
            body["spec"]["roles"]["mixed"]["replicas"] = replicas
            c.apply(body)
        got = {
            c.namespace: wait_for(lambda c=c: ready(c, "twin"), f"twin Ready in {c.namespace}")
            for c in (east, west)
        }
        for c, replicas in ((east, 1), (west, 2)):
            body = got[c.namespace]
            assert body["status"]["replicas"] == f"{replicas}/{replicas}"
            assert f"twin-mixed.{c.namespace}.svc" in body["status"]["url"]
            uid = body["metadata"]["uid"]
            for kind in OWNED_KINDS:
                for item in c.items(kind, "app.kubernetes.io/instance=twin"):
                    refs = item["metadata"]["ownerReferences"]
                    assert [(r["name"], r["uid"]) for r in refs] == [("twin", uid)], item
            dep = c.get("deployment", "twin-mixed")
            assert dep["spec"]["replicas"] == replicas
        assert got[east.namespace]["metadata"]["uid"] != got[west.namespace]["metadata"]["uid"]

        east.run("delete", crd.PLURAL, "twin", "--wait=true")
        wait_for(lambda: not east.items("deployments", "app.kubernetes.io/instance=twin"), "GC")
        assert ready(west, "twin")
        west_owned = owned(west, west.namespace)
        assert west_owned[("Deployment", "InferenceService", "twin")] == 1
        # the survivor is still reconciled: a change to it is applied, in its namespace only
        merge_patch(west, "twin", {"spec": {"roles": {"mixed": {"replicas": 3}}}})
        wait_for(
            lambda: (b := ready(west, "twin")) and b["status"]["replicas"] == "3/3",
            "west twin at 3 replicas",
        )
        assert not east.items("deployments", "app.kubernetes.io/instance=twin")
        assert not east.items("configmaps", "app.kubernetes.io/instance=twin")


# --------------------------------------------------------------------------- fixed -> autoscaled


def deployment(cluster: Cluster, name: str) -> dict[str, Any]:
    """The Deployment with its managedFields (kubectl hides them by default)."""
    got = cluster.run("get", "deployment", name, "-o", "json", "--show-managed-fields")
    return json.loads(got.stdout)


def replicas_owners(obj: dict[str, Any]) -> set[str]:
    return {
        e["manager"]
        for e in obj["metadata"].get("managedFields") or []
        if "f:replicas" in (e.get("fieldsV1") or {}).get("f:spec", {})
    }


@pytest.mark.parametrize("mode", ["hpa", "ketch"])
def test_fixed_to_autoscaled_keeps_the_replica_count(cluster, operators, tmp_path, mode):
    kube, ns = cluster.kube, cluster.namespace
    operators.append(Operator(kube, [ns], tmp_path / "operator.log"))
    name = f"scale-{mode}"
    body = cpu_example(name)
    body["spec"]["roles"]["mixed"]["replicas"] = 3
    cluster.apply(body)
    wait_for(lambda: ready(cluster, name), f"{name} Ready")
    dep = deployment(cluster, f"{name}-mixed")
    assert dep["spec"]["replicas"] == 3 and replicas_owners(dep) == {FIELD_MANAGER}
    since = dep["metadata"]["resourceVersion"]

    body["spec"]["roles"]["mixed"]["autoscaling"] = {
        "mode": mode,
        "minReplicas": 1,
        "maxReplicas": 6,
    }
    cluster.apply(body)
    wait_for(
        lambda: (b := ready(cluster, name)) and b["status"]["observedGeneration"] == 2 and b,
        "the autoscaled generation applied",
    )
    dep = deployment(cluster, f"{name}-mixed")
    assert dep["spec"]["replicas"] == 3
    assert replicas_owners(dep) == {HANDOFF_FIELD_MANAGER}  # no longer the operator's apply
    if kube.is_emulator:  # every version in between, not only the last
        path = f"/apis/apps/v1/namespaces/{ns}/deployments"
        counts = [d["spec"]["replicas"] for d in history(kube, path, since, f"{name}-mixed")]
        assert counts and min(counts) >= 3, counts

    # the autoscaler acts (as the HPA controller does, through the scale subresource) ...
    cluster.run("scale", "deployment", f"{name}-mixed", "--replicas=4")
    dep = wait_for(
        lambda: (
            (d := deployment(cluster, f"{name}-mixed"))
            and HANDOFF_FIELD_MANAGER not in replicas_owners(d)
            and d
        ),
        "the hand-over manager to lose the field",
    )
    assert dep["spec"]["replicas"] == 4
    # ... and a later generation leaves its count alone
    merge_patch(cluster, name, {"spec": {"engine": {"maxNumSeqs": 9}}})
    wait_for(
        lambda: (b := ready(cluster, name)) and b["status"]["observedGeneration"] == 3,
        "generation 3 applied",
    )
    assert deployment(cluster, f"{name}-mixed")["spec"]["replicas"] == 4

    # back to fixed replicas: the operator takes the field again
    del body["spec"]["roles"]["mixed"]["autoscaling"]
    body["spec"]["roles"]["mixed"]["replicas"] = 2
    body["spec"]["engine"] = {**body["spec"].get("engine", {}), "maxNumSeqs": 9}
    cluster.apply(body)
    dep = wait_for(
        lambda: (d := deployment(cluster, f"{name}-mixed")) and d["spec"]["replicas"] == 2 and d,
        "fixed replicas again",
    )
    assert FIELD_MANAGER in replicas_owners(dep)


def test_new_autoscaled_role_starts_at_min_replicas(cluster, operators, tmp_path):
    """A Deployment born autoscaled is created with its autoscaler's minReplicas, never the
    API server's default of 1; the count is then handed over like any other."""
    kube, ns = cluster.kube, cluster.namespace
    operators.append(Operator(kube, [ns], tmp_path / "operator.log"))
    name = "born-scaled"
    body = cpu_example(name)
    body["spec"]["roles"]["mixed"].pop("replicas", None)
    body["spec"]["roles"]["mixed"]["autoscaling"] = {
        "mode": "hpa",
        "minReplicas": 2,
        "maxReplicas": 4,
    }
    since = list_version(kube, f"/apis/apps/v1/namespaces/{ns}/deployments")
    cluster.apply(body)
    wait_for(lambda: ready(cluster, name), f"{name} Ready")
    if kube.is_emulator:
        path = f"/apis/apps/v1/namespaces/{ns}/deployments"
        counts = [d["spec"]["replicas"] for d in history(kube, path, since, f"{name}-mixed")]
        assert counts and min(counts) == 2, counts
    # A later generation (applied without replicas) hands the count over; it stays 2.
    merge_patch(cluster, name, {"spec": {"engine": {"maxNumSeqs": 9}}})
    wait_for(
        lambda: (b := ready(cluster, name)) and b["status"]["observedGeneration"] == 2,
        "generation 2 applied",
    )
    dep = deployment(cluster, f"{name}-mixed")
    assert dep["spec"]["replicas"] == 2
    assert FIELD_MANAGER not in replicas_owners(dep)
