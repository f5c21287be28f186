"""The HTTP side of the emulator's handlers: JSON and Status responses, Warning headers, the
request body (JSON, YAML or a few protobuf kinds) and the client's agent name."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from kubeemu import protowire
from kubeemu.store import ApiError, bad_request, decode_yaml_or_json


def json_response(data: Any, status: int = 200, headers: Any = None) -> web.Response:
    body = json.dumps(data, separators=(",", ":")).encode()
    return web.Response(body=body, status=status, content_type="application/json", headers=headers)


def status_response(err: ApiError) -> web.Response:
    headers = dict(err.headers)
    return json_response(err.status(), err.code, headers)


def generic_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def agent_of(request: web.Request) -> str:
    ua = request.headers.get("User-Agent", "")
    return ua.split("/", 1)[0][:128] or "unknown"


async def read_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return None
    ctype = request.headers.get("Content-Type", "")
    if "protobuf" in ctype:
        try:
            return protowire.decode(raw)
        except protowire.ProtobufError as exc:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the emulator cannot decode this protobuf body ({exc}); send JSON or YAML",
            ) from exc
    if "cbor" in ctype:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            "the body of the request was in an unknown format - accepted media "
            "types include: application/json, application/yaml",
        )
    if "yaml" in ctype:
        return decode_yaml_or_json(raw)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"error decoding request body: {exc}") from exc


def with_warnings(resp: web.Response, warnings: list[str]) -> web.Response:
    for w in warnings:
        resp.headers.add("Warning", f'299 - "{w.replace(chr(34), chr(92) + chr(34))}"')
    return resp


def wants_table(request: web.Request) -> bool:
    return "as=Table" in request.headers.get("Accept", "")
