"""Container and Service port names of the pods the operator runs (at most 15 characters,
DNS-label style): Services, probes and NetworkPolicies name ports by these. The port numbers
are the spec's (``spec.ports``, generated from the engine's ``ServerConfig``).

A leaf, like ``api_names`` and ``labels``.
"""

from __future__ import annotations

PORT_HTTP = "http"  # the engine's and the router's OpenAI-compatible API
PORT_METRICS = "metrics"  # the engine's /metrics, when spec.ports.metrics is set
PORT_PD_COMM = "pd-comm"  # prefill/decode engines: decode engines connect to prefill engines
PORT_KV_TRANSFER = "kv-transfer"  # prefill/decode sidecars: prefill sidecars push KV blocks
PORT_CM_HTTP = "cm-http"  # the cache-manager sidecar's /health and /metrics
EPP_PORT_NAME = "grpc-epp"  # the router as a gateway's endpoint picker (gRPC ext_proc)
EPP_APP_PROTOCOL = "kubernetes.io/h2c"  # gRPC without TLS, as GAIE's endpoint pickers serve it
