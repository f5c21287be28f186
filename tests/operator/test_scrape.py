"""Reading engine metrics out of a /metrics page (operator/ketch/operator/autoscaling/scrape.py)."""

from __future__ import annotations

import asyncio

import pytest

from ketch.engine.metrics import EngineMetrics
from ketch.operator.autoscaling import metric_table, scrape


def test_quantile_is_prometheus_histogram_quantile():
    buckets = [(0.1, 0.0), (0.5, 50.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert scrape.quantile(buckets, 0.9) == pytest.approx(0.9)
    assert scrape.quantile(buckets, 0.5) == pytest.approx(0.5)
    assert scrape.quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.9) is None


def test_extract_reads_every_engine_metric_type():
    text = """
# TYPE ketch:num_requests_waiting gauge
ketch:num_requests_waiting{model_name="m"} 7
# TYPE ketch:kv_cache_usage_perc gauge
ketch:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE ketch:time_to_first_token_seconds histogram
ketch:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 10
ketch:time_to_first_token_seconds_bucket{le="2.0",model_name="m"} 20
ketch:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 20
ketch:time_to_first_token_seconds_sum{model_name="m"} 25
ketch:time_to_first_token_seconds_count{model_name="m"} 20
"""
    got = scrape.extract(
        text, ["RequestsWaiting", "KVCacheUsage", "TimeToFirstTokenP90", "RequestsRunning"]
    )
    assert got == {
        "RequestsWaiting": 7.0,
        "KVCacheUsage": 0.25,
        "TimeToFirstTokenP90": pytest.approx(1.8),
    }


def test_extract_understands_the_engines_own_exposition():
    from prometheus_client import generate_latest

    metrics = EngineMetrics("tiny")
    text = generate_latest(metrics.registry).decode()
    types = [m.type for m in metric_table.METRICS if m.engine is not None]
    assert set(scrape.extract(text, types)) == set(types)


def test_pod_ready():
    pod = {
        "metadata": {"name": "p"},
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    assert scrape.pod_ready(pod)
    assert not scrape.pod_ready({**pod, "metadata": {"name": "p", "deletionTimestamp": "x"}})
    assert not scrape.pod_ready({"metadata": {"name": "p"}, "status": {"podIP": "10.0.0.1"}})


def _page(fast: int, slow: int) -> str:
    name = "ketch:time_to_first_token_seconds"
    return (
        f"# TYPE {name} histogram\n"
        f'{name}_bucket{{le="0.5"}} {fast}\n'
        f'{name}_bucket{{le="4.0"}} {fast + slow}\n'
        f'{name}_bucket{{le="+Inf"}} {fast + slow}\n'
        f"{name}_sum 0\n{name}_count {fast + slow}\n"
    )


def test_ttft_quantile_is_over_the_last_two_minutes():
    windows = scrape.Windows(120)
    types = ["TimeToFirstTokenP90"]

    def p90(t: float, fast: int, slow: int) -> float:
        got = scrape.extract(_page(fast, slow), types, windows=windows, pod="p", now=t)
        return got["TimeToFirstTokenP90"]

    # a long fast history: since start, p90 is low
    assert p90(0, 1000, 0) <= 0.5
    # then only slow requests: the window sees them although the pod's totals are mostly fast
    assert p90(60, 1000, 50) > 3.0
    assert p90(130, 1000, 100) > 3.0
    # nothing new in the last two minutes: no latency to report
    assert p90(300, 1000, 100) == 0.0
    # counters reset (the engine restarted): the new totals count
    assert p90(310, 10, 0) <= 0.5
    windows.forget(set())
    assert not windows.snapshots


# --------------------------------------------------------------------------- untrusted pages (M2)

GOOD_PAGE = 'ketch:num_requests_waiting{model_name="m"} 3\n'
MIB = 1 << 20


def _serve_and_scrape(handler, timeout: float = 2.0):
    """Serves ``handler`` as /metrics (and /internal, which counts its hits) on 127.0.0.1 and
    scrapes it as one ready pod ``p``; returns (RoleMetrics, hits of /internal, seconds)."""
    import time

    import aiohttp
    from aiohttp import web

    hits: list[str] = []

    async def internal(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text=GOOD_PAGE)

    async def run():
        app = web.Application()
        app.router.add_get("/metrics", handler)
        app.router.add_get("/internal", internal)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        pod = {
            "metadata": {"name": "p"},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
        started = time.monotonic()
        try:
            async with aiohttp.ClientSession() as session:
                got = await scrape.scrape_role(session, [pod], port, ["RequestsWaiting"], timeout)
            seconds = time.monotonic() - started
        finally:
            await runner.cleanup()
        return got, hits, seconds

    return asyncio.run(run())


def test_a_redirect_is_not_followed():
    from aiohttp import web

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://{request.host}/internal")

    got, hits, _ = _serve_and_scrape(redirect)
    assert hits == []  # the operator never asked where the pod pointed it
    assert got.errors == ["p: HTTP 302 (redirects are not followed)"]
    assert got.values == {"RequestsWaiting": []}


def test_a_body_over_the_limit_is_not_read():
    from aiohttp import web

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()  # chunked: no Content-Length to refuse up front
        await response.prepare(request)
        line = b"# " + b"x" * 1000 + b"\n"
        try:
            for _ in range(64 * 1024):  # 64 MiB, if anyone read it all
                await response.write(line)
        except (ConnectionError, RuntimeError):
            pass  # the operator hung up
        return response

    got, _, _ = _serve_and_scrape(endless, timeout=20)
    assert got.errors == [f"p: body over {MIB} bytes"]

    async def announced(request: web.Request) -> web.Response:
        return web.Response(body=b"#" * (MIB + 1))

    got, _, _ = _serve_and_scrape(announced)
    assert got.errors == [f"p: body over {MIB} bytes"]
    assert scrape.MAX_BODY_BYTES == MIB


def test_nothing_the_pod_sent_reaches_the_error_text():
    from aiohttp import web

    secret = "SECRET-from-10.0.7.3-internal"
    pages = {
        "unparsable": web.Response(text=f'ketch:num_requests_waiting{{m="{secret}"}} {secret}\n'),
        "error": web.Response(status=500, text=secret, reason="Oops " + secret),
        "gzip": web.Response(
            body=b"\x1f\x8b" + secret.encode(), headers={"Content-Encoding": "gzip"}
        ),
    }
    expected = {
        "unparsable": "p: unreadable metrics (ValueError)",
        "error": "p: HTTP 500",
        "gzip": "p: compressed body refused (Content-Encoding)",
    }
    for name, page in pages.items():

        async def handler(request: web.Request, page=page) -> web.Response:
            return page

        got, _, _ = _serve_and_scrape(handler)
        assert got.errors == [expected[name]], name
        assert secret not in " ".join(got.errors)


def test_a_slow_pod_is_given_up_on_at_the_timeout():
    from aiohttp import web

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.5)
        return web.Response(text=GOOD_PAGE)

    got, _, seconds = _serve_and_scrape(slow, timeout=0.3)
    assert got.errors == ["p: no answer within 0.3 s"]
    assert seconds < 1.2


def test_only_the_wanted_series_reach_the_parser():
    noise = 'noise{x="y"} not-a-number\n'  # the parser would refuse this line
    too_long = "ketch:num_requests_waiting " + "1" * 5000 + "\n"  # over the line limit: skipped
    page = "# HELP noise anything at all\n" + noise + too_long + GOOD_PAGE
    assert scrape.extract(page, ["RequestsWaiting"]) == {"RequestsWaiting": 3.0}
