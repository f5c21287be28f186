"""The operator's own Prometheus metrics and its /healthz, on one small HTTP server."""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

logger = logging.getLogger("ketch.operator")


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "ketch_operator_reconciles",
            "Reconciles by kind: full (spec applied), drift (children restored), status.",
            ["kind"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "ketch_operator_reconcile_duration_seconds",
            "Time of one reconcile, by kind.",
            ["kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.errors = Counter(
            "ketch_operator_reconcile_errors",
            "Failed reconciles by reason (InvalidSpec, ApiError, Conflict, Internal, ...).",
            ["reason"],
            registry=self.registry,
        )
        self.applies = Counter(
            "ketch_operator_applies",
            "Server-side applies of children, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.restored = Counter(
            "ketch_operator_children_restored",
            "Children put back after being edited or deleted by hand, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.services = Gauge(
            "ketch_operator_inferenceservices",
            "InferenceServices the operator currently tracks.",
            registry=self.registry,
        )
        self.started = time.time()

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def start_http(metrics: OperatorMetrics, host: str, port: int, healthy: Any) -> web.AppRunner:
    """Serves /metrics and /healthz (200 while ``healthy()`` is true)."""

    async def metrics_view(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health_view(_: web.Request) -> web.Response:
        ok, detail = healthy()
        return web.json_response({"ok": ok, "detail": detail}, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", health_view)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    logger.info("metrics and health on http://%s:%d (/metrics, /healthz)", host, port)
    return runner
