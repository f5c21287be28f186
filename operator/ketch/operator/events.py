"""Kubernetes Events on an InferenceService: what the operator did, and why it could not.

Events are best effort: one that cannot be posted is logged at debug level, never retried, and
never fails the reconcile that wanted it.
"""

from __future__ import annotations

import logging
import os
import socket

from ketch.operator import api_names
from ketch.operator import status as status_mod
from ketch.operator.cache import Obj
from ketch.operator.kube import ApiError, KubeClient

logger = logging.getLogger("ketch.operator")


class EventRecorder:
    """Posts core/v1 Events about InferenceServices, as this operator process."""

    def __init__(self, client: KubeClient, reporter: str | None = None):
        self.client = client
        self.reporter = reporter or f"{socket.gethostname()}-{os.getpid()}"

    async def post(self, body: Obj, kind: str, reason: str, message: str) -> None:
        """An Event of type ``kind`` (Normal, Warning) on the InferenceService ``body``."""
        meta = body["metadata"]
        stamp = status_mod.now()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": api_names.API_VERSION,
                "kind": api_names.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": "ketch-operator"},
            "reportingComponent": "ketch-operator",
            "reportingInstance": self.reporter,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            await self.client.post("Event", meta["namespace"], event)
        except (TimeoutError, ApiError, OSError) as exc:
            logger.debug("could not post event %s: %s", reason, exc)
