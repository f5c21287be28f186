"""``GET /metrics``: the Prometheus exposition of ``EngineMetrics`` (no API key needed)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ketch.engine.serving.state import serving_state

router = APIRouter()


@router.get("/metrics")
async def _metrics(request: Request) -> Response:
    body, content_type = serving_state(request).metrics.render()
    return Response(body, media_type=content_type)
