"""What the router takes from a client before it forwards anything, and how it refuses.

A body is read with a bound on its size and on the time the client takes to send it, so one
client cannot make the router buffer without limit or hold a request open by trickling bytes.
Nothing here parses JSON: the instances validate bodies. A refusal is OpenAI's error shape.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect, Request


class Refused(Exception):
    """A request the router answers itself, with an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body, refused (413) past ``limit`` bytes — by its Content-Length before any
    of it is read, else as soon as it grows past — or (408) when not in within ``timeout``."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise _too_large(limit)
    except TimeoutError:
        message = f"the request body did not arrive within {timeout:g} s (--body-timeout)"
        raise Refused(408, message) from None
    except ClientDisconnect:
        raise Refused(400, "the client went away while sending its body") from None
    return bytes(body)


def _too_large(limit: int) -> Refused:
    return Refused(413, f"request body is larger than {limit} bytes (--max-request-bytes)")


def error_response(
    status: int, message: str, kind: str = "server_error", headers: dict[str, str] | None = None
) -> JSONResponse:
    """OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    extra = {"Retry-After": "1"} if status in (429, 503) else {}
    return JSONResponse(body, status_code=status, headers={**extra, **(headers or {})})


def refused_response(refused: Refused) -> JSONResponse:
    """A client error the router answers itself. A slow sender's connection is closed: it
    would otherwise stay open for as long as the client keeps trickling bytes."""
    headers = {}
    if refused.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if refused.status == 408:
        headers["Connection"] = "close"
    return error_response(refused.status, refused.message, refused.kind, headers)
