"""Review L1 and L3 on the router.

- L1: clients never see backends' addresses or errors (503/502 bodies, /ready); the router's
  log and the guarded /v1/ketch/instances keep them.
- L3: registrations are capped; no request of the router follows a redirect (a 307/308 to a
  forwarded POST would re-send the client's body, credentials included, elsewhere); /ready and
  /metrics bodies are read up to a bound.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import httpx
import pytest
from aiohttp import web
from router_harness import running_router

from ketch.engine.router.app import RouterState, _send
from ketch.engine.router.config import RouterConfig
from ketch.engine.router.instances import Registry
from procs import free_ports

pytestmark = pytest.mark.timeout(60)


def test_clients_see_no_backend_address_or_error() -> None:
    (dead,) = free_ports(1)  # nothing listens there: the instance is down
    backend = f"127.0.0.1:{dead}"
    with running_router("--mixed", backend) as r:
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            reply = httpx.request(method, f"{r.url}{path}", json={"prompt": "x"}, timeout=10)
            assert reply.status_code == 503
            assert "no healthy instance" in reply.json()["error"]["message"]
            assert str(dead) not in reply.text and "Error" not in reply.text, reply.text
        ready = httpx.get(f"{r.url}/ready", timeout=10)
        assert ready.status_code == 503 and ready.json()["problems"]
        assert str(dead) not in ready.text and "Error" not in ready.text, ready.text
        # An operator still sees what is wrong, with the admin key, and in the log.
        admin = {"Authorization": f"Bearer {r.admin_key()}"}
        listed = httpx.get(f"{r.url}/v1/ketch/instances", headers=admin, timeout=10).json()
        (inst,) = listed["instances"]
        assert str(dead) in inst["url"] and inst["last_error"]
        assert str(dead) in r.log()


def test_registrations_are_capped() -> None:
    registry = Registry(RouterConfig(registration_only=True))
    refused = 0
    for i in range(300):
        try:
            registry.register(f"http://10.0.{i // 250}.{i % 250 + 1}:8000", "mixed")
        except ValueError:
            refused += 1
    assert len(registry.instances) <= 256 and refused == 300 - len(registry.instances)
    # A heartbeat of one already registered is not a new registration.
    registry.register("http://10.0.0.1:8000", "mixed")


@asynccontextmanager
async def _server(routes: Callable[[web.Application], None]) -> AsyncIterator[str]:
    app = web.Application()
    routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_health_checks_follow_no_redirect_and_scrape_a_bounded_body() -> None:
    async def run() -> None:
        load_line = "ketch:num_requests_running 7\n"

        def redirecting(app: web.Application) -> None:
            async def ready(_: web.Request) -> web.Response:
                raise web.HTTPTemporaryRedirect("/elsewhere")

            async def elsewhere(_: web.Request) -> web.Response:
                return web.json_response({"ready": True})

            app.router.add_get("/ready", ready)
            app.router.add_get("/elsewhere", elsewhere)

        def huge_metrics(app: web.Application) -> None:
            async def ready(_: web.Request) -> web.Response:
                return web.json_response({"ready": True})

            async def metrics(_: web.Request) -> web.Response:
                return web.Response(text=load_line + "# pad\n" * (1 << 20))  # 7 MiB

            app.router.add_get("/ready", ready)
            app.router.add_get("/metrics", metrics)

        async with _server(redirecting) as first, _server(huge_metrics) as second:
            config = RouterConfig(mixed=f"{first},{second}")
            registry = Registry(config)
            registry.session = aiohttp.ClientSession()
            try:
                await registry.check_all()
            finally:
                await registry.session.close()
            redirected, huge = registry.instances[first], registry.instances[second]
            assert not redirected.healthy and "307" in (redirected.last_error or "")
            assert huge.healthy and huge.engine_load == 0  # not scraped: over the bound

    asyncio.run(run())


def test_a_forwarded_post_follows_no_redirect() -> None:
    async def run() -> None:
        seen: list[bytes] = []

        def target(app: web.Application) -> None:
            async def elsewhere(request: web.Request) -> web.Response:
                seen.append(await request.read())
                return web.json_response({"choices": []})

            app.router.add_post("/elsewhere", elsewhere)

        async with _server(target) as other:

            def redirecting(app: web.Application) -> None:
                async def completions(_: web.Request) -> web.Response:
                    raise web.HTTPPermanentRedirect(f"{other}/elsewhere")

                app.router.add_post("/v1/completions", completions)

            async with _server(redirecting) as first:
                state = RouterState.from_config(RouterConfig(mixed=first))
                state.registry.session = aiohttp.ClientSession()
                try:
                    (inst,) = state.registry.instances.values()
                    body = json.dumps({"prompt": "secret"}).encode()
                    resp = await _send(state, (inst, None), "/v1/completions", body, {})
                    assert resp.status == 308
                    resp.release()
                finally:
                    await state.registry.session.close()
        assert seen == [], "the client's body was re-sent to the redirect's target"

    asyncio.run(run())
