"""``POST /pause`` and ``POST /resume``: admission control. Paused, the server refuses new
requests with 503 and lets those in flight finish; both need the admin key
(``admission.check_control_access``, applied by ``api_server``'s middleware)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ketch.engine.serving.state import serving_state

router = APIRouter()


@router.post("/pause")
async def _pause(request: Request) -> JSONResponse:
    state = serving_state(request)
    state.paused = True
    return JSONResponse({"paused": True, "in_flight": state.in_flight})


@router.post("/resume")
async def _resume(request: Request) -> JSONResponse:
    state = serving_state(request)
    state.paused = False
    return JSONResponse({"paused": False, "in_flight": state.in_flight})
