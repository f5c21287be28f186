"""Install manifests (manifests/, kustomize) and images (docker/): valid objects, one CRD,
least-privilege RBAC, a restricted operator pod, and an operator image without PaddlePaddle."""

from __future__ import annotations

import copy
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement

from ketch.operator import api_names, children, handlers, kube
from ketch.operator.cli import build_parser, render_object
from ketch.operator.labels import LABEL_MANAGED_BY, MANAGER

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
CRD_FILE = ROOT / "crds" / f"{api_names.CRD_NAME}.yaml"
OVERLAYS = ("cluster-wide", "single-namespace")
VERSIONS = ("1.30.0", "1.33.0")
SYSTEM_NAMESPACE = "ketch-system"
OPERATOR = "ketch-operator"
IMAGE = "ghcr.io/ketch-dev/ketch-operator:0.1.0"

Obj = dict[str, Any]

# Server-side apply (patch; create when new), watches, deletes; never update (no PUT anywhere).
ALL_WRITES = {"get", "list", "watch", "create", "patch", "delete"}
# (apiGroup, resource) -> verbs: what the operator does (ketch.operator.handlers, controller,
# kube.py) and nothing else. No Secrets, no CRDs, no Namespaces. The e2e tests run the operator
# with exactly these rights (operator_rbac.py), so one missing shows there as a 403.
COMMON_GRANTS: dict[tuple[str, str], set[str]] = {
    ("serving.ketch.dev", "inferenceservices"): {"get", "list", "watch"},
    ("serving.ketch.dev", "inferenceservices/status"): {"patch"},  # merge patches
    ("", "configmaps"): ALL_WRITES,
    ("", "services"): ALL_WRITES,
    ("apps", "deployments"): ALL_WRITES,
    ("apps", "deployments/scale"): {"patch"},  # coordinated autoscaling (kube.scale)
    ("policy", "poddisruptionbudgets"): ALL_WRITES,
    ("networking.k8s.io", "networkpolicies"): ALL_WRITES,
    ("autoscaling", "horizontalpodautoscalers"): ALL_WRITES,
    # Never watched (the operator must work without KEDA): applied, read and deleted by name.
    ("keda.sh", "scaledobjects"): {"get", "create", "patch", "delete"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "events"): {"create"},  # core/v1 Events, posted by the operator and kopf
    # Gateway API Inference Extension (issue 32): the InferencePool and HTTPRoute children.
    ("inference.networking.k8s.io", "inferencepools"): ALL_WRITES | {"update"},
    ("gateway.networking.k8s.io", "httproutes"): ALL_WRITES | {"update"},
}
PEERING_VERBS = {"get", "list", "watch", "patch"}
EXPECTED_GRANTS = {
    "cluster-wide": {**COMMON_GRANTS, ("kopf.dev", "clusterkopfpeerings"): PEERING_VERBS},
    "single-namespace": {**COMMON_GRANTS, ("kopf.dev", "kopfpeerings"): PEERING_VERBS},
}
# What docker/operator.Dockerfile installs besides Ketch itself (canonical distribution names).
OPERATOR_DEPENDENCIES = {
    "kopf",
    "aiohttp",
    "pyyaml",
    "prometheus-client",
    "jsonschema",
    "cel-python",
}
# Volume types the restricted Pod Security Standard allows.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def kustomize(directory: Path) -> list[Obj]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: it builds the kustomizations (kubectl kustomize)")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d is not None]


@pytest.fixture(scope="module")
def built() -> dict[str, list[Obj]]:
    return {name: kustomize(MANIFESTS / "overlays" / name) for name in OVERLAYS}


def by_kind(docs: list[Obj], kind: str) -> list[Obj]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Obj], kind: str, name: str = OPERATOR) -> Obj:
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def operator_container(docs: list[Obj]) -> Obj:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return container


def watched_namespace(docs: list[Obj]) -> str:
    env = {e["name"]: e for e in operator_container(docs).get("env", [])}
    return env["WATCH_NAMESPACE"]["value"]


# --------------------------------------------------------------------------- validation


def crd_for(docs: list[Obj], api_version: str, kind: str) -> Obj | None:
    group, _, version = api_version.rpartition("/")
    for doc in by_kind(docs, "CustomResourceDefinition"):
        spec = doc["spec"]
        if spec["group"] == group and spec["names"]["kind"] == kind:
            assert any(v["name"] == version and v["served"] for v in spec["versions"])
            return doc
    return None


def _strict(schema: Any) -> Any:
    """An OpenAPI v3 CRD schema as strict JSON Schema: objects with declared properties reject
    unknown fields unless they preserve them (the API server would prune them silently)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def validate_custom_resource(doc: Obj, definition: Obj, version: str) -> None:
    """kubernetes-validate has no schema for custom kinds: check the object against its CRD
    (scope, schema) and its metadata against the official ObjectMeta schema."""
    namespaced = definition["spec"]["scope"] == "Namespaced"
    has_namespace = "namespace" in doc["metadata"]
    assert has_namespace == namespaced, (
        f"{doc['kind']} {doc['metadata']['name']}: namespace {doc['metadata'].get('namespace')!r}"
        f" on a {definition['spec']['scope']}-scoped kind"
    )
    # ObjectMeta is the same for every kind; a ConfigMap carries it into kubernetes-validate.
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}, version, strict=True
    )
    served = doc["apiVersion"].rpartition("/")[2]
    [entry] = [v for v in definition["spec"]["versions"] if v["name"] == served]
    schema = copy.deepcopy(entry["schema"]["openAPIV3Schema"])
    schema["properties"] = {
        **schema.get("properties", {}),
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
    }
    jsonschema.validate(doc, _strict(schema))


def validate(doc: Obj, docs: list[Obj], version: str) -> None:
    definition = crd_for(docs, doc["apiVersion"], doc["kind"])
    if definition is not None:
        validate_custom_resource(doc, definition, version)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_and_every_object_is_valid(built, overlay, version):
    docs = built[overlay]
    for doc in docs:
        try:
            validate(doc, docs, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            where = f"{doc['kind']} {doc['metadata']['name']}"
            pytest.fail(f"{overlay}: {where} is invalid for Kubernetes {version}: {exc.message}")
    kinds = sorted({d["kind"] for d in docs})
    scoped = ["ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"]
    if overlay == "single-namespace":
        scoped = ["Role", "RoleBinding", "KopfPeering"]
    assert kinds == sorted(
        ["CustomResourceDefinition", "Deployment", "Namespace", "ServiceAccount", *scoped]
    )


def test_custom_resource_validation_catches_mistakes(built):
    """The hand-rolled check for custom kinds must be able to fail."""
    docs = built["cluster-wide"]
    peering = one(docs, "ClusterKopfPeering")
    definition = crd_for(docs, peering["apiVersion"], peering["kind"])
    assert definition is not None
    validate_custom_resource(peering, definition, VERSIONS[0])
    namespaced = copy.deepcopy(peering)
    namespaced["metadata"]["namespace"] = SYSTEM_NAMESPACE
    with pytest.raises(AssertionError, match="Cluster-scoped"):
        validate_custom_resource(namespaced, definition, VERSIONS[0])
    typo = {**peering, "spek": {}}
    with pytest.raises(jsonschema.ValidationError, match="spek"):
        validate_custom_resource(typo, definition, VERSIONS[0])
    bad_meta = copy.deepcopy(peering)
    bad_meta["metadata"]["lables"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_custom_resource(bad_meta, definition, VERSIONS[0])


# --------------------------------------------------------------------------- CRDs


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_inferenceservice_crd_is_the_generated_file(built, overlay):
    installed = one(built[overlay], "CustomResourceDefinition", api_names.CRD_NAME)
    assert installed == yaml.safe_load(CRD_FILE.read_text()), (
        f"the CRD in manifests/overlays/{overlay} differs from {CRD_FILE.relative_to(ROOT)}"
    )


def test_one_copy_of_the_inferenceservice_crd():
    """manifests/ references crds/ (through crds/kustomization.yaml) instead of copying it."""
    for path in MANIFESTS.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                assert doc["metadata"]["name"] != api_names.CRD_NAME, f"{path} copies the CRD"
    assert (ROOT / "crds" / "kustomization.yaml").exists()


def test_kopf_peering_crds(built):
    docs = built["cluster-wide"]
    scopes = {"kopfpeerings.kopf.dev": "Namespaced", "clusterkopfpeerings.kopf.dev": "Cluster"}
    for name, scope in scopes.items():
        spec = one(docs, "CustomResourceDefinition", name)["spec"]
        assert spec["group"] == "kopf.dev"
        assert spec["scope"] == scope
        assert spec["names"]["plural"] == name.split(".")[0]
        [version] = spec["versions"]
        assert version["name"] == "v1" and version["served"] and version["storage"]
        props = version["schema"]["openAPIV3Schema"]["properties"]
        for field in ("spec", "status"):
            assert props[field] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


# --------------------------------------------------------------------------- RBAC


def grants(role: Obj) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, f"unexpected rule {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_grants_exactly_what_the_operator_needs(built, overlay):
    docs = built[overlay]
    cluster = overlay == "cluster-wide"
    role = one(docs, "ClusterRole" if cluster else "Role")
    binding = one(docs, "ClusterRoleBinding" if cluster else "RoleBinding")
    granted, expected = grants(role), EXPECTED_GRANTS[overlay]
    extra = {k: sorted(v - expected.get(k, set())) for k, v in granted.items()}
    missing = {k: sorted(v - granted.get(k, set())) for k, v in expected.items()}
    extra, missing = {k: v for k, v in extra.items() if v}, {k: v for k, v in missing.items() if v}
    assert granted == expected, f"{role['kind']}: extra grants {extra}, missing grants {missing}"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": role["kind"],
        "name": role["metadata"]["name"],
    }
    account = one(docs, "ServiceAccount")
    assert account["metadata"]["namespace"] == SYSTEM_NAMESPACE
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": OPERATOR, "namespace": SYSTEM_NAMESPACE}
    ]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == OPERATOR
    if not cluster:  # rights in the served namespace only, none cluster-wide
        namespace = watched_namespace(docs)
        assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
        assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")


def test_grants_comparison_catches_wildcards():
    role = {"rules": [{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["*"]}]}
    assert grants(role) != {("apps", "deployments"): ALL_WRITES}


def _group_plural(api_version: str, plural: str) -> tuple[str, str]:
    return (api_version.rpartition("/")[0], plural)


def test_rbac_covers_everything_the_code_touches():
    """Tied to the code: a new child kind (say an HPA) fails here until the RBAC grants it."""
    applied = {
        child["kind"]
        for path in sorted((ROOT / "examples").glob("*.yaml"))
        for child in render_object(yaml.safe_load(path.read_text()), owner_uid="u")
    }
    assert applied <= set(children.BY_KIND)
    for kind in children.KINDS:  # server-side applied, pruned, watched
        key = _group_plural(*kube.RESOURCES[kind.kind])
        needed = {"get", "create", "patch", "delete"}
        if kind.watched:
            needed |= {"list", "watch"}
        assert needed <= COMMON_GRANTS[key], kind.kind
    for api_version, plural in handlers.WATCHED_RESOURCES:
        assert {"list", "watch"} <= COMMON_GRANTS[_group_plural(api_version, plural)]
    status = _group_plural(api_names.API_VERSION, api_names.PLURAL + "/status")
    assert "patch" in COMMON_GRANTS[status]
    assert {"list", "watch"} <= COMMON_GRANTS[
        _group_plural(api_names.API_VERSION, api_names.PLURAL)
    ]
    assert "create" in COMMON_GRANTS[_group_plural(*kube.RESOURCES["Event"])]
    scale = _group_plural(*kube.RESOURCES["Deployment"])
    assert "patch" in COMMON_GRANTS[(scale[0], scale[1] + "/scale")]


# --------------------------------------------------------------------------- operator pod


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_operator_pod_meets_restricted_pod_security_standard(built, overlay):
    docs = built[overlay]
    namespace = one(docs, "Namespace", SYSTEM_NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    deployment = one(docs, "Deployment")
    assert deployment["metadata"]["namespace"] == SYSTEM_NAMESPACE
    pod = deployment["spec"]["template"]["spec"]
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(host)
    pod_sc = pod["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert pod_sc["runAsUser"] == 1000
    assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
    for volume in pod.get("volumes", []):
        assert set(volume) - {"name"} <= RESTRICTED_VOLUMES, volume
    for container in pod["containers"] + pod.get("initContainers", []):
        sc = container["securityContext"]
        assert sc["runAsNonRoot"] is True
        assert sc.get("runAsUser", pod_sc["runAsUser"]) == 1000
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert sc["readOnlyRootFilesystem"] is True
        assert not sc.get("privileged")
        assert all("hostPort" not in p for p in container.get("ports", []))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_operator_deployment(built, overlay):
    docs = built[overlay]
    deployment = one(docs, "Deployment")
    template = deployment["spec"]["template"]
    container = operator_container(docs)
    assert container["image"] == IMAGE
    assert container["command"] == [OPERATOR, "run", "--priority=random"]
    [port] = container["ports"]
    assert port == {"name": "metrics", "containerPort": 8080, "protocol": "TCP"}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    resources = container["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert "memory" in resources["limits"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port["containerPort"])
    assert annotations["prometheus.io/path"] == "/metrics"
    labels = template["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == OPERATOR
    assert labels["app.kubernetes.io/part-of"] == "ketch"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # The operator watches pods labelled managed-by=ketch-operator as InferenceService children.
    assert labels.get(LABEL_MANAGED_BY) != MANAGER
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_operator_replicas_elect_a_leader(built, overlay):
    """Replicas of equal kopf priority all pause; '--priority random' gives each pod its own,
    so exactly one of the two replicas acts and the other takes over when it goes."""
    spec = one(built[overlay], "Deployment")["spec"]
    assert spec["replicas"] == 2
    container = operator_container(built[overlay])
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    argv = container["command"][1:] + _expand(container.get("args", []), env)
    assert "--priority=random" in argv
    first, second = (build_parser().parse_args(argv).priority for _ in range(2))
    assert first != second


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion of container args."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in args]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_operator_arguments_match_scope_and_peering_object(built, overlay):
    docs = built[overlay]
    container = operator_container(docs)
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    argv = container["command"][1:] + _expand(container.get("args", []), env)
    args = build_parser().parse_args(argv)
    assert args.command == "run"
    assert not args.standalone
    if overlay == "cluster-wide":
        assert args.namespace == []
        peering = one(docs, "ClusterKopfPeering", args.peering)
        assert "namespace" not in peering["metadata"]
        assert not by_kind(docs, "KopfPeering")
    else:
        assert args.namespace == [watched_namespace(docs)]
        peering = one(docs, "KopfPeering", args.peering)
        assert peering["metadata"]["namespace"] == watched_namespace(docs)
        assert not by_kind(docs, "ClusterKopfPeering")


def test_single_namespace_overlay_follows_its_one_namespace_setting(tmp_path):
    """Documented way to serve another namespace: edit watched-namespace.yaml, nothing else."""
    shutil.copytree(MANIFESTS, tmp_path / "manifests")
    shutil.copytree(ROOT / "crds", tmp_path / "crds")
    overlay = tmp_path / "manifests" / "overlays" / "single-namespace"
    setting = overlay / "watched-namespace.yaml"
    assert "namespace: llm\n" in setting.read_text()
    setting.write_text(setting.read_text().replace("namespace: llm\n", "namespace: team-a\n"))
    docs = kustomize(overlay)
    assert watched_namespace(docs) == "team-a"
    for kind in ("Role", "RoleBinding", "KopfPeering"):
        assert one(docs, kind)["metadata"]["namespace"] == "team-a"
    assert not by_kind(docs, "ConfigMap")  # the setting is kustomize input, not an object
    rendered = json.dumps([d for d in docs if d["kind"] != "CustomResourceDefinition"])
    assert '"llm"' not in rendered and "set-by-replacement" not in rendered


# --------------------------------------------------------------------------- images


def _instructions(path: Path) -> list[str]:
    """Dockerfile instructions with continuation lines joined and comments left out."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    return [s.strip() for s in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if s.strip()]


def _pyproject() -> Obj:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_dockerfiles_exist_run_as_user_1000():
    for name in ("engine", "operator"):
        steps = _instructions(ROOT / "docker" / f"{name}.Dockerfile")
        assert steps[0].startswith("ARG ") or steps[0].startswith("FROM ")
        assert "USER 1000:1000" in steps
        assert any("useradd --uid 1000" in s for s in steps)
        assert not any(s.startswith("ENTRYPOINT") for s in steps)
        assert sum(s.startswith("FROM ") for s in steps) == 2  # build stage, runtime stage


def test_operator_image_installs_no_paddle_and_the_operators_dependencies():
    steps = _instructions(ROOT / "docker" / "operator.Dockerfile")
    text = "\n".join(steps)
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in steps
    assert "paddle" not in text.lower()
    assert "pip install --no-cache-dir --no-deps ." in text
    assert 'CMD ["ketch-operator", "run"]' in steps
    installed = {
        _canonical(Requirement(spec).name): str(Requirement(spec).specifier)
        for spec in re.findall(r'"([A-Za-z][^"\s]*[<>=~!][^"\s]*)"', text)
    }
    declared = {
        _canonical(r.name): str(r.specifier) for r in map(Requirement, _pyproject()["dependencies"])
    }
    assert set(installed) == OPERATOR_DEPENDENCIES
    for name, specifier in installed.items():
        assert declared[name] == specifier, f"{name}: Dockerfile {specifier}, pyproject.toml"


def _closure(names: set[str]) -> set[str]:
    """The distributions ``names`` need, transitively (no extras)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for spec in importlib.metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def test_operator_runs_on_what_its_image_installs(tmp_path):
    """Every module the operator's run path imports comes from the standard library, Ketch, or
    the distributions the operator image installs (and their dependencies): no paddle, numpy,
    fastapi..."""
    # Modules loaded at interpreter start-up (site hooks) don't count; neither do the
    # file-less ones Cython extensions register.
    code = textwrap.dedent(
        """
        import sys
        before = set(sys.modules)
        import ketch.operator.cli, ketch.operator.handlers, ketch.operator.controller
        ketch.operator.handlers.make_registry(metrics_port=8080)
        new = {n for n, m in sys.modules.items() if n not in before and getattr(m, "__file__", 0)}
        print("\\n".join(sorted({n.split(".")[0] for n in new})))
        """
    )
    # Run outside the repository root: its operator/ directory shadows the stdlib module.
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stderr
    allowed = _closure(OPERATOR_DEPENDENCIES)
    owners = importlib.metadata.packages_distributions()
    outside = {}
    for module in result.stdout.split():
        if module in sys.stdlib_module_names or module in ("ketch", "__main__"):
            continue
        dists = {_canonical(d) for d in owners.get(module, [])}
        if not dists & allowed:
            outside[module] = sorted(dists)
    assert not outside, f"imported but not installed by docker/operator.Dockerfile: {outside}"


def test_engine_image_swaps_the_cpu_paddle_wheel_for_the_gpu_extra(tmp_path):
    """Runs the Dockerfile's own requirement-splitting step against pyproject.toml."""
    steps = _instructions(ROOT / "docker" / "engine.Dockerfile")
    assert any(s.startswith("ARG BASE_IMAGE=") for s in steps)
    [step] = [s for s in steps if "tomllib" in s]
    code = re.search(r"python -c '(.*?)'", step)
    assert code is not None
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    script = code.group(1).replace("/tmp/", f"{tmp_path}/")
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=60)
    gpu = (tmp_path / "gpu.txt").read_text().splitlines()
    deps = (tmp_path / "deps.txt").read_text().splitlines()  # a line may hold a marker
    project = _pyproject()
    assert gpu == project["optional-dependencies"]["gpu"]
    assert any(g.startswith("paddlepaddle-gpu") for g in gpu)
    assert not [d for d in deps if Requirement(d).name == "paddlepaddle"]
    expected = [d for d in project["dependencies"] if Requirement(d).name != "paddlepaddle"]
    assert deps == expected + project["optional-dependencies"]["fetch"]
    assert '--index-url "${PADDLE_INDEX}" -r /tmp/gpu.txt' in step
    assert "--no-deps ." in step


def test_dockerignore_keeps_what_the_build_needs():
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv"} <= ignored
    needed = {"pyproject.toml", "README.md", *_pyproject_package_dirs()}
    assert not needed & ignored
    assert not any(line.startswith("!") or line in ("*", "**") for line in ignored)


def _pyproject_package_dirs() -> set[str]:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(mapping["package-dir"].values())
