"""Online serving: ``ketch serve`` under load, with metrics as ``vllm bench serve`` reports them.

Each request streams ``/v1/completions`` (token-id prompt, temperature 0, ignore_eos, a fixed
max_tokens, ``stream_options.include_usage``) and records TTFT (request start to the first
chunk with choices), ITL (gaps between such chunks), TPOT ((latency - TTFT) / (output tokens -
1)) and end-to-end latency. Datasets: "random" (32-256 random token ids) and "shared-prefix"
(a few long shared prefixes + random suffixes). Load shapes: a concurrency sweep (1, 8, 32)
and Poisson arrivals at 4 and 16 req/s.

Two ratios against baselines measured in the same run, each in a process of its own:
(1) serving output tok/s at concurrency 32 / offline ``LLM.generate`` tok/s (best of 2) on the
    same requests and engine settings (target >= 0.85);
(2) ``ketch serve --runner null`` (a fixed token, instantly) req/s / a bare FastAPI+uvicorn SSE
    endpoint streaming the same number of chunks, same client, same concurrency (target >= 0.8).
Client, API server, engine and worker share this machine's cores, as they would on one node.

Usage:
    .venv/bin/python benchmarks/bench_serving.py [--model tiny|PATH]
        [--num-requests 64] [--max-tokens 64] [--quick]
All traffic goes to 127.0.0.1; every server is started and stopped (SIGTERM, then kill) here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from serving_client import SERVED_MODEL, LoadResult, load

HOST = "127.0.0.1"
HERE = Path(__file__).resolve().parent
KETCH = shutil.which("ketch", path=str(Path(sys.executable).parent)) or "ketch"
ENGINE_ARGS = (
    "--block-size", "16", "--kv-cache-memory", "256MiB", "--max-num-seqs", "64",
)  # fmt: skip
START_TIMEOUT_S = 180.0


# ---------------------------------------------------------------- datasets


def random_prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    """Random token ids, 32-256 tokens each."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, int(rng.integers(32, 257))).tolist() for _ in range(count)]


def shared_prefix_prompts(
    vocab: int, count: int, seed: int = 1, prefixes: int = 4, prefix_len: int = 192
) -> list[list[int]]:
    """``prefixes`` shared prefixes of ``prefix_len`` tokens, each + a random 16-64 suffix."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(1, vocab, prefix_len).tolist() for _ in range(prefixes)]
    return [
        heads[i % prefixes] + rng.integers(1, vocab, int(rng.integers(16, 65))).tolist()
        for i in range(count)
    ]


DATASETS = {"random": random_prompts, "shared-prefix": shared_prefix_prompts}


# ---------------------------------------------------------------- servers


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (held open together while choosing, so none repeats)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((HOST, 0))
            ports.append(sock.getsockname()[1])
        return ports


@contextlib.contextmanager
def server(command: list[str], port: int, name: str) -> Iterator[str]:
    """Runs ``command`` in a new session until /health answers 200; yields the base URL.

    On the way out: SIGTERM, a wait, then SIGKILL to the whole session (the server's own
    engine/worker children included), so nothing outlives the benchmark.
    """
    log_path = Path(tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")[1])
    env = {k: v for k, v in os.environ.items() if k != "KETCH_API_KEY"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
            env=env, start_new_session=True,
        )  # fmt: skip
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        yield url
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            print(f"  ! {name} ignored SIGTERM for 60 s; killing it", file=sys.stderr)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the session we created, children included
        proc.wait(10)
        log_path.unlink(missing_ok=True)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]


@contextlib.contextmanager
def ketch_server(model: str, *extra: str) -> Iterator[str]:
    port, worker, cache, pd = free_ports(4)
    command = [
        KETCH, "serve", "--model", model, "--served-model-name", SERVED_MODEL,
        "--host", HOST, "--port", str(port), "--engine-worker-queue-port", str(worker),
        "--cache-queue-port", str(cache), "--pd-comm-port", str(pd),
        "--log-level", "WARNING", *ENGINE_ARGS, *extra,
    ]  # fmt: skip
    with server(command, port, "ketch-serve") as url:
        yield url


def bare_sse_app() -> FastAPI:
    """The baseline: FastAPI + uvicorn streaming ``max_tokens`` fixed completion chunks."""
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        count = int(body.get("max_tokens") or 16)
        created = int(time.time())

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            data = {
                "id": "cmpl-bare", "object": "text_completion", "created": created,
                "model": body.get("model"), "choices": choices, "usage": usage,
            }  # fmt: skip
            return f"data: {json.dumps(data)}\n\n"

        async def events():
            for i in range(count):
                finish = "length" if i == count - 1 else None
                choice = {"index": 0, "text": "a", "logprobs": None, "finish_reason": finish}
                yield chunk([choice])
            prompt = len(body.get("prompt") or [])
            yield chunk([], {"prompt_tokens": prompt, "completion_tokens": count,
                             "total_tokens": prompt + count})  # fmt: skip
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def run_bare_server(port: int) -> None:
    import uvicorn

    uvicorn.run(bare_sse_app(), host=HOST, port=port, log_level="warning")


@contextlib.contextmanager
def bare_server() -> Iterator[str]:
    (port,) = free_ports(1)
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench_serving as b; "
    code += f"b.run_bare_server({port})"
    with server([sys.executable, "-c", code], port, "bare-sse") as url:
        yield url


# ---------------------------------------------------------------- offline baseline


def bench_offline(
    model: str, prompts: list[list[int]], max_tokens: int, max_num_seqs: int = 64
) -> tuple[float, int]:
    """``LLM.generate`` on all prompts at once with the server's engine settings; best of 2."""
    from ketch.engine import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=max_num_seqs, kv_cache_memory="256MiB", block_size=16)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        runs.append((elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)))
    return min(runs)


def offline_isolated(
    model: str, prompts: list[list[int]], max_tokens: int, max_num_seqs: int = 64
) -> tuple[float, int]:
    """Runs ``bench_offline`` in a fresh interpreter (prompts over stdin: argv is too small)."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import bench_serving as b; "
        "a = json.load(sys.stdin); print(json.dumps(b.bench_offline(*a)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([model, prompts, max_tokens, max_num_seqs]),
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    ).stdout
    seconds, tokens = json.loads(out.strip().splitlines()[-1])
    return float(seconds), int(tokens)


# ---------------------------------------------------------------- report


def print_sweep(rows: list[tuple[str, LoadResult]], offline_rate: dict[str, float]) -> None:
    head = (
        f"{'dataset':<14}{'load':<9}{'ok':>7}{'req/s':>7}{'tok/s':>8}{'/offline':>9}"
        f"{'TTFT p50/p99 ms':>17}{'TPOT p50/p99 ms':>17}{'ITL p50/p99 ms':>16}{'E2E p50 s':>10}"
    )
    print(head)
    print("-" * len(head))
    for dataset, r in rows:
        vs = offline_rate.get(dataset)
        ratio = f"{r.tok_per_s / vs:9.2f}" if vs else f"{'-':>9}"
        cells = []
        for metric, width in (("ttft", 17), ("tpot", 17), ("itl", 16)):
            p50, p99 = r.percentiles(metric)
            cells.append(f"{f'{p50:.1f} / {p99:.1f}':>{width}}")
        e2e = r.percentiles("e2e")[0] / 1000.0
        ok = f"{len(r.completed)}/{len(r.results)}"
        print(
            f"{dataset:<14}{r.label:<9}{ok:>7}{r.req_per_s:7.2f}{r.tok_per_s:8.1f}{ratio}"
            f"{''.join(cells)}{e2e:10.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per load point")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument(
        "--quick", action="store_true", help="random dataset only, fewer points and requests"
    )
    args = parser.parse_args()

    from ketch.engine.models.config import ModelConfig
    from ketch.engine.models.paths import resolve_model_path

    vocab = ModelConfig.from_dir(resolve_model_path(args.model)).vocab_size
    n, max_tokens = args.num_requests, args.max_tokens
    if args.quick:
        n = max(8, n // 2)
    datasets = ["random"] if args.quick else list(DATASETS)
    shapes: list[tuple[str, dict[str, Any], int]] = [
        ("c=1", {"concurrency": 1}, max(2, n // 8)),
        ("c=8", {"concurrency": 8}, n),
        ("c=32", {"concurrency": 32}, n),
    ]
    if not args.quick:
        shapes += [("rate=4", {"rate": 4.0}, n), ("rate=16", {"rate": 16.0}, n)]
    else:
        shapes += [("rate=16", {"rate": 16.0}, n)]
    prompts = {name: DATASETS[name](vocab, n) for name in datasets}

    t0 = time.perf_counter()
    rows: list[tuple[str, LoadResult]] = []
    print(f"ketch serve --model {args.model}: {', '.join(s[0] for s in shapes)} ...", flush=True)
    with ketch_server(args.model) as url:
        load(url, "warmup", prompts["random"][:8], 4, concurrency=8)
        for dataset in datasets:
            for label, shape, count in shapes:
                rows.append((dataset, load(url, label, prompts[dataset][:count], max_tokens,
                                           **shape)))  # fmt: skip
    print(f"offline LLM.generate ({time.perf_counter() - t0:.0f} s so far) ...", flush=True)
    offline_rate: dict[str, float] = {}
    for dataset in datasets:
        seconds, tokens = offline_isolated(args.model, prompts[dataset], max_tokens)
        offline_rate[dataset] = tokens / seconds
    # Diagnostic: the same, with the batch capped at 32 like the c=32 point.
    seconds, tokens = offline_isolated(args.model, prompts["random"], max_tokens, 32)
    offline_32 = tokens / seconds

    null_n = n * 4
    null_prompts = prompts["random"][:null_n] * (null_n // len(prompts["random"]) + 1)
    null_prompts = null_prompts[:null_n]
    print(f"null runner vs bare SSE ({time.perf_counter() - t0:.0f} s so far) ...", flush=True)
    with ketch_server(args.model, "--runner", "null") as url:
        load(url, "warmup", null_prompts[:32], max_tokens, concurrency=32)
        null_ketch = load(url, "c=32", null_prompts, max_tokens, concurrency=32)
    with bare_server() as url:
        load(url, "warmup", null_prompts[:32], max_tokens, concurrency=32)
        null_bare = load(url, "c=32", null_prompts, max_tokens, concurrency=32)

    print(
        f"\nmodel {args.model}, {max_tokens} output tokens per request (ignore_eos), "
        f"{n} requests per point ({shapes[0][2]} at c=1); random: 32-256 token prompts, "
        f"shared-prefix: 4 x 192-token prefixes + 16-64; {os.cpu_count()} cores, "
        f"{time.perf_counter() - t0:.0f} s\n"
    )
    print_sweep(rows, offline_rate)
    print("\n/offline: serving tok/s / offline LLM.generate tok/s on the same dataset\n")

    serve_c32 = next(r for d, r in rows if d == "random" and r.label == "c=32")
    checks = [
        ("serve c=32 tok/s / offline LLM.generate tok/s", serve_c32.tok_per_s,
         offline_rate["random"], ">= 0.85"),
        ("null runner serve c=32 req/s / bare FastAPI SSE", null_ketch.req_per_s,
         null_bare.req_per_s, ">= 0.8"),
    ]  # fmt: skip
    head = f"{'ratio':<50}{'ketch':>10}{'baseline':>10}{'ratio':>8}{'target':>9}"
    print(head)
    print("-" * len(head))
    for name, ours, base, target in checks:
        ratio = ours / base if base > 0 else float("nan")
        verdict = "ok" if ratio >= float(target.split()[1]) else "MISS"
        print(f"{name:<50}{ours:10.1f}{base:10.1f}{ratio:8.2f}{target:>9}  {verdict}")
    print(
        f"\n(for reference: offline LLM.generate with max_num_seqs 32, as at c=32: "
        f"{offline_32:.1f} tok/s; serve c=32 / that = {serve_c32.tok_per_s / offline_32:.2f})"
    )
    print(
        f"(null runner: {null_n} requests x {max_tokens} chunks; ketch "
        f"{len(null_ketch.completed)}/{null_n} ok, ITL p50 "
        f"{null_ketch.percentiles('itl')[0]:.2f} ms; bare {len(null_bare.completed)}/{null_n} ok,"
        f" ITL p50 {null_bare.percentiles('itl')[0]:.2f} ms)"
    )


if __name__ == "__main__":
    main()
