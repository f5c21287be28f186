"""spec.gateway: the GAIE children the builders render (InferencePool, HTTPRoute, the router as
endpoint picker), the GatewayReady condition computed from a pool's status, and bad gateway
sections refused, by the operator's own parse and by the real API server (the committed CRD)."""

from __future__ import annotations

import copy

import pytest
import yaml
from test_builders import ROOT, UID, children, example, invalid_body

from ketch.operator import api_names, gateway
from ketch.operator.cli import render_object
from ketch.operator.spec.parse import InvalidSpec, parse

GATEWAY = {"gatewayRef": {"name": "inference-gateway"}, "hostnames": ["llm.example.com"]}


def with_gateway(name: str = "mixed", section: dict | None = None) -> dict:
    body = example(name)
    body["spec"]["gateway"] = copy.deepcopy(GATEWAY if section is None else section)
    return body


def router_yaml(kids: dict) -> dict:
    config_map = next(v for (k, _), v in kids.items() if k == "ConfigMap")
    return yaml.safe_load(config_map["data"]["router.yaml"])


# --------------------------------------------------------------------------- builders


def test_mixed_with_gateway_renders_pool_route_and_router_as_picker():
    body = with_gateway()
    name = body["metadata"]["name"]
    kids = children(body)
    pool = kids[("InferencePool", name)]
    deployment = kids[("Deployment", f"{name}-mixed")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"] == {
        "matchLabels": deployment["spec"]["selector"]["matchLabels"]
    }
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": f"{name}-router",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert [o["uid"] for o in pool["metadata"]["ownerReferences"]] == [UID]
    service = kids[("Service", f"{name}-router")]
    epp = next(p for p in service["spec"]["ports"] if p["name"] == "grpc-epp")
    assert epp == {
        "name": "grpc-epp",
        "port": 9002,
        "targetPort": "grpc-epp",
        "protocol": "TCP",
        "appProtocol": "kubernetes.io/h2c",
    }
    router = kids[("Deployment", f"{name}-router")]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][-2:] == ["--epp-port", "9002"]
    assert {"name": "grpc-epp", "containerPort": 9002, "protocol": "TCP"} in router["ports"]
    assert router["readinessProbe"]["tcpSocket"] == {"port": "grpc-epp"}
    assert router_yaml(kids)["mixed"] == f"{name}-mixed-peers.default.svc"
    assert "prefill" not in router_yaml(kids)
    policy = kids[("NetworkPolicy", name)]["spec"]["ingress"][-1]["ports"]
    assert {"port": 9002, "protocol": "TCP"} in policy
    route = kids[("HTTPRoute", name)]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"] == {
        "parentRefs": [
            {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway"}
        ],
        "hostnames": ["llm.example.com"],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [
                    {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": name}
                ],
            }
        ],
    }


def test_disaggregated_pool_selects_decode_pods_only():
    body = with_gateway("disaggregated", {"inferencePool": {"failureMode": "FailOpen"}})
    name = body["metadata"]["name"]
    kids = children(body)
    pool = kids[("InferencePool", name)]
    decode = kids[("Deployment", f"{name}-decode")]["spec"]["selector"]["matchLabels"]
    prefill = kids[("Deployment", f"{name}-prefill")]["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["selector"]["matchLabels"] == decode != prefill
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert ("HTTPRoute", name) not in kids  # no gatewayRef: bring your own route
    assert "decode" in router_yaml(kids) and "mixed" not in router_yaml(kids)


def test_without_gateway_nothing_changes():
    body = example("mixed")
    kids = children(body)
    assert not {k for k, _ in kids} & {"InferencePool", "HTTPRoute"}
    assert not [n for k, n in kids if n.endswith("-router")]
    disaggregated = children(example("disaggregated"))
    router = disaggregated[("Deployment", "qwen-pd-router")]["spec"]["template"]["spec"]
    assert "--epp-port" not in router["containers"][0]["args"]
    assert router["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_gateway_ref_namespace_section_and_path_go_to_the_route():
    section = {
        "gatewayRef": {"name": "gw", "namespace": "infra", "sectionName": "https"},
        "path": "/v1",
        "inferencePool": {"eppPort": 9100},
    }
    body = with_gateway(section=section)
    kids = children(body)
    route = kids[("HTTPRoute", "tiny")]["spec"]
    assert route["parentRefs"][0] == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": "gw",
        "namespace": "infra",
        "sectionName": "https",
    }
    assert "hostnames" not in route
    assert route["rules"][0]["matches"][0]["path"]["value"] == "/v1"
    assert kids[("InferencePool", "tiny")]["spec"]["endpointPickerRef"]["port"] == {"number": 9100}


def test_another_endpoint_picker_replaces_the_router_as_picker():
    picker = {"serviceName": "llm-d-epp", "port": 9002}
    section = {"inferencePool": {"endpointPicker": picker}}
    kids = children(with_gateway(section=section))
    ref = kids[("InferencePool", "tiny")]["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"]) == ("llm-d-epp", {"number": 9002})
    assert not [n for _, n in kids if n.endswith("-router")]  # mixed: no router at all
    assert "router.yaml" not in kids[("ConfigMap", "tiny-config")]["data"]
    pd = children(with_gateway("disaggregated", section))
    router = pd[("Deployment", "qwen-pd-router")]["spec"]["template"]["spec"]["containers"][0]
    assert "--epp-port" not in router["args"]  # it still fronts the HTTP API
    ports = [p["name"] for p in pd[("Service", "qwen-pd-router")]["spec"]["ports"]]
    assert ports == ["http"]


def test_render_is_deterministic():
    body = with_gateway()
    assert render_object(copy.deepcopy(body), owner_uid=UID) == render_object(body, owner_uid=UID)


# --------------------------------------------------------------------------- condition


def svc_with_gateway():
    return parse({**with_gateway(), "metadata": {"name": "gw", "namespace": "ns", "uid": UID}})


def parent(name: str, **conditions: tuple[str, str]) -> dict:
    return {
        "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": name},
        "controllerName": "example.net/gateway",
        "conditions": [
            {"type": t, "status": s, "reason": r, "message": f"{t} {r}"}
            for t, (s, r) in conditions.items()
        ],
    }


def test_condition_follows_the_pools_parents():
    svc = svc_with_gateway()

    def cond(pool, unserved=()):
        return gateway.condition(svc, pool, set(unserved), 3)

    assert cond(None, {"InferencePool"})["reason"] == "InferencePoolCRDMissing"
    assert (
        "install the Gateway API Inference Extension CRDs"
        in cond(None, {"InferencePool"})["message"]
    )
    assert cond(None, {"HTTPRoute"})["reason"] == "HTTPRouteCRDMissing"
    assert cond(None)["reason"] == "Pending"
    assert cond({"status": {}})["reason"] == "NotAccepted"
    placeholder = {"parentRef": {"kind": "Status", "name": "default"}, "conditions": []}
    assert cond({"status": {"parents": [placeholder]}})["status"] == "False"
    good = parent("a", Accepted=("True", "Accepted"), ResolvedRefs=("True", "ResolvedRefs"))
    ok = cond({"status": {"parents": [good]}})
    assert (ok["status"], ok["reason"], ok["observedGeneration"]) == ("True", "Accepted", 3)
    broken = parent("b", Accepted=("True", "Accepted"), ResolvedRefs=("False", "InvalidExtRef"))
    bad = cond({"status": {"parents": [good, broken]}})
    assert (bad["status"], bad["reason"]) == ("False", "InvalidExtRef")
    assert bad["message"] == "gateway b: ResolvedRefs: ResolvedRefs InvalidExtRef"
    missing = cond({"status": {"parents": [parent("c", Accepted=("True", "Accepted"))]}})
    assert (missing["status"], missing["reason"]) == ("False", "ResolvedRefsUnknown")
    junk = cond({"status": {"parents": ["x", {"parentRef": None, "conditions": [1]}]}})
    assert junk["status"] == "False"  # hostile status: no exception
    plain = parse({**example("mixed"), "metadata": {"name": "m", "uid": UID}})
    assert gateway.condition(plain, None, set(), 1) is None


# --------------------------------------------------------------------------- validation

BAD_SECTIONS = [
    ("failure mode", {"inferencePool": {"failureMode": "FailSometimes"}}, "failureMode"),
    ("epp port 0", {"inferencePool": {"eppPort": 0}}, "eppPort"),
    ("epp port 65536", {"inferencePool": {"eppPort": 65536}}, "eppPort"),
    ("epp port huge", {"inferencePool": {"eppPort": 2**62}}, "eppPort"),
    ("epp port string", {"inferencePool": {"eppPort": "9002"}}, "eppPort"),
    ("epp port = http", {"inferencePool": {"eppPort": 8000}}, "eppPort"),
    ("gateway a list", [], "gateway"),
    ("unknown key", {"inferencePool": {"deep": {"deeper": {"deepest": 1}}}}, "deep"),
    ("ref without name", {"gatewayRef": {"namespace": "infra"}}, "name"),
    ("ref bad name", {"gatewayRef": {"name": "Not_A_Name"}}, "name"),
    ("ref long name", {"gatewayRef": {"name": "a" * 254}}, "name"),
    ("ref bad namespace", {"gatewayRef": {"name": "g", "namespace": "a" * 64}}, "namespace"),
    ("hostnames no ref", {"hostnames": ["llm.example.com"]}, "hostnames"),
    (
        "hostnames many",
        {**GATEWAY, "hostnames": [f"h{i}.example.com" for i in range(17)]},
        "hostnames",
    ),
    ("hostname bad", {**GATEWAY, "hostnames": ["bad host"]}, "hostnames"),
    ("hostnames repeated", {**GATEWAY, "hostnames": ["a.example.com"] * 2}, "hostnames"),
    ("picker without port", {"inferencePool": {"endpointPicker": {"serviceName": "e"}}}, "port"),
    (
        "picker bad name",
        {"inferencePool": {"endpointPicker": {"serviceName": "E.p", "port": 1}}},
        "serviceName",
    ),
    ("path relative", {**GATEWAY, "path": "v1"}, "path"),
    ("path long", {**GATEWAY, "path": "/" + "a" * 1024}, "path"),
]


# A list-type set's duplicates are refused by the API server only (the schema says "set").
PARSE_REFUSES = [c for c in BAD_SECTIONS if c[0] != "hostnames repeated"]


@pytest.mark.parametrize(
    ("case", "section", "says"), PARSE_REFUSES, ids=[c[0] for c in PARSE_REFUSES]
)
def test_parse_refuses_a_bad_gateway_section(case, section, says):
    body = invalid_body({"gateway": section})
    body["metadata"]["uid"] = UID
    with pytest.raises(InvalidSpec) as refused:
        parse(body)
    assert says in str(refused.value)


@pytest.fixture(scope="module")
def installed(kube):
    """The committed CRD (the session's cluster applied it; again, in case it is older)."""
    from kubecluster import kubectl

    path = ROOT / "crds" / f"{api_names.CRD_NAME}.yaml"
    kubectl(kube, "apply", "--server-side", "--force-conflicts", "-f", str(path), check=True)
    return kube


@pytest.mark.parametrize(
    ("case", "section", "says"), BAD_SECTIONS, ids=[c[0] for c in BAD_SECTIONS]
)
def test_the_api_server_refuses_a_bad_gateway_section(installed, case, section, says):
    body = invalid_body({"gateway": section})
    body["metadata"]["name"] = "bad-gateway"
    # Strict, as kubectl sends: an unknown field is refused (400), not dropped.
    path = f"/apis/{api_names.API_VERSION}/namespaces/default/{api_names.PLURAL}"
    refused = installed.post(f"{path}?dryRun=All&fieldValidation=Strict", body)
    assert refused.status in (400, 422), refused.body
    if refused.status == 400:
        said = refused.body["message"]
    else:
        causes = refused.body["details"]["causes"]
        said = " ".join(f"{c.get('field')} {c.get('message')}" for c in causes)
    assert "spec.gateway" in said and says in said, said


def test_the_api_server_takes_a_good_gateway_section_and_defaults_it(installed):
    body = with_gateway()
    body["metadata"]["name"] = "good-gateway"
    path = f"/apis/{api_names.API_VERSION}/namespaces/default/{api_names.PLURAL}?dryRun=All"
    taken = installed.post(path, body).ok()
    assert taken["spec"]["gateway"] == {
        **GATEWAY,
        "inferencePool": {"failureMode": "FailClose", "eppPort": 9002},
        "path": "/",
    }


@pytest.mark.parametrize("name", ["mixed", "disaggregated"])
def test_rendered_gateway_children_are_wired(name):
    """The router's --epp-port goes through the real 'ketch router' parser and config; its
    listener matches the container port, the Service port and the readiness probe."""
    from ketch.operator.wiring import check_wiring

    rendered = render_object(with_gateway(name), owner_uid=UID)
    assert check_wiring(rendered) == []
    broken = copy.deepcopy(rendered)
    router = next(
        c for c in broken if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("router")
    )
    container = router["spec"]["template"]["spec"]["containers"][0]
    container["args"][-1] = "9003"  # the process listens where nothing is declared
    assert check_wiring(broken) != []


def test_kubectl_explain_describes_the_gateway_section(installed):
    import procs
    from kubecluster import kubectl

    def explain(field: str) -> str:
        result = kubectl(installed, "explain", field)
        return " ".join(result.stdout.split()) if result.returncode == 0 else ""

    said = procs.wait_for(
        lambda: explain("kisvc.spec.gateway.inferencePool.failureMode"), 30, "kubectl explain"
    )
    assert "FailClose (the default, as in GAIE) rejects the request" in said
    assert "FailOpen" in said
    said = explain("kisvc.spec.gateway")
    for field in ("inferencePool", "gatewayRef", "hostnames", "path"):
        assert field in said
    assert "Gateway API Inference Extension" in said
