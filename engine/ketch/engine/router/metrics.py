"""The router's own Prometheus metrics, in a registry of their own (``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ketch.engine.router.instances import Registry

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RouterMetrics:
    """Counters the proxy bumps, plus instance gauges refreshed from the registry on scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "ketch_router_requests",
            "Requests answered, by instance and upstream status code ('none': no instance).",
            ["instance", "status_code"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "ketch_router_upstream_errors",
            "Failures talking to an instance (connect errors, broken streams).",
            ["instance"],
            registry=r,
        )
        self.in_flight = Gauge(
            "ketch_router_requests_in_flight", "Requests the router is forwarding now.", registry=r
        )
        self.seconds = Histogram(
            "ketch_router_request_seconds",
            "Seconds from a request's arrival to the end of its response.",
            buckets=_SECONDS,
            registry=r,
        )
        self.prefix_matches = Counter(
            "ketch_router_prefix_matches",
            "prefix-hash: requests sent to the instance already holding their prompt prefix.",
            registry=r,
        )
        self.instance_healthy = Gauge(
            "ketch_router_instance_healthy",
            "1 when the instance is in rotation, 0 when not.",
            ["instance", "role"],
            registry=r,
        )
        self.instances = Gauge(
            "ketch_router_instances", "Known instances by role and state.", ["role", "state"],
            registry=r,
        )  # fmt: skip

    def render(self, instances: Registry) -> tuple[bytes, str]:
        self.instance_healthy.clear()
        self.instances.clear()
        counts: dict[tuple[str, str], int] = {}
        for inst in instances.instances.values():
            self.instance_healthy.labels(inst.url, inst.role).set(1 if inst.healthy else 0)
            state = "healthy" if inst.healthy else "unhealthy"
            counts[(inst.role, state)] = counts.get((inst.role, state), 0) + 1
        for role in ("mixed", "prefill", "decode"):
            for state in ("healthy", "unhealthy"):
                self.instances.labels(role, state).set(counts.get((role, state), 0))
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
