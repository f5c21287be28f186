"""Helpers for tests against real ``ketch serve`` processes on free loopback ports.

Every server is a subprocess of the test run; teardown sends SIGTERM, waits, and kills it (and
the engine process it spawned) if it does not go, so no process outlives the tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from procs import free_ports, terminate, wait_for

KETCH = shutil.which("ketch", path=str(Path(sys.executable).parent)) or "ketch"
BASE_ARGS = ("--model", "tiny", "--host", "127.0.0.1", "--block-size", "16")
KV_MEMORY = "64MiB"
START_TIMEOUT_S = 120.0


class Server:
    """One ``ketch serve`` subprocess; its output goes to a log file shown on failures."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, new_session: bool = False
    ) -> None:
        """``new_session``: the server leads a process group of its own (as under setsid)."""
        # Every port the instance may bind is a free one, so servers never clash.
        self.port, worker_port, cache_port, pd_port = free_ports(4)
        self.worker_port, self.pd_port = worker_port, pd_port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix=f"ketch-serve-{self.port}-", suffix=".log")[1])
        full_env = {k: v for k, v in os.environ.items() if k != "KETCH_API_KEY"}
        full_env.update(env or {})
        command = [KETCH, "serve", *BASE_ARGS, "--kv-cache-memory", KV_MEMORY]
        command += ["--port", str(self.port), "--engine-worker-queue-port", str(worker_port)]
        command += ["--cache-queue-port", str(cache_port), "--pd-comm-port", str(pd_port)]
        # Prefill/decode roles need a peer key unless told otherwise: tests on one host are the
        # trusted network; a test that gives --peer-key-file (or --no-insecure-...) overrides.
        command += ["--insecure-no-peer-key", *args]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                env=full_env, start_new_session=new_session,
            )  # fmt: skip
        self._children: set[tuple[int, str]] = set()  # (pid, start time)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def admin_key(self) -> str:
        """The admin key ``ketch serve`` wrote into the run directory (no --admin-key-file)."""
        from ketch.engine import rundir

        return (rundir.run_dir() / f"admin-key-{self.port}").read_text().strip()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"ketch serve exited ({self.proc.returncode}):\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self._children |= {(p, _start_time(p)) for p in self.descendants()}
                    return
            time.sleep(0.1)
        raise AssertionError(f"ketch serve not healthy after {timeout:.0f} s:\n{self.log()}")

    def children(self, pid: int | None = None) -> list[int]:
        """Direct child pids of ``pid`` (default: the ``ketch serve`` process)."""
        pids: list[int] = []
        for path in Path(f"/proc/{pid or self.proc.pid}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pids += [int(p) for p in path.read_text().split()]
        return pids

    def descendants(self) -> list[int]:
        """Every process below ``ketch serve``: engine, its workers, resource trackers."""
        found, todo = [], self.children()
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += self.children(pid)
        return found

    def engine_pid(self) -> int:
        """The engine process: the multiprocessing spawn child (not the resource tracker)."""
        return self._spawned_child(self.proc.pid)

    def worker_pid(self) -> int:
        """The model worker process: the engine's spawn child."""
        return self._spawned_child(self.engine_pid())

    def worker_pids(self) -> list[int]:
        """Every model worker process (one per tensor-parallel rank), in start order."""
        return self._spawned_children(self.engine_pid())

    def _spawned_child(self, parent: int) -> int:
        return self._spawned_children(parent)[0]

    def _spawned_children(self, parent: int) -> list[int]:
        found = []
        for pid in self.children(parent):
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
        if not found:
            raise AssertionError(f"no spawned child of {parent}: {self.children(parent)}")
        return sorted(found, key=lambda pid: int(_start_time(pid) or 0))

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; also kills any child left behind. Returns the code."""
        self._children |= {(p, _start_time(p)) for p in self.descendants()}
        terminate(self.proc, timeout)
        for pid, started in self._children:  # no orphaned engine or worker outlives the tests
            if _start_time(pid) == started and not _is_zombie(pid):  # same process, still there
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self.log_path.unlink(missing_ok=True)
        return self.proc.returncode


def _stat(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _start_time(pid: int) -> str:
    fields = _stat(pid)
    return fields[19] if fields else ""


def _is_zombie(pid: int) -> bool:
    fields = _stat(pid)
    return not fields or fields[0] == "Z"


@contextlib.contextmanager
def running_server(*args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    server = Server(*args, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def greedy(llm: Any, prompts: list[str], max_tokens: int) -> list[Any]:
    from ketch.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [out.outputs[0] for out in llm.generate(prompts, params)]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels without model_name): value}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples[("ketch:" + name, tuple(sorted(labels.items())))]


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    """Decoded ``data:`` payloads of an SSE stream ("[DONE]" stays a string)."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


# A plain greedy request; after hostile input the instance must still answer it exactly.
GOOD = {"model": "tiny", "prompt": "Alice was", "max_tokens": 8, "temperature": 0}


def assert_exact_and_idle(url: str, reference_llm) -> None:
    """The instance is healthy, answers GOOD exactly as the offline engine does, and every KV
    block comes back free."""
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    got = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=60).json()
    want = greedy(reference_llm, [GOOD["prompt"]], GOOD["max_tokens"])[0]
    assert got["choices"][0]["text"] == want.text

    def idle() -> bool:
        samples = scrape(url)
        return metric(samples, "free_kv_block_num") == metric(samples, "max_kv_block_num")

    wait_for(idle, 30, "every KV block to be free again")
