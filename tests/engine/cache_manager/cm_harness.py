"""Helpers for tests against real ``ketch cache-manager`` processes on free loopback ports.

A test plays the engine: it creates a KV segment in /dev/shm (the layout the worker uses),
starts cache managers as subprocesses and talks to them over a ZMQ DEALER, as the engine does.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import zmq
from prometheus_client.parser import text_string_to_metric_families

from ketch.engine import rundir
from ketch.engine.cache_manager import protocol as p
from procs import free_ports, terminate

KETCH = shutil.which("ketch", path=str(Path(sys.executable).parent)) or "ketch"
START_TIMEOUT_S = 30.0
SMALL = {"num_layers": 2, "kv_heads": 2, "num_blocks": 8, "block_size": 16, "head_dim": 8}


class Segment:
    """A KV segment in /dev/shm filled with seeded random data, as the worker would hold.
    ``dtype`` bfloat16: the segment holds the raw 16-bit words (``kv`` is uint16), filled with
    random normals rounded to bfloat16 by truncation (any bits do: nothing computes on them)."""

    def __init__(self, seed: int = 0, dtype: str = "float32", **dims: int) -> None:
        name = f"ketch-test-kv-{uuid.uuid4().hex[:10]}"
        self.layout = p.KVLayout(**{**SMALL, **dims}, dtype=dtype, segment=name)
        self.path = Path("/dev/shm") / name
        storage = np.uint16 if dtype == "bfloat16" else np.float32
        size = int(np.prod(self.layout.shape)) * np.dtype(storage).itemsize
        with self.path.open("wb") as f:
            f.truncate(size)
        self.kv = np.memmap(self.path, dtype=storage, mode="r+", shape=self.layout.shape)
        data = np.random.default_rng(seed).standard_normal(self.layout.shape, np.float32)
        self.kv[:] = (data.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bfloat16" else data

    def block(self, index: int) -> np.ndarray:
        return np.array(self.kv[:, :, :, index])

    def remove(self) -> None:
        del self.kv
        self.path.unlink(missing_ok=True)


class CacheManagerProcess:
    """One ``ketch cache-manager`` subprocess; its output goes to a log shown on failures."""

    def __init__(self, *args: str, ports: list[int] | None = None) -> None:
        """``ports`` (queue, kv, http): set by ``args`` (e.g. a --config file), not by flags."""
        self.queue_port, self.kv_port, self.http_port = ports or free_ports(3)
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.kv_address = f"127.0.0.1:{self.kv_port}"
        self.log_path = Path(tempfile.mkstemp(prefix="ketch-cm-", suffix=".log")[1])
        command = [KETCH, "cache-manager"]
        if ports is None:
            command += ["--host", "127.0.0.1", "--cache-queue-port", str(self.queue_port)]
            command += ["--kv-transfer-port", str(self.kv_port)]
            command += ["--cache-manager-port", str(self.http_port)]
            # A cache manager that moves KV (a mixed one opens no KV port), without a peer key
            # unless the test gives one: tests on one host are the trusted network. ``args``
            # override both (the last flag wins).
            command += ["--role", "decode", "--insecure-no-peer-key"]
        command += args
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir()
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> CacheManagerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise AssertionError(f"cache manager exited ({code}):\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.05)
        raise AssertionError(f"cache manager not healthy after {timeout:.0f} s:\n{self.log()}")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample as ``{(name, sorted label items): value}``."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then kill if it does not go; returns the exit code."""
        return terminate(self.proc, timeout)


class FakeEngine:
    """The engine's side of the cache queue: a DEALER that sends one message and waits."""

    def __init__(self, manager: CacheManagerProcess, engine_id: str | None = None) -> None:
        self.engine_id = engine_id or uuid.uuid4().hex[:8]
        self.context = zmq.Context.instance()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(rundir.cache_queue_address(manager.queue_port))

    def send(self, message: p.Message) -> None:
        self.sock.send(p.encode(message))

    def receive(self, timeout: float = 15.0) -> p.Message:
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no answer from the cache manager within {timeout} s")
        return p.decode(self.sock.recv())

    def ask(self, message: p.Message, timeout: float = 15.0) -> p.Message:
        self.send(message)
        return self.receive(timeout)

    def hello(self, segment: Segment, version: int = p.PROTOCOL_VERSION) -> p.HelloAck:
        ack = self.ask(p.Hello(self.engine_id, version, segment.layout))
        assert isinstance(ack, p.HelloAck), ack
        return ack

    def reserve(self, request_id: str, blocks: list[int], ttl: float = 60.0) -> str:
        """Reserves ``blocks`` for ``request_id`` (as a decode engine does); returns the nonce
        a push must carry, once the cache manager confirmed it."""
        nonce = uuid.uuid4().hex
        answer = self.ask(p.Reserve(request_id, blocks, nonce, ttl))
        assert answer == p.Reserved(request_id, True), answer
        return nonce

    def reserved_push(
        self,
        decode: FakeEngine,
        request_id: str,
        blocks: list[int],
        dest: str,
        dest_blocks: list[int],
    ) -> p.PushDone:
        """A push of ``blocks`` into ``dest_blocks`` that ``decode`` reserved first."""
        nonce = decode.reserve(request_id, dest_blocks)
        push = p.Push(request_id, blocks, dest, dest_blocks, decode.engine_id, nonce)
        done = self.ask(push)
        assert isinstance(done, p.PushDone), done
        return done

    def close(self) -> None:
        self.sock.close(linger=0)


@contextlib.contextmanager
def running_managers(count: int, *args: str) -> Iterator[list[CacheManagerProcess]]:
    """``count`` cache managers with ``args``; each must exit 0 on SIGTERM at the end."""
    managers = [CacheManagerProcess(*args) for _ in range(count)]
    try:
        for manager in managers:
            manager.wait_ready()
        yield managers
    finally:
        codes = [m.stop() for m in managers]
    assert codes == [0] * count, [m.log() for m in managers]
