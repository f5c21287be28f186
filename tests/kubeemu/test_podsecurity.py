"""Pod Security admission in the emulator: the restricted and baseline checks with the
apiserver's messages, the namespace labels, and what is refused or warned about at the API."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

import procs
from ketch.operator.cli import render_object
from kubeemu import Emulator, kubectl
from kubeemu.podsecurity import LevelVersion, describe, evaluate, policy_of

ROOT = Path(__file__).resolve().parents[2]
ENFORCE = "pod-security.kubernetes.io/enforce"

GOOD_CONTAINER = {
    "name": "c",
    "image": "x",
    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
}
GOOD_SPEC = {
    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [GOOD_CONTAINER],
}


def spec_with(pod: dict[str, Any] | None = None, **container: Any) -> dict[str, Any]:
    """GOOD_SPEC with pod-level keys and the container's keys (securityContext merged) set."""
    spec = copy.deepcopy(GOOD_SPEC)
    for key, value in (pod or {}).items():
        if key == "securityContext":
            spec["securityContext"].update(value)
        else:
            spec[key] = value
    c = spec["containers"][0]
    for key, value in container.items():
        if key == "securityContext":
            c["securityContext"].update(value)
        else:
            c[key] = value
    return spec


def violations(spec: dict[str, Any], level: str = "restricted", version=None, meta=None) -> str:
    return describe(evaluate(LevelVersion(level, version), meta or {}, spec))


# --------------------------------------------------------------------------- the checks


def test_a_compliant_pod_passes():
    assert violations(GOOD_SPEC) == ""
    assert (
        violations(
            spec_with(
                securityContext={"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}
            )
        )
        == ""
    )


def test_a_pod_without_a_security_context_gets_the_apiservers_message():
    bare = {"containers": [{"name": "runtime", "image": "x"}]}
    assert violations(bare) == (
        'allowPrivilegeEscalation != false (container "runtime" must set '
        "securityContext.allowPrivilegeEscalation=false), unrestricted capabilities (container "
        '"runtime" must set securityContext.capabilities.drop=["ALL"]), runAsNonRoot != true (pod '
        'or container "runtime" must set securityContext.runAsNonRoot=true), seccompProfile (pod '
        'or container "runtime" must set securityContext.seccompProfile.type to "RuntimeDefault" '
        'or "Localhost")'
    )
    assert violations(bare, "baseline") == ""
    assert violations(bare, "privileged") == ""


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            spec_with(securityContext={"privileged": True}),
            'privileged (container "c" must not set securityContext.privileged=true)',
        ),
        (
            spec_with(securityContext={"allowPrivilegeEscalation": True}),
            'allowPrivilegeEscalation != false (container "c" must set '
            "securityContext.allowPrivilegeEscalation=false)",
        ),
        (
            spec_with(securityContext={"capabilities": {"add": ["SYS_ADMIN", "NET_RAW"]}}),
            'unrestricted capabilities (container "c" must set securityContext.capabilities.drop='
            '["ALL"]; container "c" must not include "NET_RAW", "SYS_ADMIN" in '
            "securityContext.capabilities.add)",
        ),
        (
            spec_with({"securityContext": {"runAsNonRoot": False}}),
            "runAsNonRoot != true (pod must not set securityContext.runAsNonRoot=false)",
        ),
        (
            spec_with({"securityContext": {"runAsUser": 0}}, securityContext={"runAsUser": 0}),
            'runAsUser=0 (pod and container "c" must not set runAsUser=0)',
        ),
        (
            spec_with({"securityContext": {"seccompProfile": {"type": "Unconfined"}}}),
            'seccompProfile (pod must not set securityContext.seccompProfile.type to "Unconfined")',
        ),
        (
            spec_with({"volumes": [{"name": "n", "nfs": {}}, {"name": "h", "hostPath": {}}]}),
            'restricted volume types (volumes "n", "h" use restricted volume types "hostPath", '
            '"nfs")',
        ),
        (
            spec_with({"hostNetwork": True, "hostPID": True, "hostIPC": True}),
            "host namespaces (hostNetwork=true, hostPID=true, hostIPC=true)",
        ),
        (
            spec_with(
                ports=[{"containerPort": 80, "hostPort": 80}, {"containerPort": 9, "hostPort": 9}]
            ),
            'hostPort (container "c" uses hostPorts 80, 9)',
        ),
        (
            spec_with(securityContext={"procMount": "Unmasked"}),
            'procMount (container "c" must not set securityContext.procMount to "Unmasked")',
        ),
        (
            spec_with(
                {
                    "securityContext": {
                        "sysctls": [{"name": "net.ipv4.tcp_rmem"}, {"name": "kernel.msgmax"}]
                    }
                }
            ),
            "forbidden sysctls (kernel.msgmax)",
        ),
        (
            spec_with({"securityContext": {"seLinuxOptions": {"type": "spc_t", "user": "u"}}}),
            'seLinuxOptions (pod set forbidden securityContext.seLinuxOptions: type "spc_t"; user '
            "may not be set)",
        ),
        (
            spec_with(securityContext={"appArmorProfile": {"type": "Unconfined"}}),
            'forbidden AppArmor profile (container "c" must not set AppArmor profile type to '
            '"Unconfined")',
        ),
        (
            spec_with(securityContext={"windowsOptions": {"hostProcess": True}}),
            'hostProcess (container "c" must not set '
            "securityContext.windowsOptions.hostProcess=true)",
        ),
    ],
)
def test_each_restricted_check(spec, expected):
    assert violations(spec) == expected


def test_every_container_kind_is_checked_and_named_in_order():
    spec = spec_with()
    spec["initContainers"] = [{**GOOD_CONTAINER, "name": "init", "securityContext": {}}]
    spec["containers"].append({**GOOD_CONTAINER, "name": "side", "securityContext": {}})
    assert violations(spec).startswith(
        'allowPrivilegeEscalation != false (containers "init", "side" must set'
    )


def test_annotations_and_baseline_seccomp():
    meta = {"annotations": {"container.apparmor.security.beta.kubernetes.io/c": "unconfined"}}
    assert violations(GOOD_SPEC, meta=meta) == (
        "forbidden AppArmor profile (annotation must not set AppArmor profile type to "
        '"container.apparmor.security.beta.kubernetes.io/c="unconfined"")'  # Go's joinQuote
    )
    unconfined = spec_with(securityContext={"seccompProfile": {"type": "Unconfined"}})
    assert violations(unconfined, "baseline") == (
        'seccompProfile (container "c" must not set securityContext.seccompProfile.type to '
        '"Unconfined")'
    )
    assert violations({"containers": [{"name": "c", "image": "x"}]}, "baseline") == ""


def test_policy_versions_pick_the_variant_of_their_time():
    rmem = spec_with({"securityContext": {"sysctls": [{"name": "net.ipv4.tcp_rmem"}]}})
    assert violations(rmem, version=(1, 31)) == "forbidden sysctls (net.ipv4.tcp_rmem)"
    assert violations(rmem, version=(1, 32)) == ""
    assert violations(rmem, version=(1, 40)) == ""  # newer than the server: the server's
    windows = {"os": {"name": "windows"}, "containers": [{"name": "c", "image": "x"}]}
    assert violations(windows).startswith("runAsNonRoot != true")
    assert violations(windows, version=(1, 24)).startswith("allowPrivilegeEscalation != false")
    root = spec_with({"securityContext": {"runAsUser": 0}})
    assert violations(root, version=(1, 22)) == ""  # runAsUser joined restricted in 1.23


def test_namespace_labels():
    policy, errors = policy_of({ENFORCE: "restricted"})
    assert (str(policy.enforce), str(policy.warn), str(policy.audit)) == (
        "restricted:latest",
        "restricted:latest",  # warn follows an explicit, stricter enforce
        "privileged:latest",
    )
    policy, _ = policy_of({ENFORCE: "baseline", f"{ENFORCE}-version": "v1.29"})
    assert str(policy.enforce) == str(policy.warn) == "baseline:v1.29"
    _, errors = policy_of({ENFORCE: "strict", "pod-security.kubernetes.io/warn-version": "1.30"})
    assert [(e["field"], e["message"]) for e in errors] == [
        (
            "metadata.labels[pod-security.kubernetes.io/enforce]",
            'Invalid value: "strict": must be one of privileged, baseline, restricted',
        ),
        (
            "metadata.labels[pod-security.kubernetes.io/warn-version]",
            'Invalid value: "1.30": must be "latest" or "v1.x"',
        ),
    ]


def test_what_the_operator_renders_meets_restricted():
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for child in render_object(yaml.safe_load(path.read_text()), owner_uid="u"):
            if child["kind"] == "Deployment":
                template = child["spec"]["template"]
                assert violations(template["spec"], meta=template["metadata"]) == "", (
                    path,
                    child["metadata"]["name"],
                )


def test_the_operators_own_pod_meets_restricted():
    deployment = yaml.safe_load((ROOT / "manifests" / "base" / "deployment.yaml").read_text())
    template = deployment["spec"]["template"]
    assert violations(template["spec"], meta=template["metadata"]) == ""


# --------------------------------------------------------------------------- at the API


@pytest.fixture
def restricted(emu: Emulator, namespace: str) -> str:
    emu.patch(
        f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": {ENFORCE: "restricted"}}}
    ).ok()
    return namespace


def deployment(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


def test_a_violating_pod_is_refused(emu: Emulator, restricted: str):
    bad = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "bad"},
        "spec": spec_with(securityContext={"privileged": True}),
    }
    result = kubectl(emu, "apply", "-n", restricted, "-f", "-", input=json.dumps(bad))
    assert result.returncode != 0
    assert (
        'Error from server (Forbidden): error when creating "STDIN": pods "bad" is forbidden: '
        'violates PodSecurity "restricted:latest": privileged (container "c" must not set '
        "securityContext.privileged=true)"
    ) in result.stderr
    good = emu.post(f"/api/v1/namespaces/{restricted}/pods", {**bad, "spec": GOOD_SPEC})
    assert good.status == 201 and good.warnings == []


def test_a_violating_deployment_is_warned_about_and_gets_no_pods(emu: Emulator, restricted):
    body = deployment("loose", {"containers": [{"name": "c", "image": "x"}]})
    created = emu.post(f"/apis/apps/v1/namespaces/{restricted}/deployments", body)
    assert created.status == 201
    assert len(created.warnings) == 1
    assert created.warnings[0].startswith(
        '299 - "would violate PodSecurity \\"restricted:latest\\": '
        "allowPrivilegeEscalation != false"
    )
    line = procs.wait_for(
        lambda: next(
            (x for x in emu.logs().splitlines() if f"replicasets {restricted}/loose-" in x), None
        ),
        30,
        "the ReplicaSet controller's failed pod create",
        interval=0.05,
    )
    assert 'is forbidden: violates PodSecurity "restricted:latest": ' in line
    assert emu.get(f"/api/v1/namespaces/{restricted}/pods").ok()["items"] == []


def test_the_operators_children_run_in_a_restricted_namespace(emu: Emulator, restricted: str):
    source = yaml.safe_load((ROOT / "examples" / "mixed.yaml").read_text())
    source["metadata"]["name"] = "psa"
    for child in render_object(source, namespace=restricted, owner_uid="u"):
        child["metadata"].pop("ownerReferences", None)  # no InferenceService here
        result = kubectl(emu, "apply", "--server-side", "-f", "-", input=json.dumps(child))
        assert result.returncode == 0, result.stderr
        assert "PodSecurity" not in result.stderr
    pods = procs.wait_for(
        lambda: emu.get(f"/api/v1/namespaces/{restricted}/pods").ok()["items"],
        30,
        "the engine pods",
        interval=0.05,
    )
    assert pods


def test_invalid_labels_are_refused_and_tightening_warns(emu: Emulator, namespace: str):
    refused = emu.patch(
        f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": {ENFORCE: "strict"}}}
    )
    assert (refused.status, refused.body["message"]) == (
        422,
        f'Namespace "{namespace}" is invalid: metadata.labels[pod-security.kubernetes.io/enforce]: '
        'Invalid value: "strict": must be one of privileged, baseline, restricted',
    )
    loose = {
        "apiVersion": "v1",
        "kind": "Pod",
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }
    for name in ("b", "a"):
        emu.post(f"/api/v1/namespaces/{namespace}/pods", {**loose, "metadata": {"name": name}}).ok()
    tightened = emu.patch(
        f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": {ENFORCE: "restricted"}}}
    )
    assert tightened.status == 200
    assert tightened.warnings == [
        f'299 - "existing pods in namespace \\"{namespace}\\" violate the new PodSecurity enforce '
        'level \\"restricted:latest\\""',
        '299 - "a (and 1 other pod): allowPrivilegeEscalation != false, unrestricted capabilities, '
        'runAsNonRoot != true, seccompProfile"',
    ]
