"""``spec.gateway`` of the InferenceService CRD: serving behind a Gateway API Inference Extension
(GAIE) gateway. The operator then renders an ``InferencePool`` (``inference.networking.k8s.io/v1``)
whose endpoint picker is the Ketch router's ext_proc port, and with ``gatewayRef`` an
``HTTPRoute`` from that Gateway to the pool (``gateway``, ``docs/gateway.md``).
"""

from __future__ import annotations

from typing import Any

from ketch.operator.crd.schema import integer, obj, string

FAILURE_MODES = ("FailOpen", "FailClose")
DEFAULT_EPP_PORT = 9002
MAX_HOSTNAMES = 16
# Gateway API's own patterns (an RFC 1123 subdomain; a hostname, '*.' wildcard allowed).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
HOSTNAME = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
PATH_PATTERN = r"^/[A-Za-z0-9/\-._~%!$&'()*+,;=:@]*$"

EPP_PORT_CLASHES = "gateway.inferencePool.eppPort must differ from ports.http (the router's API)"


def _inference_pool() -> dict[str, Any]:
    return obj(
        "The InferencePool the operator renders (named after the InferenceService): it selects "
        "the pods a gateway may send requests to (mixed pods, or decode pods when "
        "disaggregated) and names the Ketch router's ext_proc port as its endpoint picker.",
        {
            "failureMode": string(
                "What the gateway does when the endpoint picker does not answer: FailClose "
                "(the default, as in GAIE) rejects the request, FailOpen sends it to a pod of "
                "the pool the gateway picks itself.",
                default="FailClose",
                enum=list(FAILURE_MODES),
            ),
            "eppPort": integer(
                "Port of the router's endpoint picker (gRPC ext_proc, with gRPC health services "
                "'liveness' and 'readiness'): 'ketch router --epp-port', and the router "
                "Service's port 'grpc-epp'.",
                default=DEFAULT_EPP_PORT,
                minimum=1,
                maximum=65535,
            ),
            "endpointPicker": obj(
                "Another endpoint picker instead of the Ketch router: a Service in this "
                "namespace, e.g. GAIE's reference picker or llm-d's inference scheduler, which "
                "read the engines' vLLM-compatible metrics (vllm:num_requests_waiting, "
                "vllm:num_requests_running, vllm:kv_cache_usage_perc). The router is then not "
                "the picker (and not run at all in mixed mode); eppPort is unused.",
                {
                    "serviceName": string(
                        "Name of the picker's Service.",
                        minLength=1,
                        maxLength=63,
                        pattern=DNS_LABEL,
                    ),
                    "port": integer("The Service's gRPC ext_proc port.", minimum=1, maximum=65535),
                },
                required=("serviceName", "port"),
            ),
        },
        default={},
    )


def _gateway_ref() -> dict[str, Any]:
    return obj(
        "The Gateway to attach to: the operator then renders an HTTPRoute (named after the "
        "InferenceService) whose parent is this Gateway and whose backend is the InferencePool. "
        "Without it no HTTPRoute is rendered (bring your own, with the InferencePool as "
        "backendRef).",
        {
            "name": string(
                "Name of the Gateway.", minLength=1, maxLength=253, pattern=DNS_SUBDOMAIN
            ),
            "namespace": string(
                "Namespace of the Gateway; default: the InferenceService's. A Gateway in "
                "another namespace must allow routes from this one (its listeners' "
                "allowedRoutes).",
                minLength=1,
                maxLength=63,
                pattern=DNS_LABEL,
            ),
            "sectionName": string(
                "A listener of the Gateway (its name); default: every listener that allows "
                "the route.",
                minLength=1,
                maxLength=253,
                pattern=DNS_SUBDOMAIN,
            ),
        },
        required=("name",),
    )


def gateway_schema() -> dict[str, Any]:
    return obj(
        "Serve behind a Gateway API Inference Extension (GAIE) gateway: the operator renders an "
        "InferencePool, runs the router as its endpoint picker (in mixed mode too), and with "
        "gatewayRef an HTTPRoute. Needs the GAIE CRDs (inference.networking.k8s.io) and, for "
        "gatewayRef, Gateway API's; without them the GatewayReady condition says so and "
        "everything else is still served. See docs/gateway.md.",
        {
            "inferencePool": _inference_pool(),
            "gatewayRef": _gateway_ref(),
            "hostnames": {
                "type": "array",
                "description": "Hostnames the HTTPRoute matches (HTTPRoute spec.hostnames; "
                "'*.' wildcards allowed); default: every hostname of the Gateway's listeners. "
                "Needs gatewayRef.",
                "items": {
                    "type": "string",
                    "description": "A hostname, e.g. llm.example.com or *.example.com.",
                    "minLength": 1,
                    "maxLength": 253,
                    "pattern": HOSTNAME,
                },
                "maxItems": MAX_HOSTNAMES,
                "x-kubernetes-list-type": "set",
            },
            "path": string(
                "Path prefix the HTTPRoute matches (a PathPrefix match); default '/'. Needs "
                "gatewayRef.",
                default="/",
                minLength=1,
                maxLength=1024,
                pattern=PATH_PATTERN,
            ),
        },
        rules=(
            (
                "!has(self.hostnames) || has(self.gatewayRef)",
                "gateway.hostnames needs gateway.gatewayRef: they are the HTTPRoute's, and "
                "without gatewayRef no HTTPRoute is rendered",
                ".hostnames",
            ),
        ),
    )


# The rule on spec (it reads spec.ports): see crd.spec.spec_schema.
EPP_PORT_RULE = (
    "!has(self.gateway) || self.gateway.inferencePool.eppPort != self.ports.http",
    EPP_PORT_CLASHES,
    ".gateway.inferencePool.eppPort",
)
