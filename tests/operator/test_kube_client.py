"""The operator's API client: a rotated service-account token is picked up on a 401."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest
from aiohttp import web

from ketch.operator.kube import ApiError, KubeClient


async def _serve(tokens: list[str]) -> tuple[web.AppRunner, str, list[str]]:
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        seen.append(auth)
        if auth != f"Bearer {tokens[-1]}":
            return web.json_response(
                {"kind": "Status", "reason": "Unauthorized", "message": "Unauthorized"},
                status=401,
            )
        return web.json_response({"kind": "ConfigMap", "metadata": {"name": "x"}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", seen


def _info(server: str, token: str) -> Any:
    return kopf.ConnectionInfo(server=server, token=token)


def test_a_401_logs_in_again_once_and_retries():
    async def main() -> None:
        tokens = ["old"]
        runner, url, seen = await _serve(tokens)
        logins: list[str] = []

        def relogin() -> Any:
            logins.append("again")
            return _info(url, tokens[-1])

        client = KubeClient(_info(url, "old"), relogin=relogin)
        try:
            assert (await client.get("ConfigMap", "ns", "x"))["metadata"]["name"] == "x"
            tokens.append("new")  # the kubelet rotated the projected token
            assert (await client.get("ConfigMap", "ns", "x"))["metadata"]["name"] == "x"
            assert logins == ["again"]
            assert seen[-2:] == ["Bearer old", "Bearer new"]
            tokens.append("newer")
            client._relogin = lambda: _info(url, "still-wrong")
            with pytest.raises(ApiError) as info:
                await client.get("ConfigMap", "ns", "x")
            assert info.value.status == 401  # one retry, then the error, no loop
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(main())
