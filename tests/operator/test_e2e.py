"""End to end: the operator running for real (kopf's KopfRunner) against the test run's
Kubernetes control plane (tests/kubecluster.py: kube-apiserver, controller-manager, scheduler,
etcd and the node agent running the engine pods as processes), or the cluster
KETCH_TEST_KUBECONFIG names. The tests talk to it through the real ``kubectl``, as a user
would; faults are real ones (a flag the engine refuses, an image no node has, a pod no node can
hold), and what the operator applied is read from the API server's audit log.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import logging
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import operator_rbac
import pytest
import yaml
from test_builders import INVALID, invalid_body

import procs
from ketch.operator import api_names
from ketch.operator.cli import render_documents, render_object
from ketch.operator.controller import Controller
from ketch.operator.crd.engine import DEFAULT_IMAGE
from ketch.operator.handlers import make_registry
from ketch.operator.labels import ANNOTATION_CONFIG_HASH, MANAGER
from ketch.operator.workqueue import Work

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / f"{api_names.CRD_NAME}.yaml"
PSA_ENFORCE = "pod-security.kubernetes.io/enforce"


# --------------------------------------------------------------------------- helpers


class Cluster:
    """kubectl against the test API server, in one namespace."""

    def __init__(self, kube: Any, namespace: str):
        self.kube = kube
        self.namespace = namespace

    def run(self, *args: str, input: str | None = None, check: bool = True, ns: bool = True):
        cmd = ["kubectl", "--kubeconfig", str(self.kube.kubeconfig)]
        if ns:
            cmd += ["-n", self.namespace]
        result = subprocess.run(
            [*cmd, *args], input=input, capture_output=True, text=True, timeout=60
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def apply(self, body: dict[str, Any], *extra: str, check: bool = True):
        return self.run("apply", "-f", "-", *extra, input=yaml.safe_dump(body), check=check)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        result = self.run("get", kind, name, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise AssertionError(result.stderr)
        return json.loads(result.stdout)

    def items(self, kind: str, selector: str) -> list[dict[str, Any]]:
        result = self.run("get", kind, "-l", selector, "-o", "json")
        return json.loads(result.stdout)["items"]

    def ready_pods(self, instance: str, role: str) -> list[dict[str, Any]]:
        """The pods of an InferenceService's role whose Ready condition is True."""
        selector = f"app.kubernetes.io/instance={instance},serving.ketch.dev/role={role}"
        pods = self.items("pods", selector)
        return [
            p
            for p in pods
            if any(
                x["type"] == "Ready" and x["status"] == "True"
                for x in (p.get("status") or {}).get("conditions") or []
            )
        ]


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    """Polls until ``predicate`` is truthy; 120 s by default: a rollout of real engine pods
    (10-20 s each to turn Ready on a busy 2-core machine) fits with room."""
    return procs.wait_for(predicate, timeout, what, interval=0.2)


def condition(body: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((body or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return {}


def example(name: str, new_name: str) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    body["metadata"]["name"] = new_name
    return body


def cpu_example(name: str) -> dict[str, Any]:
    """examples/mixed.yaml under another name (CPU pods, 2 replicas)."""
    return example("mixed", name)


CHILD_KINDS = ("configmaps", "services", "deployments", "poddisruptionbudgets", "networkpolicies")


def children(cluster: Cluster, name: str) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for kind in CHILD_KINDS:
        for item in cluster.items(kind, f"app.kubernetes.io/instance={name}"):
            out[(item["kind"], item["metadata"]["name"])] = item
    return out


def ready(cluster: Cluster, name: str) -> dict[str, Any] | None:
    body = cluster.get(api_names.PLURAL, name)
    gen = (body or {}).get("metadata", {}).get("generation")
    if (
        condition(body, "Ready").get("status") == "True"
        and body["status"].get("observedGeneration") == gen
    ):
        return body
    return None


# --------------------------------------------------------------------------- fixtures


@contextlib.contextmanager
def fresh_namespace(kube: Any, prefix: str) -> Iterator[Cluster]:
    """The CRD applied and a new namespace for one test module (deleted afterwards), which
    enforces the restricted Pod Security Standard."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:8]}"
    c = Cluster(kube, namespace)
    c.run("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE), ns=False)
    namespace_body = {  # engine pods must meet the restricted Pod Security Standard
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": namespace, "labels": {PSA_ENFORCE: "restricted"}},
    }
    c.run("apply", "-f", "-", ns=False, input=yaml.safe_dump(namespace_body))
    yield c
    c.run("delete", "namespace", namespace, "--wait=false", ns=False, check=False)


@pytest.fixture(scope="module")
def cluster(kube) -> Iterator[Cluster]:
    with fresh_namespace(kube, "e2e") as c:
        yield c


@pytest.fixture(autouse=True)
def _delete_what_the_test_made(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every InferenceService a test of this module made is deleted after it (engine pods hold
    about 1 GB each; the garbage collector removes their children)."""
    yield
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        c.run("delete", api_names.PLURAL, "--all", "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory) -> Iterator[Controller]:
    """The operator signed in as its ServiceAccount, with the manifests' RBAC and nothing more
    (operator_rbac.py): what it cannot do installed, it cannot do here."""
    workdir = tmp_path_factory.mktemp("operator")
    kubeconfig = operator_rbac.install(cluster.kube, cluster.namespace, workdir)
    refusals = operator_rbac.Refusals()
    with refusals.watching(), running_operator(cluster, kubeconfig) as controller:
        yield controller
    assert not refusals.messages, (
        "the API refused the operator (is a verb missing from the RBAC?)\n"
        + ("\n".join(refusals.messages))
    )


@contextlib.contextmanager
def running_operator(
    cluster: Cluster,
    kubeconfig: Path | str,
    scope: list[str] | None = None,
    metrics: tuple[str, int] | None = None,
) -> Iterator[Controller]:
    """The operator (kopf's KopfRunner) serving the cluster's namespace (or `scope`, kopf's
    arguments), signed in with `kubeconfig`; yields its controller once it has started.
    `metrics`: (host, port) of its /metrics and /healthz server (none by default)."""
    from kopf.testing import KopfRunner

    controllers: list[Controller] = []
    registry = make_registry(
        resync_seconds=0,
        on_controller=controllers.append,
        **({"metrics_host": metrics[0], "metrics_port": metrics[1]} if metrics else {}),
    )
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    # kopf's CLI gives the root logger a handler on click's captured stream, which is closed
    # when the runner ends; later KopfRunners in this session would log into a closed file.
    root_handlers = list(logging.getLogger().handlers)
    try:
        with KopfRunner(
            ["run", "--standalone", *(scope or ["--namespace", cluster.namespace])],
            registry=registry,
            timeout=30,
        ) as runner:
            wait_for(lambda: controllers, "the operator to start")
            yield controllers[0]
        assert runner.exit_code == 0, runner.output
    finally:
        logging.getLogger().handlers[:] = root_handlers
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous


def settle(controller: Controller) -> None:
    """Waits until the operator has no queued or running work twice in a row."""
    for _ in range(2):
        time.sleep(0.3)
        deadline = time.monotonic() + 30
        while controller.busy:
            assert time.monotonic() < deadline, "operator did not settle"
            time.sleep(0.05)


# --------------------------------------------------------------------------- tests


def test_create_gives_children_with_owners_and_ready_status(cluster, operator):
    cluster.apply(cpu_example("alpha"))
    body = wait_for(lambda: ready(cluster, "alpha"), "alpha Ready")
    uid = body["metadata"]["uid"]
    kids = children(cluster, "alpha")
    assert set(kids) == {
        ("ConfigMap", "alpha-config"),
        ("NetworkPolicy", "alpha"),
        ("Service", "alpha-mixed"),
        ("Service", "alpha-mixed-peers"),
        ("PodDisruptionBudget", "alpha-mixed"),
        ("Deployment", "alpha-mixed"),
    }
    for child in kids.values():
        owners = child["metadata"]["ownerReferences"]
        assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [
            ("InferenceService", "alpha", uid)
        ]
    status = body["status"]
    assert status["mode"] == "mixed"
    assert status["replicas"] == "2/2"
    assert status["url"] == f"http://alpha-mixed.{cluster.namespace}.svc.cluster.local:8000"
    assert condition(body, "Degraded")["status"] == "False"
    assert "spec" in body and "kopf" not in json.dumps(body["metadata"])  # nothing of ours in it
    events = cluster.run("get", "events", "-o", "json").stdout
    reasons = {
        e["reason"] for e in json.loads(events)["items"] if e["involvedObject"]["name"] == "alpha"
    }
    assert {"Reconciled", "Ready"} <= reasons


def test_render_is_byte_identical_to_what_the_operator_applied(cluster, operator):
    names = {"mixed": "render-m", "disaggregated": "render-d", "autoscaled": "render-a"}
    for example_name, name in names.items():
        cluster.apply(example(example_name, name))
    for name in names.values():
        wait_for(lambda n=name: cluster.get(api_names.PLURAL, n), f"{name} created")
        wait_for(lambda n=name: len(children(cluster, n)) >= 6, f"{name} children")
    settle(operator)
    applied: dict[tuple[str, str], Any] = {}
    for entry in cluster.kube.applied(manager=MANAGER):
        if entry["namespace"] == cluster.namespace:
            applied[(entry["kind"], entry["name"])] = entry["body"]
    for example_name, name in names.items():
        live = cluster.get(api_names.PLURAL, name)
        source = example(example_name, name)
        rendered = subprocess.run(
            [
                str(Path(os.sys.executable).parent / "ketch-operator"),
                "render",
                "-",
                "--namespace",
                cluster.namespace,
                "--owner-uid",
                live["metadata"]["uid"],
            ],
            input=yaml.safe_dump(source),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        kids = render_object(source, namespace=cluster.namespace, owner_uid=live["metadata"]["uid"])
        operator_applied = [applied[(c["kind"], c["metadata"]["name"])] for c in kids]
        operator_applied = [
            _without_birth_replicas(child, body)
            for child, body in zip(kids, operator_applied, strict=True)
        ]
        assert rendered == render_documents(operator_applied)


def _without_birth_replicas(child: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """``body`` less the replica count an autoscaled role's Deployment is created with (its
    minReplicas, instead of the API server's default 1); render shows the steady state, which
    leaves replicas to the autoscaler."""
    if (
        child["kind"] != "Deployment"
        or "replicas" in child["spec"]
        or "replicas" not in body["spec"]
    ):
        return body
    trimmed = copy.deepcopy(body)
    del trimmed["spec"]["replicas"]
    return trimmed


def test_spec_change_rolls_pods_and_is_observed(cluster, operator):
    cluster.apply(cpu_example("beta"))
    before = wait_for(lambda: ready(cluster, "beta"), "beta Ready")
    dep = cluster.get("deployments", "beta-mixed")
    old_hash = dep["spec"]["template"]["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
    cluster.run(
        "patch",
        api_names.PLURAL,
        "beta",
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"engine": {"maxNumSeqs": 8}}}),
    )
    after = wait_for(
        lambda: (
            (b := ready(cluster, "beta"))
            and b["metadata"]["generation"] > before["metadata"]["generation"]
            and b
        ),
        "beta Ready at the new generation",
    )
    assert after["status"]["observedGeneration"] == after["metadata"]["generation"]
    dep = cluster.get("deployments", "beta-mixed")
    new_hash = dep["spec"]["template"]["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
    assert new_hash != old_hash
    config = cluster.get("configmaps", "beta-config")["data"]["mixed.yaml"]
    assert yaml.safe_load(config)["max_num_seqs"] == 8
    # Ready means the rollout is complete (as kubectl rollout status decides): every pod that
    # is not terminating carries the new template, on the emulator as on a cluster
    pods = cluster.items("pods", "app.kubernetes.io/instance=beta")
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    assert len(live) == 2 and all(
        p["metadata"]["annotations"][ANNOTATION_CONFIG_HASH] == new_hash for p in live
    )


def test_children_edited_or_deleted_by_hand_are_put_back(cluster, operator):
    cluster.apply(cpu_example("gamma"))
    wait_for(lambda: ready(cluster, "gamma"), "gamma Ready")
    svc_uid = cluster.get("services", "gamma-mixed")["metadata"]["uid"]
    cluster.run("delete", "service", "gamma-mixed")
    restored = wait_for(
        lambda: (
            (s := cluster.get("services", "gamma-mixed")) and s["metadata"]["uid"] != svc_uid and s
        ),
        "the deleted Service to come back",
    )
    assert restored["spec"]["ports"][0]["port"] == 8000
    cluster.run("set", "image", "deployment/gamma-mixed", "engine=evil:latest")
    wait_for(
        lambda: (
            cluster.get("deployments", "gamma-mixed")["spec"]["template"]["spec"]["containers"][0][
                "image"
            ]
            == DEFAULT_IMAGE
        ),
        "the edited image to be put back",
    )
    cluster.run(
        "patch",
        "configmap",
        "gamma-config",
        "--type",
        "merge",
        "-p",
        json.dumps({"data": {"mixed.yaml": "port: 1\n"}}),
    )
    wait_for(
        lambda: "port: 8000" in cluster.get("configmaps", "gamma-config")["data"]["mixed.yaml"],
        "the edited ConfigMap to be put back",
    )
    # a field the operator does not manage is left alone (another manager owns it)
    cluster.run("annotate", "service", "gamma-mixed", "team=search")
    settle(operator)
    assert cluster.get("services", "gamma-mixed")["metadata"]["annotations"]["team"] == "search"


def test_applying_the_same_object_twice_changes_no_child(cluster, operator):
    body = cpu_example("delta")
    cluster.apply(body)
    wait_for(lambda: ready(cluster, "delta"), "delta Ready")
    settle(operator)
    before = {k: v["metadata"]["resourceVersion"] for k, v in children(cluster, "delta").items()}
    isvc_rv = cluster.get(api_names.PLURAL, "delta")["metadata"]["resourceVersion"]
    cluster.apply(body)  # kubectl apply, unchanged: the object does not change at all
    assert cluster.get(api_names.PLURAL, "delta")["metadata"]["resourceVersion"] == isvc_rv
    # GitOps tools apply server-side; switching field managers changes managedFields (a new
    # resourceVersion) but no spec field: the operator must not touch any child.
    cluster.apply(body, "--server-side", "--force-conflicts", "--field-manager", "argocd")
    isvc_rv = cluster.get(api_names.PLURAL, "delta")["metadata"]["resourceVersion"]
    cluster.apply(body, "--server-side", "--force-conflicts", "--field-manager", "argocd")
    # and a full reconcile, as after an operator restart or a resync
    operator.loop.call_soon_threadsafe(
        operator.enqueue, (cluster.namespace, "delta"), Work(full=True, status=True)
    )
    settle(operator)
    after = {k: v["metadata"]["resourceVersion"] for k, v in children(cluster, "delta").items()}
    assert after == before
    assert cluster.get(api_names.PLURAL, "delta")["metadata"]["resourceVersion"] == isvc_rv


# Real faults, each made by the spec: a flag the engine refuses (it exits, the node agent
# restarts it with back-off), an image no node has, and more memory than any node offers.
FAULTS = {
    "crashloop": ("CrashLoop", {"engine": {"extraArgs": ["--no-such-flag"]}}),
    "unschedulable": (
        "InsufficientCapacity",
        {"roles": {"mixed": {"resources": {"memory": "900Gi"}}}},
    ),
    "imagepull": ("ImagePullError", {"engine": {"image": "registry.invalid/ketch/none:1"}}),
}


@pytest.mark.parametrize("mode", list(FAULTS))
def test_pod_problems_degrade_with_a_reason(cluster, operator, mode):
    reason, fault = FAULTS[mode]
    name = f"fault-{mode}"
    good = cpu_example(name)
    good["spec"]["roles"]["mixed"]["replicas"] = 1
    cluster.apply(merge(good, {"spec": fault}))
    # The pod's status says why before the Deployment's counts catch up (the ReplicaSet and
    # Deployment controllers sync after the kubelet), so wait for both.
    body = wait_for(
        lambda: (
            (b := cluster.get(api_names.PLURAL, name))
            and condition(b, "Degraded").get("reason") == reason
            and condition(b, "Ready").get("status") == "False"
            and b
        ),
        f"Degraded/{reason} and Ready False",
        timeout=120,
    )
    assert condition(body, "Degraded")["status"] == "True"
    if mode == "crashloop":  # the status says where to look, and kubectl logs shows why
        message = condition(body, "Degraded")["message"]
        assert "kubectl logs" in message and "--previous" in message, message
        pod = message.split("pod ", 1)[1].split()[0]
        logs = cluster.run("logs", pod, "-c", "engine", "--previous")
        assert "--no-such-flag" in logs.stdout, logs.stdout[-2000:]
    warnings = json.loads(cluster.run("get", "events", "-o", "json").stdout)["items"]
    assert any(
        e["reason"] == reason and e["type"] == "Warning" and e["involvedObject"]["name"] == name
        for e in warnings
    )
    cluster.apply(good)  # the fault fixed: a new ReplicaSet whose pods turn Ready
    wait_for(lambda: ready(cluster, name), f"{name} Ready again", timeout=120)


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``patch`` merged in (dicts recursively), as a merge patch does."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def test_deleting_the_service_garbage_collects_children(cluster, operator):
    cluster.apply(cpu_example("epsilon"))
    wait_for(lambda: ready(cluster, "epsilon"), "epsilon Ready")
    cluster.run("delete", api_names.PLURAL, "epsilon")
    wait_for(lambda: not children(cluster, "epsilon"), "children to be garbage-collected")
    settle(operator)
    assert not children(cluster, "epsilon")  # and the operator did not re-create them


def test_switching_to_disaggregated_prunes_the_mixed_role(cluster, operator):
    cluster.apply(cpu_example("zeta"))
    wait_for(lambda: ready(cluster, "zeta"), "zeta Ready")
    peer_key = base64.b64encode(b"zeta-peer-key-0123456789abcdef").decode()
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "zeta-peer-key"},
            "data": {"peer-key": peer_key},
        }
    )
    role = {"replicas": 1, "resources": {"gpus": 0}}
    patch = {
        "spec": {
            "roles": {"mixed": None, "prefill": role, "decode": role},
            "auth": {"peerKeySecretRef": {"name": "zeta-peer-key"}},
        }
    }
    cluster.run("patch", api_names.PLURAL, "zeta", "--type", "merge", "-p", json.dumps(patch))
    wait_for(
        lambda: (
            ("Deployment", "zeta-mixed") not in children(cluster, "zeta")
            and ("Deployment", "zeta-router") in children(cluster, "zeta")
        ),
        "the mixed role to be replaced by prefill, decode and router",
    )
    body = wait_for(lambda: ready(cluster, "zeta"), "zeta Ready when disaggregated")
    assert body["status"]["mode"] == "disaggregated"
    assert set(body["status"]["roles"]) == {"prefill", "decode", "router"}
    assert body["status"]["url"].startswith("http://zeta-router.")


@pytest.mark.parametrize(("case", "patch", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_objects_are_rejected_by_the_api_server_naming_the_field(
    cluster, case, patch, field
):
    body = invalid_body(copy.deepcopy(patch))
    body["metadata"]["name"] = "bad-" + uuid.uuid4().hex[:6]
    result = cluster.apply(body, check=False)
    assert result.returncode != 0, f"{case}: accepted"
    assert field.removeprefix("spec.").split(".")[-1] in result.stderr, result.stderr
    assert cluster.get(api_names.PLURAL, body["metadata"]["name"]) is None


def test_unknown_fields_and_bad_names_are_rejected(cluster):
    body = cpu_example("eta")
    body["spec"]["engine"]["maxNumSeq"] = 3  # a typo
    result = cluster.apply(body, check=False)
    assert result.returncode != 0 and "maxNumSeq" in result.stderr
    long = cpu_example("n" * (api_names.MAX_NAME_LENGTH + 1))
    result = cluster.apply(long, check=False)
    assert result.returncode != 0 and "metadata.name" in result.stderr
    result = cluster.apply(cpu_example("theta"), "--dry-run=server")
    assert result.returncode == 0
    assert cluster.get(api_names.PLURAL, "theta") is None


def test_a_spec_the_engine_refuses_degrades_without_hurting_others(cluster, operator):
    """kvCacheMemory '0MiB' passes the schema but not the engine's own check: the operator sets
    Degraded/InvalidSpec once and leaves other InferenceServices alone."""
    bad = cpu_example("iota")
    bad["spec"]["engine"]["kvCacheMemory"] = "0MiB"
    cluster.apply(bad)
    body = wait_for(
        lambda: (
            (b := cluster.get(api_names.PLURAL, "iota"))
            and condition(b, "Degraded").get("reason") == "InvalidSpec"
            and b
        ),
        "iota Degraded/InvalidSpec",
    )
    assert "kv_cache_memory" in condition(body, "Degraded")["message"]
    assert not children(cluster, "iota")
    cluster.apply(cpu_example("kappa"))
    wait_for(lambda: ready(cluster, "kappa"), "kappa Ready next to an invalid one")
    settle(operator)
    errors_before = operator.metrics.errors.labels("InvalidSpec")._value.get()
    settle(operator)
    assert (
        operator.metrics.errors.labels("InvalidSpec")._value.get() == errors_before
    )  # no hot loop
    fixed = copy.deepcopy(bad)
    fixed["spec"]["engine"]["kvCacheMemory"] = "128MiB"
    cluster.apply(fixed)
    wait_for(lambda: ready(cluster, "iota"), "iota Ready once fixed")


def test_kubectl_explain_describes_engine_fields(cluster):
    result = cluster.run("explain", "inferenceservice.spec.engine", ns=False)
    assert "maxNumSeqs" in result.stdout
    assert "--max-num-seqs" in result.stdout  # the flag the field sets
    result = cluster.run("explain", "kisvc.spec.roles.mixed.autoscaling", ns=False)
    assert "maxReplicas" in result.stdout and "HorizontalPodAutoscaler" in result.stdout


def test_restricted_pod_security_is_enforced_and_engine_pods_meet_it(cluster, operator):
    """The namespace enforces the restricted Pod Security Standard (the API server's PodSecurity
    admission): a plain pod is refused, and the pod the operator's Deployment makes passes."""
    refused = cluster.run(
        "run", "plain", "--image=docker.io/library/busybox:1", "--restart=Never", check=False
    )
    assert refused.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr
    cluster.apply(cpu_example("psa"))
    dep = wait_for(lambda: cluster.get("deployments", "psa-mixed"), "the Deployment")
    template = dep["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "psa-check", "labels": {"check": "psa"}},
        "spec": template["spec"],
    }
    cluster.apply(pod, "--dry-run=server")  # admitted: fails the test if PodSecurity refused it
