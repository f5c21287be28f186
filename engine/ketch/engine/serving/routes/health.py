"""``GET /health`` (liveness: the engine process runs) and ``GET /ready`` (readiness: it runs,
the server is neither draining nor paused, and a prefill or decode instance has its cache
manager attached). Both answer without an API key (``api_server``'s open paths)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ketch.engine.serving.state import serving_state

router = APIRouter()


@router.get("/health")
async def _health(request: Request) -> JSONResponse:
    state = serving_state(request)
    if state.engine.is_alive:
        return JSONResponse({"status": "ok"})
    reason = state.engine.dead_reason or "the engine process is not running"
    return JSONResponse({"status": "unhealthy", "detail": reason}, status_code=503)


@router.get("/ready")
async def _ready(request: Request) -> JSONResponse:
    state = serving_state(request)
    problems = []
    if not state.engine.is_alive:
        problems.append("engine not running")
    if state.draining:
        problems.append("draining")
    if state.paused:
        problems.append("paused")
    snapshot = state.engine.last_snapshot
    attached = snapshot is not None and snapshot.cache_manager_attached
    config = state.config
    if config.role != "mixed" and not attached:
        problems.append("cache manager not attached (the KV transfer needs it)")
    detail = {
        "ready": not problems,
        "problems": problems,
        "model": state.model_name,
        "role": config.role,
        "cache_manager": "attached"
        if attached
        else "not attached (no host swap space, no KV transfer)",
    }
    if config.role != "mixed":
        detail.update(pd_comm_port=config.pd_comm_port, kv_transfer_port=config.kv_transfer_port)
    return JSONResponse(detail, status_code=200 if not problems else 503)
