"""Shared fixtures: small random Hugging Face checkpoints made on demand, once per session.

Every process the test run starts (servers, sidecars, routers, operators, and whatever they
start) inherits ``KETCH_WATCH_PID`` = this process, so each stops by itself if the run dies,
and the run fails at the end if any of them, or a ``/dev/shm/ketch-*`` segment named after a
port it handed out, is left.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hf_models import make_checkpoint
from ketch.engine.lifecycle import ENV_WATCH_PID
from procs import describe, own_segments, processes_with_env

os.environ[ENV_WATCH_PID] = str(os.getpid())
# The predictor backend's exported programs go to a directory of this run, never the user's
# ~/.cache/ketch (inherited by every process the run starts).
if "KETCH_CACHE_DIR" not in os.environ:
    os.environ["KETCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="ketch-test-cache-")
    atexit.register(shutil.rmtree, os.environ["KETCH_CACHE_DIR"], True)
_LEAK_WAIT_S = 10.0

# name -> (architecture, overrides). Every variant uses GQA (4 query heads, 2 KV heads; one KV
# head in qwen2-mqa, fewer KV heads than tensor-parallel ranks at tp 2).
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied-llama3rope": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama-linear-bias": (
        "llama",
        {
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "attention_bias": True,
            "mlp_bias": True,
            "head_dim": 32,
        },
    ),
    "qwen2": ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "qwen2-untied": ("qwen2", {"num_hidden_layers": 3}),
    "qwen2-mqa": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    # per-head q/k norms, q wider than the hidden state (4 heads of 32 on 64)
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """checkpoint("qwen2") -> directory of that random checkpoint (made once per session)."""
    made: dict[tuple[str, str | None], Path] = {}

    def get(name: str, max_shard_size: str | None = None) -> Path:
        key = (name, max_shard_size)
        if key not in made:
            arch, overrides = CHECKPOINTS[name]
            out = tmp_path_factory.mktemp(name.replace("-", "_"))
            made[key] = make_checkpoint(out, arch, max_shard_size=max_shard_size, **overrides)
        return made[key]

    return get


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    """CLI entry points run in-process call logging.basicConfig(force=True) with whatever
    sys.stderr is then (pytest's capture, closed after the test); later tests would log into a
    closed file. Put the root logger back as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Builds Ketch's C++ op libraries once, up front (a fresh machine takes ~20-40 s), so that
    no server a test starts compiles them inside its start-up timeout. A failed build is left to
    the tests of the fallback paths and of the kernels, which report it."""
    from ketch.kernels import cpp_ops

    for build in (cpp_ops.ops, cpp_ops.gemm_ops):
        with contextlib.suppress(RuntimeError):
            build()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run if a process it started, or a segment it made, outlived its tests."""
    me = str(os.getpid())
    deadline = time.monotonic() + _LEAK_WAIT_S
    while True:
        pids = [p for p in processes_with_env(ENV_WATCH_PID, me) if not _own_tracker(p)]
        segments = own_segments()
        if not (pids or segments) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not (pids or segments):
        return
    report = f"left behind by the tests after {_LEAK_WAIT_S:.0f} s:\n{describe(pids)}"
    if segments:
        report += "\n  /dev/shm: " + " ".join(sorted(segments))
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for name in segments:
        Path("/dev/shm", name).unlink(missing_ok=True)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(report, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _own_tracker(pid: int) -> bool:
    """This process's multiprocessing resource tracker: it ends when this process does."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return int(stat[1]) == os.getpid() and b"multiprocessing.resource_tracker" in cmdline
