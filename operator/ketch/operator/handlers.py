"""kopf wiring: login, settings, and the watch handlers that feed the controller.

Only event-watching handlers are used: they store nothing on the objects (no finalizers, no
last-handled-configuration annotations), so the operator never writes into an InferenceService
except its ``status`` — what GitOps tools expect — and deleting an InferenceService needs no
running operator (owner references let the garbage collector remove the children).

``make_registry()`` builds a fresh registry (the CLI and tests each run their own).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from ketch.operator import api_names, children
from ketch.operator.controller import Controller
from ketch.operator.kube import KubeClient
from ketch.operator.labels import LABEL_MANAGED_BY, MANAGER
from ketch.operator.metrics import OperatorMetrics, start_http

logger = logging.getLogger("ketch.operator")

# What kopf watches besides InferenceServices (label-selected): the watched child kinds
# (``children.WATCHED``; the others' CRDs may be missing, and a kopf watch of a resource that is
# not served fails for ever) and the children's pods.
WATCHED_RESOURCES = (*((k.api_version, k.plural) for k in children.WATCHED), ("v1", "pods"))


# A status change that only moves a rollout along waits this long for the next one, so that a
# new InferenceService whose pods start at once is written once, Ready (``status_patch``).
STATUS_HOLD_SECONDS = 1.0


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf keeps a "last handled" copy of every object for change handlers. This operator has
    none (it is level-triggered), so it keeps nothing: no deep copy of every watched object on
    every event (a seventh of its CPU in a burst), and certainly no annotation written back."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: Any) -> Any:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


def connection_info(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """In a pod: the service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings
    )
    if info is None:
        raise kopf.LoginError(
            "no Kubernetes credentials: run in a pod with a service account, or set KUBECONFIG"
        )
    return info


def make_registry(
    *,
    metrics_port: int | None = None,
    metrics_host: str = "0.0.0.0",
    resync_seconds: float = 300.0,
    status_hold_seconds: float = STATUS_HOLD_SECONDS,
    on_controller: Any = None,
) -> kopf.OperatorRegistry:
    """A kopf registry with the operator's handlers. ``on_controller(controller)`` is called once
    the controller exists (tests and the benchmark use it to wait for idleness).
    ``status_hold_seconds``: see ``status_patch`` (progress waits, settled states do not)."""
    registry = kopf.OperatorRegistry()
    state: dict[str, Any] = {}

    @kopf.on.login(registry=registry)
    def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
        return connection_info(settings)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.scanning.disabled = (
            True  # no cluster-wide CRD/namespace watching: fewer RBAC rights
        )
        settings.posting.level = logging.WARNING
        settings.persistence.diffbase_storage = NoDiffBase()
        # kopf logs every handled event at INFO; the controller logs what it did instead.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.watching.reconnect_backoff = 1.0
        settings.networking.error_backoffs = [1, 2, 5]
        metrics = OperatorMetrics()
        client = KubeClient(connection_info(settings), relogin=lambda: connection_info(settings))
        controller = Controller(
            client, metrics, resync_seconds=resync_seconds, status_hold=status_hold_seconds
        )
        controller.start()
        state["controller"] = controller
        if metrics_port is not None:

            def healthy() -> tuple[bool, str]:
                error = controller.last_api_error
                return (True, "ok") if error is None else (True, f"last API error: {error}")

            state["http"] = await start_http(metrics, metrics_host, metrics_port, healthy)
        if on_controller is not None:
            on_controller(controller)
        logger.info("ketch-operator started (resync every %.0f s)", resync_seconds)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        controller: Controller | None = state.pop("controller", None)
        if controller is not None:
            await controller.stop()
            await controller.client.close()
        http = state.pop("http", None)
        if http is not None:
            await http.cleanup()

    @kopf.on.event(
        group=api_names.GROUP, version=api_names.VERSION, plural=api_names.PLURAL, registry=registry
    )
    async def service_event(event: dict[str, Any], **_: Any) -> None:
        controller = await _controller(state)
        controller.on_service_event(event.get("type") or "MODIFIED", event["object"])

    managed = {LABEL_MANAGED_BY: MANAGER}
    for api_version, plural in WATCHED_RESOURCES:
        group, _, version = api_version.rpartition("/")

        @kopf.on.event(
            group=group, version=version, plural=plural, labels=managed, registry=registry
        )
        async def child_event(event: dict[str, Any], **_: Any) -> None:
            controller = await _controller(state)
            controller.on_child_event(event.get("type") or "MODIFIED", event["object"])

    return registry


async def _controller(state: dict[str, Any]) -> Controller:
    while "controller" not in state:  # events can race the start-up handler
        await asyncio.sleep(0.01)
    return state["controller"]


def metrics_port_from_env() -> int | None:
    value = os.environ.get("KETCH_OPERATOR_METRICS_PORT")
    return int(value) if value else None
