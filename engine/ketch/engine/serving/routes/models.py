"""``GET /v1/models``: the one model this server serves, under its served name."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ketch.engine.serving import responses as R
from ketch.engine.serving.state import serving_state

router = APIRouter()


@router.get("/v1/models")
async def _models(request: Request) -> JSONResponse:
    return JSONResponse(R.models_response([serving_state(request).model_name]))
