"""Registration: instances that add themselves to the router (``POST/DELETE
/v1/ketch/register``), off unless ``--registration`` or ``--registration-only``.

A registered instance receives clients' requests, Authorization headers included, so
registration needs a bearer token (``--registration-token-file`` or ``TOKEN_ENV``), checked
before the body is read and compared as bytes in constant time. The URL must be a plain
``http(s)://host:port`` (``config.normalise_url``): nothing that could steer requests elsewhere.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ketch.engine.router.admission import Refused, error_response, read_body, refused_response
from ketch.engine.router.config import RouterConfig
from ketch.engine.router.instances import Registry, RegistryFull

TOKEN_ENV = "KETCH_ROUTER_REGISTRATION_TOKEN"
_MAX_BYTES = 64 * 1024  # a registration is one small JSON object


def registration_routes(config: RouterConfig, registry: Registry, token: str | None) -> APIRouter:
    """The two endpoints; with ``token`` None they refuse every request."""
    routes = APIRouter()

    @routes.post("/v1/ketch/register")
    async def register(request: Request) -> JSONResponse:
        try:
            data = await _registration(config, token, request)
            inst = registry.register(_text(data, "url"), _text(data, "role", "mixed"))
        except Refused as exc:
            return refused_response(exc)
        except RegistryFull as exc:
            return error_response(503, f"{exc}; unregister one first", "server_error")
        except ValueError as exc:
            message = f'register needs JSON {{"url": "http://host:port", "role": ...}}: {exc}'
            return error_response(400, message, "invalid_request_error")
        return JSONResponse({"registered": inst.to_json(), "ttl": config.registration_ttl})

    @routes.delete("/v1/ketch/register")
    async def unregister(request: Request) -> JSONResponse:
        try:
            data = await _registration(config, token, request)
            removed = registry.unregister(_text(data, "url"))
        except Refused as exc:
            return refused_response(exc)
        except ValueError as exc:
            message = f'unregister needs JSON {{"url": "http://host:port"}}: {exc}'
            return error_response(400, message, "invalid_request_error")
        return JSONResponse({"removed": removed})

    return routes


async def _registration(
    config: RouterConfig, token: str | None, request: Request
) -> dict[str, Any]:
    """The JSON object of an allowed (un)registration; Refused when registration is off, the
    token is missing or wrong (checked before the body is read), or the body is no object."""
    if not (config.registration or config.registration_only):
        message = "registration is off on this router; start it with --registration to allow it"
        raise Refused(403, message, "permission_error")
    if token is None:
        raise Refused(403, "registration has no token on this router", "permission_error")
    check_token(request, token)
    body = await read_body(request, _MAX_BYTES, config.body_timeout)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise Refused(400, f"the body is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise Refused(400, 'the body must be a JSON object: {"url": "http://host:port"}')
    return data


def _text(data: dict[str, Any], key: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if value is None:
        raise ValueError(f"missing {key!r}")
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {type(value).__name__}")
    return value


def read_registration_token(config: RouterConfig, environ: Mapping[str, str]) -> str | None:
    """The registration token from ``--registration-token-file`` or ``TOKEN_ENV``; None when
    registration is off. Registration on without a token is a ValueError: anyone reaching
    the port could otherwise add a backend that receives clients' requests."""
    if not (config.registration or config.registration_only):
        return None
    if config.registration_token_file:
        where = f"--registration-token-file {config.registration_token_file}"
        token = _read_token_file(Path(config.registration_token_file), where)
    else:
        where, token = TOKEN_ENV, environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise ValueError(
                "--registration needs a token: give --registration-token-file FILE or set "
                f"{TOKEN_ENV}; instances then register with 'Authorization: Bearer <token>'"
            )
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise ValueError(f"{where}: the token must be printable ASCII without spaces")
    return token


def _read_token_file(path: Path, where: str) -> str:
    if not path.is_file():
        raise ValueError(f"{where} does not exist")
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} cannot be read: {exc}") from exc
    if not token:
        raise ValueError(f"{where} is empty")
    return token


def check_token(request: Request, token: str) -> None:
    """Refuses (401) a missing or malformed ``Authorization: Bearer``, (403) a wrong token."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given or not given.isascii():
        message = "registration needs 'Authorization: Bearer <token>' (the router's token)"
        raise Refused(401, message, "authentication_error")
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise Refused(403, "wrong registration token", "permission_error")


def check_listing_access(request: Request, token: str | None, admin_key: str | None) -> None:
    """``GET /v1/ketch/instances``: the router's admin key (written into its run directory,
    for ``kubectl exec``) or the registration token when it has one; 401/403 for anyone else.
    Where the client connects from proves nothing: behind a same-pod proxy or a service-mesh
    sidecar every client is loopback."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given or not given.isascii():
        message = (
            "/v1/ketch/instances needs 'Authorization: Bearer <key>': the router's admin key "
            "(router-admin-key-<port> in its run directory) or its registration token"
        )
        raise Refused(401, message, "authentication_error")
    for key in (admin_key, token):
        if key is not None and hmac.compare_digest(given.encode(), key.encode()):
            return
    raise Refused(403, "wrong key for /v1/ketch/instances", "permission_error")
