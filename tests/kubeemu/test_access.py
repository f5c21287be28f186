"""Authentication and RBAC in the emulator behave as kube-apiserver's do: the identities a
request can have, what a Role/ClusterRole and its binding grant, and the exact 401/403 bodies."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request
from typing import Any

import pytest

from kubeemu import ApiResponse, Emulator, _Client, kubectl, write_kubeconfig
from kubeemu.rbac import RequestInfo, request_info, rule_allows

RBAC = "/apis/rbac.authorization.k8s.io/v1"


class As(_Client):
    """The emulator's test client with another bearer token."""

    def __init__(self, url: str, token: str | None):
        self.url = url
        self.token = token


def service_account(emu: Emulator, namespace: str, name: str = "robot") -> As:
    emu.post(f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": name}}).ok()
    token = kubectl(emu, "create", "token", name, "-n", namespace, check=True).stdout.strip()
    return As(emu.url, token)


def grant(emu: Emulator, namespace: str, rules: list[dict[str, Any]], subject: str = "robot"):
    """A Role with `rules` bound to ServiceAccount `subject` in `namespace`."""
    emu.post(f"{RBAC}/namespaces/{namespace}/roles", {"metadata": {"name": "r"}, "rules": rules})
    emu.post(
        f"{RBAC}/namespaces/{namespace}/rolebindings",
        {
            "metadata": {"name": "r"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "r"},
            "subjects": [{"kind": "ServiceAccount", "name": subject, "namespace": namespace}],
        },
    ).ok()


def message(response: ApiResponse) -> str:
    assert response.status == 403, response.body
    assert response.body["reason"] == "Forbidden"
    return response.body["message"]


def user(namespace: str, name: str = "robot") -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def tls_get(emu: Emulator, path: str) -> tuple[int, Any]:
    """GET over the TLS port without credentials (system:anonymous)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(emu.secure_url + path, context=context, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# --------------------------------------------------------------------------- request info


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", "/api/v1/namespaces/a/pods", {}, ("list", "", "pods", "", "a", "")),
        ("GET", "/api/v1/namespaces/a/pods", {"watch": "1"}, ("watch", "", "pods", "", "a", "")),
        ("GET", "/api/v1/watch/namespaces/a/pods", {}, ("watch", "", "pods", "", "a", "")),
        (
            "GET",
            "/api/v1/namespaces/a/pods",
            {"fieldSelector": "metadata.name=p"},
            ("list", "", "pods", "", "a", "p"),
        ),
        ("GET", "/api/v1/namespaces/a", {}, ("get", "", "namespaces", "", "a", "a")),
        (
            "PUT",
            "/api/v1/namespaces/a/status",
            {},
            ("update", "", "namespaces", "status", "a", "a"),
        ),
        (
            "PATCH",
            "/apis/apps/v1/namespaces/a/deployments/d/scale",
            {},
            ("patch", "apps", "deployments", "scale", "a", "d"),
        ),
        ("DELETE", "/api/v1/namespaces/a/pods", {}, ("deletecollection", "", "pods", "", "a", "")),
        ("POST", "/api/v1/nodes", {}, ("create", "", "nodes", "", "", "")),
    ],
)
def test_request_info_is_read_as_the_apiserver_reads_it(method, path, query, expected):
    info = request_info(method, path, query)
    assert info.resource_request
    got = (info.verb, info.api_group, info.resource, info.subresource, info.namespace, info.name)
    assert got == expected


@pytest.mark.parametrize("path", ["/version", "/api", "/apis", "/apis/apps/v1", "/openapi/v3"])
def test_discovery_paths_are_non_resource_requests(path):
    info = request_info("GET", path, {})
    assert not info.resource_request and info.verb == "get" and info.path == path


def test_rule_matching():
    pods = RequestInfo("/", "get", True, "", "v1", "a", "pods", "", "p")
    scale = RequestInfo("/", "patch", True, "apps", "v1", "a", "deployments", "scale", "d")
    assert rule_allows(pods, {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]})
    assert not rule_allows(pods, {"apiGroups": ["apps"], "resources": ["pods"], "verbs": ["get"]})
    assert rule_allows(pods, {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]})
    named = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"], "resourceNames": ["q"]}
    assert not rule_allows(pods, named)
    assert rule_allows(pods.but(name="q"), named)
    assert not rule_allows(
        scale, {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["*"]}
    )
    assert rule_allows(scale, {"apiGroups": ["apps"], "resources": ["*/scale"], "verbs": ["patch"]})
    assert rule_allows(scale, {"apiGroups": ["apps"], "resources": ["*"], "verbs": ["patch"]})
    url = RequestInfo("/apis/apps", "get")
    assert rule_allows(url, {"nonResourceURLs": ["/apis/*"], "verbs": ["get"]})
    assert not rule_allows(url, {"nonResourceURLs": ["/api/*"], "verbs": ["get"]})


# --------------------------------------------------------------------------- authentication


def test_anonymous_reads_only_version_and_health(emu: Emulator):
    assert tls_get(emu, "/version")[0] == 200
    status, body = tls_get(emu, "/api")
    assert (status, body["message"]) == (
        403,
        'forbidden: User "system:anonymous" cannot get path "/api"',
    )
    status, body = tls_get(emu, "/api/v1/namespaces")
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'namespaces is forbidden: User "system:anonymous" cannot list resource '
        '"namespaces" in API group "" at the cluster scope',
        "reason": "Forbidden",
        "details": {"kind": "namespaces"},
        "code": 403,
    }


def test_an_unknown_or_revoked_token_is_unauthorized(emu: Emulator, namespace: str):
    unauthorized = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Unauthorized",
        "reason": "Unauthorized",
        "code": 401,
    }
    response = As(emu.url, "not-a-token").get("/version")
    assert (response.status, response.body) == (401, unauthorized)
    robot = service_account(emu, namespace)
    assert robot.get("/apis").status == 200
    emu.delete(f"/api/v1/namespaces/{namespace}/serviceaccounts/robot").ok()
    response = robot.get("/apis")
    assert (response.status, response.body) == (401, unauthorized)


def test_a_service_account_is_signed_in_but_has_no_rights_of_its_own(emu: Emulator, namespace):
    robot = service_account(emu, namespace)
    for path in ("/version", "/api", "/api/v1", "/apis", "/apis/apps/v1", "/openapi/v3"):
        assert robot.get(path).status == 200, path
    assert message(robot.get(f"/api/v1/namespaces/{namespace}/pods")) == (
        f'pods is forbidden: User "{user(namespace)}" cannot list resource "pods" in API group '
        f'"" in the namespace "{namespace}"'
    )
    assert message(robot.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/d")) == (
        f'deployments.apps "d" is forbidden: User "{user(namespace)}" cannot get resource '
        f'"deployments" in API group "apps" in the namespace "{namespace}"'
    )
    assert message(robot.get("/api/v1/nodes")) == (
        f'nodes is forbidden: User "{user(namespace)}" cannot list resource "nodes" in API group '
        '"" at the cluster scope'
    )


# --------------------------------------------------------------------------- authorization


def test_a_role_grants_its_verbs_in_its_namespace_only(emu: Emulator, namespace: str):
    robot = service_account(emu, namespace)
    grant(emu, namespace, [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}])
    assert robot.get(f"/api/v1/namespaces/{namespace}/configmaps").status == 200
    assert message(robot.get(f"/api/v1/namespaces/{namespace}/configmaps", params={"watch": "1"}))
    assert message(robot.get(f"/api/v1/namespaces/{namespace}/configmaps/x")).startswith(
        'configmaps "x" is forbidden'
    )
    assert message(robot.get("/api/v1/namespaces/default/configmaps")).endswith(
        'in the namespace "default"'
    )
    assert message(robot.get("/api/v1/configmaps")).endswith("at the cluster scope")


def test_subresources_need_rules_of_their_own(emu: Emulator, namespace: str):
    robot = service_account(emu, namespace)
    grant(emu, namespace, [{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["*"]}])
    scale = f"/apis/apps/v1/namespaces/{namespace}/deployments/d/scale"
    assert message(robot.patch(scale, {"spec": {"replicas": 2}})) == (
        f'deployments.apps "d" is forbidden: User "{user(namespace)}" cannot patch resource '
        f'"deployments/scale" in API group "apps" in the namespace "{namespace}"'
    )


def test_resource_names_limit_a_rule_to_those_objects(emu: Emulator, namespace: str):
    robot = service_account(emu, namespace)
    rule = {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}
    grant(emu, namespace, [{**rule, "resourceNames": ["mine"]}])
    emu.post(f"/api/v1/namespaces/{namespace}/configmaps", {"metadata": {"name": "mine"}}).ok()
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    assert robot.get(f"{base}/mine").status == 200
    assert message(robot.get(f"{base}/other"))
    assert message(robot.get(base))  # a list names no object
    listed = robot.get(base, params={"fieldSelector": "metadata.name=mine"})
    assert [i["metadata"]["name"] for i in listed.ok()["items"]] == ["mine"]


def test_server_side_apply_that_creates_needs_create(emu: Emulator, namespace: str):
    robot = service_account(emu, namespace)
    grant(emu, namespace, [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["patch"]}])
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    body = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"k": "v"}}
    refused = robot.apply(f"{base}/new", {**body, "metadata": {"name": "new"}}, manager="robot")
    assert message(refused) == (
        f'configmaps "new" is forbidden: User "{user(namespace)}" cannot create resource '
        f'"configmaps" in API group "" in the namespace "{namespace}"'
    )
    emu.post(base, {"metadata": {"name": "old"}}).ok()
    robot.apply(f"{base}/old", {**body, "metadata": {"name": "old"}}, manager="robot").ok()


def test_a_rolebinding_grants_a_clusterrole_in_its_namespace_only(emu: Emulator, namespace):
    robot = service_account(emu, namespace)
    role = f"reader-{namespace}"
    rule = {"apiGroups": [""], "resources": ["services"], "verbs": ["list"]}
    emu.post(f"{RBAC}/clusterroles", {"metadata": {"name": role}, "rules": [rule]}).ok()
    try:
        emu.post(
            f"{RBAC}/namespaces/{namespace}/rolebindings",
            {
                "metadata": {"name": "reader"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": role,
                },
                "subjects": [
                    {"kind": "ServiceAccount", "name": "robot"}
                ],  # the binding's namespace
            },
        ).ok()
        assert robot.get(f"/api/v1/namespaces/{namespace}/services").status == 200
        assert message(robot.get("/api/v1/namespaces/default/services"))
        assert message(robot.get("/api/v1/services"))
    finally:
        emu.delete(f"{RBAC}/clusterroles/{role}")


def test_a_clusterrolebinding_grants_everywhere(emu: Emulator, namespace: str):
    robot = service_account(emu, namespace)
    name = f"nodes-{namespace}"
    rule = {"apiGroups": [""], "resources": ["namespaces", "pods"], "verbs": ["list"]}
    emu.post(f"{RBAC}/clusterroles", {"metadata": {"name": name}, "rules": [rule]}).ok()
    binding = {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": "robot", "namespace": namespace}],
    }
    emu.post(f"{RBAC}/clusterrolebindings", binding).ok()
    try:
        assert robot.get("/api/v1/namespaces").status == 200
        assert robot.get("/api/v1/pods").status == 200
        assert robot.get("/api/v1/namespaces/default/pods").status == 200
    finally:
        emu.delete(f"{RBAC}/clusterrolebindings/{name}")
        emu.delete(f"{RBAC}/clusterroles/{name}")


def test_a_binding_to_a_missing_role_says_so(emu: Emulator, namespace: str):
    robot = service_account(emu, namespace)
    emu.post(
        f"{RBAC}/namespaces/{namespace}/rolebindings",
        {
            "metadata": {"name": "dangling"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "gone"},
            "subjects": [{"kind": "ServiceAccount", "name": "robot"}],
        },
    ).ok()
    assert message(robot.get(f"/api/v1/namespaces/{namespace}/pods")) == (
        f'pods is forbidden: User "{user(namespace)}" cannot list resource "pods" in API group '
        f'"" in the namespace "{namespace}": RBAC: role.rbac.authorization.k8s.io "gone" not found'
    )


def test_kubectl_runs_as_the_service_account(emu: Emulator, namespace: str, tmp_path):
    robot = service_account(emu, namespace)
    grant(emu, namespace, [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}])
    config = write_kubeconfig(tmp_path / "robot", emu.secure_url, namespace, token=robot.token)
    run = ["kubectl", "--kubeconfig", str(config), "--cache-dir", str(tmp_path / "cache")]
    listed = subprocess.run([*run, "get", "pods"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    refused = subprocess.run([*run, "get", "services"], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert (
        f'Error from server (Forbidden): services is forbidden: User "{user(namespace)}" cannot '
        f'list resource "services" in API group "" in the namespace "{namespace}"'
    ) in refused.stderr


def test_kubectl_auth_can_i_answers_for_the_service_account(emu: Emulator, namespace, tmp_path):
    emu.post(f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": "robot"}})
    issued = kubectl(
        emu, "create", "token", "robot", "-n", namespace, "--duration", "2h", "-o", "json"
    )
    assert json.loads(issued.stdout)["spec"]["expirationSeconds"] == 7200
    token = json.loads(issued.stdout)["status"]["token"]
    grant(emu, namespace, [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}])
    config = write_kubeconfig(tmp_path / "robot", emu.secure_url, namespace, token=token)

    def can_i(*args: str) -> str:
        command = ["kubectl", "--kubeconfig", str(config), "auth", "can-i", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout.strip()

    assert can_i("list", "pods") == "yes"
    assert can_i("create", "pods") == "no"
    assert can_i("list", "pods", "-n", "default") == "no"
    assert can_i("get", "/version") == "yes"
    assert can_i("get", "/metrics") == "no"
