"""What a cluster does to an operator every day: `ketch-operator run` as a process, against the
test run's control plane (tests/kubecluster.py), signed in as its ServiceAccount.

- SIGKILL in the middle of a reconcile (a proxy between the operator and kube-apiserver,
  tests/apiproxy.py, holds the operator's apply of the Deployment, so the kill lands between
  two children), then a restart: the children converge, nothing is duplicated, and Ready never
  goes True -> False -> True without a spec change (every version of the object is recorded
  by a watch as it happens);
- every watch expired: kube-apiserver restarted, so each watch ends and resuming it from its
  last resourceVersion gets 410 Gone (as after etcd compaction): the operator lists again
  (counted in the API server's audit log) and reconciles what changes after it;
- cluster-wide (no --namespace): two InferenceServices of one name in two namespaces are
  reconciled independently, and deleting one leaves the other;
- a role switched from fixed replicas to autoscaling keeps its replica count: the Deployment
  never drops below it (server-side apply hand-over, operator/ketch/operator/children/handoff.py).

Every test deletes what it made (engine pods hold about 1 GB each) and waits for its pods to go.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import operator_rbac
import pytest
from apiproxy import HoldingProxy
from test_e2e import Cluster, condition, cpu_example, fresh_namespace, ready, wait_for

from ketch.operator import api_names
from ketch.operator.managers import FIELD_MANAGER, HANDOFF_FIELD_MANAGER
from kubecluster import ApiResponse, KubeCluster, stream_events
from localcluster.kubeapi import ApiError
from procs import free_ports

EXE = str(Path(sys.executable).parent / "ketch-operator")
OWNED_KINDS = ("configmaps", "services", "deployments", "poddisruptionbudgets", "networkpolicies")
ISVC_PATH = f"/apis/{api_names.GROUP}/{api_names.VERSION}/namespaces/{{ns}}/{api_names.PLURAL}"
ROLLOUT = 300  # s: engine pods take 10-20 s each to turn Ready, more on a busy machine


class Operator:
    """`ketch-operator run --standalone` as a process, signed in as its ServiceAccount with the
    manifests' RBAC: the single-namespace overlay for the namespaces given, or cluster-wide;
    through ``proxy`` when given."""

    def __init__(
        self, kube: Any, namespaces: list[str], log: Path, proxy: HoldingProxy | None = None
    ):
        (self.metrics_port,) = free_ports(1)
        self.log = log
        kubeconfig = operator_rbac.install(
            kube,
            namespaces[0] if namespaces else "default",
            log.with_suffix(".rbac"),
            cluster_wide=not namespaces,
        )
        if proxy is not None:
            kubeconfig = proxy.route(kubeconfig)
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
        assert self.proc.poll() is None, f"the operator exited:\n{self.output()[-3000:]}"
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/healthz"
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def metric(self, line_start: str) -> float:
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


# --------------------------------------------------------------------------- fixtures


def cleaned_up(c: Cluster) -> None:
    """Deletes the namespace's InferenceServices and waits until their pods are gone (the
    garbage collector deletes the children), so that the next test has the memory."""
    c.run("delete", api_names.PLURAL, "--all", "--wait=true", "--timeout=60s", check=False)
    c.run("wait", "--for=delete", "pods", "--all", "--timeout=180s", check=False)


@pytest.fixture
def namespaces(kube: KubeCluster) -> Iterator[Callable[[str], Cluster]]:
    """``make(prefix)``: a fresh namespace (test_e2e.fresh_namespace); at the end of the test
    what was made in each is deleted, then the namespace."""
    made: list[Cluster] = []
    with contextlib.ExitStack() as namespaces:

        def make(prefix: str) -> Cluster:
            made.append(namespaces.enter_context(fresh_namespace(kube, prefix)))
            return made[-1]

        yield make
        for c in made:
            cleaned_up(c)


@pytest.fixture
def cluster(namespaces: Callable[[str], Cluster]) -> Cluster:
    return namespaces("life")


@pytest.fixture
def operators() -> Iterator[list[Operator]]:
    """Operators a test starts; any still running at the end are stopped."""
    started: list[Operator] = []
    yield started
    for op in started:
        if op.proc.poll() is None:
            op.stop(signal.SIGKILL)


@pytest.fixture
def proxy(kube: KubeCluster, tmp_path: Path) -> Iterator[HoldingProxy]:
    with HoldingProxy.for_cluster(kube.kubeconfig, tmp_path / "proxy") as p:
        yield p


def served(call: Callable[[], ApiResponse]) -> ApiResponse:
    """``call()`` again while the API server answers 429 "storage is (re)initializing" (a
    resource's watch cache starting: after a restart, or for a new CRD), as kubectl retries."""
    return wait_for(lambda: (r := call()).status != 429 and r, "the API server to serve it")


def watched(kube: KubeCluster, path: str, params: dict[str, Any]) -> ApiResponse:
    """The events of one bounded watch; or the API server's refusal."""
    try:
        return ApiResponse(200, list(kube.watch(path, params)))
    except ApiError as exc:
        return ApiResponse(exc.status, exc.body)


class Versions:
    """Every version of one object from now on, recorded by a watch as it happens: the API
    server serves old versions only while its watch cache still holds them."""

    def __init__(self, kube: KubeCluster, path: str, name: str):
        self.kube, self.path, self.name = kube, path, name
        self.selector = f"metadata.name={name}"
        listed = served(lambda: kube.get(path, params={"fieldSelector": self.selector})).ok()
        self.seen: list[dict[str, Any]] = list(listed["items"])
        self.error: BaseException | None = None
        self.stopped = threading.Event()
        since = listed["metadata"]["resourceVersion"]
        self.thread = threading.Thread(target=self._watch, args=(since,), daemon=True)
        self.thread.start()

    def _watch(self, since: str) -> None:
        try:
            while not self.stopped.is_set():
                params = {
                    "resourceVersion": since,
                    "fieldSelector": self.selector,
                    "allowWatchBookmarks": "true",
                    "timeoutSeconds": 5,
                }
                try:
                    for event in stream_events(self.kube, self.path, params):
                        assert event["type"] != "ERROR", f"the recording watch failed: {event}"
                        since = event["object"]["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self.seen.append(event["object"])
                except ApiError as exc:
                    if exc.status != 429:
                        raise
                    self.stopped.wait(1)  # the storage initializing: Retry-After is 1 s
        except BaseException as exc:
            self.error = exc

    def all(self) -> list[dict[str, Any]]:
        """Every version up to the object's current one (once the watch has seen it)."""
        current = self.kube.get(f"{self.path}/{self.name}").ok()["metadata"]["resourceVersion"]
        try:
            wait_for(
                lambda: (
                    self.error
                    or any(v["metadata"]["resourceVersion"] == current for v in self.seen)
                ),
                f"the watch recording {self.name} to see version {current}",
                timeout=60,
            )
        finally:
            self.stop()
        if self.error is not None:
            raise self.error
        return list(self.seen)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=30)


@pytest.fixture
def record(kube: KubeCluster) -> Iterator[Callable[[str, str], Versions]]:
    """``record(path, name)``: a Versions recorder of the object ``name`` at ``path``."""
    made: list[Versions] = []

    def start(path: str, name: str) -> Versions:
        made.append(Versions(kube, path, name))
        return made[-1]

    yield start
    for versions in made:
        versions.stop()


def owned(cluster: Cluster, namespace: str) -> Counter[tuple[str, str, str]]:
    """(kind, owner kind, owner name) of every object in ``namespace`` with an owner."""
    out: Counter[tuple[str, str, str]] = Counter()
    for kind in (*OWNED_KINDS, "replicasets", "pods", "horizontalpodautoscalers"):
        result = cluster.run("get", kind, "-n", namespace, "-o", "json", ns=False)
        for item in json.loads(result.stdout)["items"]:
            for ref in item["metadata"].get("ownerReferences") or []:
                out[(item["kind"], ref["kind"], ref["name"])] += 1
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
    cluster.run("patch", api_names.PLURAL, name, "--type", "merge", "-p", json.dumps(patch))


# --------------------------------------------------------------------------- the proxy


def test_the_holding_proxy_forwards_streams_and_holds(cluster, proxy, tmp_path):
    """The proxy itself, with the real kubectl as its client: requests reach the API server as
    the token's identity, a watch streams, a held request waits, one whose client went away
    is never sent, and a released one is."""
    kube, ns = cluster.kube, cluster.namespace
    kubeconfig = proxy.route(operator_rbac.install(kube, ns, tmp_path / "rbac"))
    kubectl = ["kubectl", "--kubeconfig", str(kubeconfig), "--cache-dir", str(tmp_path / "c")]
    kubectl += ["-n", ns]
    got = subprocess.run([*kubectl, "get", "configmaps", "-o", "name"], capture_output=True)
    assert got.returncode == 0 and b"configmap/kube-root-ca.crt" in got.stdout, got

    watch = subprocess.Popen(
        [*kubectl, "get", "configmaps", "--watch", "-o", "name", "--request-timeout=60s"],
        stdout=subprocess.PIPE,
    )
    try:
        assert watch.stdout is not None
        assert watch.stdout.readline() == b"configmap/kube-root-ca.crt\n"  # listed
        cluster.run("create", "configmap", "streamed")
        assert watch.stdout.readline() == b"configmap/streamed\n"  # the watch's event
    finally:
        watch.kill()
        watch.wait()

    proxy.hold(verb="create", resource="configmaps", namespace=ns)
    dropped = subprocess.Popen([*kubectl, "create", "configmap", "dropped"])
    wait_for(lambda: proxy.holds()[0]["waiting"] == 1, "kubectl's create held")
    dropped.kill()
    dropped.wait()
    wait_for(lambda: proxy.holds()[0]["waiting"] == 0, "the held create gone with its client")
    released = subprocess.Popen([*kubectl, "create", "configmap", "released"])
    wait_for(lambda: proxy.holds()[0]["waiting"] == 1, "the second create held")
    assert proxy.holds()[0]["caught"] == 2
    assert cluster.get("configmap", "released") is None
    proxy.release()
    assert released.wait(timeout=60) == 0
    assert cluster.get("configmap", "released") is not None
    assert cluster.get("configmap", "dropped") is None
    creates = kube.requests(since_mark=False, verb="create", resource="configmaps", namespace=ns)
    by_proxy = [e for e in creates if e["user"]["username"] == operator_rbac.USER]
    assert [e["requestObject"]["metadata"]["name"] for e in by_proxy] == ["released"]
    assert by_proxy[0]["userAgent"].startswith("kubectl")


# --------------------------------------------------------------------------- SIGKILL


def test_sigkill_mid_reconcile_then_restart(cluster, proxy, operators, record, tmp_path):
    kube, ns = cluster.kube, cluster.namespace
    path = ISVC_PATH.format(ns=ns)
    versions = record(path, "crash")
    operators.append(Operator(kube, [ns], tmp_path / "first.log", proxy))
    proxy.hold(verb="apply", resource="deployments", namespace=ns)
    try:
        cluster.apply(cpu_example("crash"))
        wait_for(lambda: proxy.holds()[0]["waiting"] == 1, "the operator's Deployment apply")
        mid = set(owned(cluster, ns))
        assert ("ConfigMap", "InferenceService", "crash") in mid  # applied before the kill
        assert ("Deployment", "InferenceService", "crash") not in mid
        assert operators[0].stop(signal.SIGKILL) == -signal.SIGKILL
        wait_for(lambda: proxy.holds()[0]["waiting"] == 0, "the killed operator's apply dropped")
    finally:
        proxy.release()
    assert cluster.get("deployment", "crash-mixed") is None  # the apply in flight never landed

    second = Operator(kube, [ns], tmp_path / "second.log", proxy)
    operators.append(second)
    wait_for(lambda: ready(cluster, "crash"), "crash Ready after the restart", timeout=ROLLOUT)
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
    proxy.hold(verb="list", resource="deployments", namespace=ns)
    try:
        third = Operator(kube, [ns], tmp_path / "third.log", proxy)
        operators.append(third)
        wait_for(lambda: proxy.holds()[0]["waiting"] == 1, "the Deployment list held")
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
        assert proxy.holds()[0]["waiting"] == 1  # all of it without the Deployment watch
    finally:
        proxy.release()
    wait_for(lambda: ready(cluster, "crash"), "crash still Ready")
    assert owned(cluster, ns) == counts
    seen = versions.all()
    assert ready_flaps(seen) == []
    statuses = [condition(b, "Ready").get("status") for b in seen]
    assert statuses[-1] == "True"
    assert "False" not in statuses[statuses.index("True") :], statuses
    assert third.stop() == 0, third.output()


# --------------------------------------------------------------------------- 410 Gone


def test_watch_expiry_then_the_operator_resumes(cluster, operators, tmp_path):
    kube, ns = cluster.kube, cluster.namespace
    op = Operator(kube, [ns], tmp_path / "operator.log")
    operators.append(op)
    cluster.apply(cpu_example("expiry"))
    wait_for(lambda: ready(cluster, "expiry"), "expiry Ready", timeout=ROLLOUT)
    path = f"/api/v1/namespaces/{ns}/configmaps"
    old = kube.get(path).ok()["metadata"]["resourceVersion"]
    cluster.run("create", "configmap", "after-the-list")  # a version newer than `old`
    kube.mark()

    # every watch ends; resuming one from its last version gets 410 Gone, as kopf's do
    kube.restart_apiserver()
    gone = served(lambda: watched(kube, path, {"resourceVersion": old, "timeoutSeconds": 1})).ok()
    assert [(e["type"], e["object"].get("code")) for e in gone] == [("ERROR", 410)], gone
    # kopf lists again: the InferenceServices and each child kind
    wait_for(
        lambda: (
            len(kube.requests(user_agent="kopf", verb="list", namespace=ns)) >= 1 + len(OWNED_KINDS)
        ),
        "kopf to list again after the 410s",
    )

    # a spec change made after the 410 is reconciled
    merge_patch(cluster, "expiry", {"spec": {"engine": {"maxNumSeqs": 7}}})
    body = wait_for(
        lambda: (b := ready(cluster, "expiry")) and b["metadata"]["generation"] == 2 and b,
        "generation 2 reconciled after the 410",
        timeout=ROLLOUT,
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


@pytest.fixture
def cluster_wide_rbac(kube: KubeCluster) -> Iterator[None]:
    """The cluster-wide overlay's ClusterRole and its binding are removed after the test: left,
    they would widen what every later test's operator (the same ServiceAccount) may do."""
    yield
    with tempfile.TemporaryDirectory() as tmp:
        docs = operator_rbac.overlay_for(None, Path(tmp))
    for doc in docs:
        if doc["kind"] in ("ClusterRoleBinding", "ClusterRole"):
            name = f"{doc['kind'].lower()}/{doc['metadata']['name']}"
            operator_rbac.kubectl(str(kube.kubeconfig), "delete", name, "--ignore-not-found")


def test_cluster_wide_same_name_in_two_namespaces(
    namespaces, cluster_wide_rbac, operators, tmp_path
):
    # The operator sees every InferenceService of the cluster (other modules' too): what is
    # checked is only in these two namespaces.
    east, west = namespaces("east"), namespaces("west")
    operators.append(Operator(east.kube, [], tmp_path / "operator.log"))
    for c, replicas in ((east, 1), (west, 2)):
        body = cpu_example("twin")
        body["spec"]["roles"]["mixed"]["replicas"] = replicas
        c.apply(body)
    got = {
        c.namespace: wait_for(
            lambda c=c: ready(c, "twin"), f"twin Ready in {c.namespace}", timeout=ROLLOUT
        )
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

    east.run("delete", api_names.PLURAL, "twin", "--wait=true")
    wait_for(lambda: not east.items("deployments", "app.kubernetes.io/instance=twin"), "GC")
    assert ready(west, "twin")
    west_owned = owned(west, west.namespace)
    assert west_owned[("Deployment", "InferenceService", "twin")] == 1
    # the survivor is still reconciled: a change to it is applied, in its namespace only
    merge_patch(west, "twin", {"spec": {"roles": {"mixed": {"replicas": 3}}}})
    wait_for(
        lambda: (b := ready(west, "twin")) and b["status"]["replicas"] == "3/3",
        "west twin at 3 replicas",
        timeout=ROLLOUT,
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
def test_fixed_to_autoscaled_keeps_the_replica_count(cluster, operators, record, tmp_path, mode):
    kube, ns = cluster.kube, cluster.namespace
    operators.append(Operator(kube, [ns], tmp_path / "operator.log"))
    name = f"scale-{mode}"
    body = cpu_example(name)
    body["spec"]["roles"]["mixed"]["replicas"] = 3
    cluster.apply(body)
    wait_for(lambda: ready(cluster, name), f"{name} Ready", timeout=ROLLOUT)
    dep = deployment(cluster, f"{name}-mixed")
    assert dep["spec"]["replicas"] == 3 and replicas_owners(dep) == {FIELD_MANAGER}
    versions = record(f"/apis/apps/v1/namespaces/{ns}/deployments", f"{name}-mixed")

    body["spec"]["roles"]["mixed"]["autoscaling"] = {
        "mode": mode,
        "minReplicas": 1,
        "maxReplicas": 6,
    }
    if mode == "ketch":
        # Idle engines ask for minReplicas at once (the first decision has no history to
        # stabilise on): advisory, the coordinated autoscaler records its decisions without
        # applying them, so that what is seen is the hand-over alone (as in mode hpa, whose HPA
        # has no custom metrics API to read here). The test scales as the autoscaler would.
        body["spec"]["autoscaling"] = {"advisory": True}
    cluster.apply(body)
    wait_for(
        lambda: (b := ready(cluster, name)) and b["status"]["observedGeneration"] == 2 and b,
        "the autoscaled generation applied",
        timeout=ROLLOUT,
    )
    dep = deployment(cluster, f"{name}-mixed")
    assert dep["spec"]["replicas"] == 3
    assert replicas_owners(dep) == {HANDOFF_FIELD_MANAGER}  # no longer the operator's apply
    counts = [d["spec"]["replicas"] for d in versions.all()]  # every version, not the last
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
        timeout=ROLLOUT,
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


def test_new_autoscaled_role_starts_at_min_replicas(cluster, operators, record, tmp_path):
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
    versions = record(f"/apis/apps/v1/namespaces/{ns}/deployments", f"{name}-mixed")
    cluster.apply(body)
    wait_for(lambda: ready(cluster, name), f"{name} Ready", timeout=ROLLOUT)
    counts = [d["spec"]["replicas"] for d in versions.all()]  # from its creation on
    assert counts and min(counts) == 2, counts
    # A later generation (applied without replicas) hands the count over; it stays 2.
    merge_patch(cluster, name, {"spec": {"engine": {"maxNumSeqs": 9}}})
    wait_for(
        lambda: (b := ready(cluster, name)) and b["status"]["observedGeneration"] == 2,
        "generation 2 applied",
        timeout=ROLLOUT,
    )
    dep = deployment(cluster, f"{name}-mixed")
    assert dep["spec"]["replicas"] == 2
    assert FIELD_MANAGER not in replicas_owners(dep)
