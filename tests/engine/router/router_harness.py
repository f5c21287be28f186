"""Helpers for the router tests: a ``ketch router`` subprocess, instances started in parallel,
a tiny real HTTP instance (aiohttp, in a thread) that records what reaches it, and raw
socket exchanges for requests no well-behaved client sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import KETCH, Server

from procs import free_ports, terminate

START_TIMEOUT_S = 60.0
TOKEN_ENV = "KETCH_ROUTER_REGISTRATION_TOKEN"


@contextlib.contextmanager
def start_instances(count: int, *args: str) -> Iterator[list[Server]]:
    """``count`` ``ketch serve`` instances, started together (each takes seconds to start)."""
    servers: list[Server] = []
    try:
        for _ in range(count):
            servers.append(Server(*args))
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


class Router:
    """One ``ketch router`` subprocess on a free port, output in a log file."""

    def __init__(self, *args: str, wait: bool = True, env: dict[str, str] | None = None) -> None:
        """``env``: variables added to the router's environment (which never inherits a
        registration token from the test run's)."""
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="ketch-router-", suffix=".log")[1])
        command = [KETCH, "router", "--host", "127.0.0.1", "--port", str(self.port), *args]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                env=router_env(env),
            )  # fmt: skip
        if wait:
            self.wait_up()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"ketch router exited ({self.proc.returncode}):\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.05)
        raise AssertionError(f"ketch router not up after {START_TIMEOUT_S:.0f} s:\n{self.log()}")

    def admin_key(self) -> str:
        """The key the router wrote into the run directory for /v1/ketch/instances."""
        from ketch.engine import rundir

        return (rundir.run_dir() / f"router-admin-key-{self.port}").read_text().strip()

    def instances(self) -> dict[str, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {self.admin_key()}"}
        body = httpx.get(f"{self.url}/v1/ketch/instances", headers=headers, timeout=5).json()
        return {i["url"]: i for i in body["instances"]}

    def request_counts(self) -> dict[str, float]:
        """Requests the router sent to each instance (all status codes), from its /metrics."""
        counts: dict[str, float] = {}
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "ketch_router_requests_total":
                    instance = sample.labels["instance"]
                    counts[instance] = counts.get(instance, 0) + sample.value
        return counts

    def stop(self, timeout: float = 20.0) -> int | None:
        code = terminate(self.proc, timeout)
        self.log_path.unlink(missing_ok=True)
        return code


def router_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test run's environment without ``TOKEN_ENV``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return {**env, **(extra or {})}


@contextlib.contextmanager
def running_router(*args: str, env: dict[str, str] | None = None) -> Iterator[Router]:
    router = Router(*args, env=env)
    try:
        yield router
    finally:
        router.stop()


def run_router(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``ketch router ARGS`` to completion (for commands that fail fast)."""
    return subprocess.run(
        [KETCH, "router", *args], capture_output=True, text=True, timeout=timeout,
        cwd=tempfile.gettempdir(), env=router_env(env),
    )  # fmt: skip


@dataclass
class RawAnswer:
    """What a raw HTTP exchange got back: status, lower-cased headers, body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def raw_exchange(
    port: int, head: bytes, pieces: Iterable[bytes] = (), timeout: float = 20
) -> RawAnswer:
    """Sends ``head`` then each of ``pieces`` over one loopback socket, stopping early when the
    server has answered (a refusal need not wait for a body nobody reads); returns the answer.
    For what httpx will not send: lying Content-Length, slow bodies, raw header bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        for piece in pieces:
            if select.select([sock], [], [], 0)[0]:
                break  # answered already
            try:
                sock.sendall(piece)
            except OSError:
                break  # it answered and closed while we were still sending
        return _read_answer(sock, time.monotonic() + timeout)


def _read_answer(sock: socket.socket, deadline: float) -> RawAnswer:
    data = b""
    while b"\r\n\r\n" not in data and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return RawAnswer(int(lines[0].split()[1]), headers, body)


class FakeInstance:
    """A real HTTP server in a thread that answers like an instance and records requests.

    ``/ready`` answers 200 with ``role`` (and ``pd_comm_port`` when given). Completions answer
    a fixed JSON body (so do embeddings: the router passes any body on), or with
    ``break_stream`` an SSE stream that sends two events and then
    drops the connection mid-stream. ``answer`` (settable while it runs) makes completions
    misbehave instead: "503" refuses with an OpenAI error body, "hangup" drops the connection
    after reading the request, "slow" answers after ``SLOW_S`` seconds. A body that is not
    JSON gets a 400, as a real instance would answer. ``ready_body`` and ``metrics_text``
    replace what ``/ready`` and ``/metrics`` answer (a broken instance).
    """

    SLOW_S = 4.0

    def __init__(
        self,
        role: str = "mixed",
        pd_comm_port: int | None = None,
        break_stream: bool = False,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.role = role
        self.pd_comm_port = pd_comm_port
        self.break_stream = break_stream
        self.answer = "ok"
        self.ready_body: bytes | None = None
        self.metrics_text = "ketch:num_requests_running 0\nketch:num_requests_waiting 0\n"
        self.requests: list[dict[str, Any]] = []
        self.host = host
        self.port = port or free_ports(1)[0]
        self.url = f"http://{host}:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise AssertionError("fake instance did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/embeddings", self._completions)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, self.port)
        self._loop.run_until_complete(site.start())
        self._started.set()
        self._loop.run_forever()

    async def _ready(self, request: web.Request) -> web.Response:
        if self.ready_body is not None:
            return web.Response(body=self.ready_body, content_type="application/json")
        body: dict[str, Any] = {"ready": True, "role": self.role}
        if self.pd_comm_port is not None:
            body["pd_comm_port"] = self.pd_comm_port
        return web.json_response(body)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        self.requests.append({"headers": dict(request.headers), "body": body, "raw": raw})
        if body is None:
            return web.json_response({"error": {"message": "not JSON"}}, status=400)
        if self.answer != "ok":
            return await self._misbehave(request)
        if not self.break_stream:
            return web.json_response(
                {"id": "fake", "object": "text_completion", "created": 0, "model": "tiny",
                 "choices": [{"index": 0, "text": "ok", "finish_reason": "stop",
                              "logprobs": None}]}
            )  # fmt: skip
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(2):
            chunk = {"id": "fake", "object": "text_completion", "created": 0, "model": "tiny",
                     "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None,
                                  "logprobs": None}]}  # fmt: skip
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await asyncio.sleep(0.2)
        assert request.transport is not None
        request.transport.abort()  # the instance dies mid-stream
        return resp

    async def _misbehave(self, request: web.Request) -> web.Response:
        if self.answer == "503":
            error = {"message": "engine overloaded", "type": "server_error", "param": None,
                     "code": 503}  # fmt: skip
            return web.json_response({"error": error}, status=503, headers={"Retry-After": "7"})
        if self.answer == "slow":
            await asyncio.sleep(self.SLOW_S)
            return web.json_response({"id": "slow", "choices": []})
        assert request.transport is not None
        request.transport.abort()  # "hangup": the work was taken, then the instance died
        return web.Response()

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
