"""Endpoint picker (``ketch router --epp-port``) decision latency at a fixed request rate.

Starts ``--endpoints`` lightweight instances (a real HTTP server per endpoint answering the
router's ``/ready`` and ``/metrics`` polls, all in one thread of this process), then for each
policy a ``ketch router`` with its endpoint picker, and sends ``--rate`` requests/s for
``--seconds`` through the real ext_proc client (``tests/extproc_client.py``, Envoy's protos:
``pick``, or ``apick`` on a ``grpc.aio`` channel with ``--client aio``), open loop: request i
is due at t0 + i/rate. Each request is a completion with a ~2 KB prompt from 32 shared
prefixes, in buffered and in FULL_DUPLEX_STREAMED body mode.

Reported per policy and mode: the achieved rate, the client-side round trip of the request
phases (p50, p99, max: what Envoy waits for, the gRPC hop on loopback included) and the
picker's own ``ketch:epp_decision_seconds`` (p50/p99 from the histogram's buckets: upper
bounds). Target: p99 < 2 ms at 200 requests/s with 16 endpoints.

Usage:
    .venv/bin/python benchmarks/bench_epp.py [--endpoints 16] [--rate 200] [--seconds 5]
        [--client sync|aio]
All traffic goes to 127.0.0.1; every process is started and stopped here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import extproc_client
from bench_router import HOST, KETCH, free_port, process

POLICIES = ("prefix-hash", "least-requests")


@contextlib.contextmanager
def endpoints(count: int) -> Iterator[list[str]]:
    """``count`` HTTP servers that look ready and idle to the router."""
    loop = asyncio.new_event_loop()
    ports = [free_port() for _ in range(count)]
    runners: list[web.AppRunner] = []

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"ready": True, "role": "mixed", "model": "tiny"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="ketch:num_requests_running 0\nketch:num_requests_waiting 0\n")

    async def start() -> None:
        for port in ports:
            app = web.Application()
            app.router.add_get("/ready", ready)
            app.router.add_get("/metrics", metrics)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, HOST, port).start()
            runners.append(runner)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield [f"{HOST}:{port}" for port in ports]
    finally:
        for runner in runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def bodies(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    words = ["alice", "rabbit", "queen", "hatter", "dodo", "turtle", "garden", "tea"]
    prefixes = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(32)]
    return [
        json.dumps(
            {"model": "tiny", "prompt": f"{rng.choice(prefixes)} q{i}", "max_tokens": 8}
        ).encode()
        for i in range(count)
    ]


def decision_quantiles(url: str) -> tuple[float, float]:
    """p50 and p99 upper bounds (s) from the picker's decision histogram."""
    buckets = []
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ketch:epp_decision_seconds_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
    buckets.sort()
    total = buckets[-1][1]

    def upper(q: float) -> float:
        return next(le for le, n in buckets if n >= q * total)

    return upper(0.5), upper(0.99)


def run(target: str, rate: float, seconds: float, streamed: bool, client: str) -> dict[str, float]:
    count = int(rate * seconds)
    payloads = bodies(count, seed=int(streamed))
    if client == "aio":
        latencies, elapsed = asyncio.run(_run_aio(target, rate, payloads, streamed))
    else:
        latencies, elapsed = _run_sync(target, rate, payloads, streamed)
    latencies.sort()
    return {
        "rate": count / elapsed,
        "p50": statistics.median(latencies),
        "p99": latencies[int(0.99 * (len(latencies) - 1))],
        "max": latencies[-1],
    }


def _check(pick: extproc_client.Pick) -> None:
    if pick.status is not None or pick.header != pick.metadata:
        raise RuntimeError(f"bad pick: {pick}")


def _run_sync(target, rate, payloads, streamed) -> tuple[list[float], float]:
    latencies = []
    with grpc.insecure_channel(target) as channel:
        for body in payloads[:20]:  # warm the channel
            extproc_client.pick(channel, body, streamed=streamed)
        start = time.perf_counter()
        for i, body in enumerate(payloads):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            began = time.perf_counter()
            _check(extproc_client.pick(channel, body, streamed=streamed, chunk=1024))
            latencies.append(time.perf_counter() - began)
        return latencies, time.perf_counter() - start


async def _run_aio(target, rate, payloads, streamed) -> tuple[list[float], float]:
    latencies = []
    async with grpc.aio.insecure_channel(target) as channel:
        for body in payloads[:20]:
            await extproc_client.apick(channel, body, streamed=streamed)
        start = time.perf_counter()
        for i, body in enumerate(payloads):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            began = time.perf_counter()
            _check(await extproc_client.apick(channel, body, streamed=streamed, chunk=1024))
            latencies.append(time.perf_counter() - began)
        return latencies, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--client", choices=["sync", "aio"], default="sync",
        help="extproc_client.pick (a thread per stream) or apick on a grpc.aio channel",
    )  # fmt: skip
    args = parser.parse_args()
    rows = []
    with endpoints(args.endpoints) as addresses:
        for policy in POLICIES:
            port, epp_port = free_port(), free_port()
            command = [KETCH, "router", "--host", HOST, "--port", str(port), "--epp-port",
                       str(epp_port), "--mixed", ",".join(addresses), "--policy", policy,
                       "--log-level", "WARNING"]  # fmt: skip
            with process(command, f"http://{HOST}:{port}"):
                for streamed in (False, True):
                    result = run(
                        f"{HOST}:{epp_port}", args.rate, args.seconds, streamed, args.client
                    )
                    rows.append((policy, "streamed" if streamed else "buffered", result))
                server = decision_quantiles(f"http://{HOST}:{port}")
            own = {"p50": server[0], "p99": server[1]}
            rows.append((policy, "picker's own decision (both modes)", own))
    print(f"\nEPP decision latency, {args.endpoints} endpoints, {args.rate:g} requests/s target, "
          f"{args.client} client")  # fmt: skip
    print(f"{'policy':<15} {'mode':<36} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for policy, mode, r in rows:
        rate = f"{r['rate']:7.1f}" if "rate" in r else f"{'':>7}"
        worst = f"{r['max'] * 1e3:8.2f}" if "max" in r else f"{'':>8}"
        le = "<=" if "rate" not in r else "  "
        print(f"{policy:<15} {mode:<36} {rate} {le}{r['p50'] * 1e3:6.2f} {le}{r['p99'] * 1e3:6.2f} "
              f"{worst}")  # fmt: skip


if __name__ == "__main__":
    main()
