"""``ketch router`` policies on a shared-prefix workload: prefix-cache hit rate and throughput.

Starts ``--instances`` mixed ``ketch serve`` instances with the real model, then for each
policy a fresh ``ketch router`` in front of them, and sends a shared-prefix workload
(``--prefixes`` prefixes of ~``--prefix-words`` words from the tiny model's corpus, each with
many different suffixes, shuffled) at a fixed concurrency. Every policy gets prefixes of its
own, so no run profits from another's warm caches.

Reported per policy: prefix-cache hit rate (the instances' ``ketch:prefix_cache_token_num`` /
``ketch:prompt_tokens_total`` deltas), requests/s and output tokens/s, each also as a ratio
against round-robin measured in the same run. Target: prefix-hash hit rate >= 2x round-robin's.

Usage:
    .venv/bin/python benchmarks/bench_router.py [--instances 4] [--requests 64]
All traffic goes to 127.0.0.1; every process is started and stopped (SIGTERM, then kill) here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"
KETCH = str(Path(sys.executable).parent / "ketch")
CORPUS = Path(__file__).resolve().parent.parent / "engine/ketch/engine/models/tiny/corpus.txt"
POLICIES = ("round-robin", "prefix-hash", "least-requests")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def process(command: list[str], url: str, timeout: float = 180) -> Iterator[None]:
    log = Path(tempfile.mkstemp(prefix="bench-router-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd="/tmp")
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[1]} did not come up:\n{log.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.unlink(missing_ok=True)


def engine_command(port: int, threads: int) -> list[str]:
    ports = [free_port() for _ in range(3)]
    return [
        KETCH, "serve", "--model", "tiny", "--host", HOST, "--port", str(port),
        "--block-size", "16", "--kv-cache-memory", "256MiB", "--max-num-seqs", "32",
        "--num-threads", str(threads), "--engine-worker-queue-port", str(ports[0]),
        "--cache-queue-port", str(ports[1]), "--pd-comm-port", str(ports[2]),
        "--log-level", "WARNING",
    ]  # fmt: skip


def counters(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache hit tokens, prompt tokens) summed over the instances."""
    hits = prompt = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
            for s in family.samples:
                if s.name.startswith("ketch:prefix_cache_token_num"):
                    hits += s.value
                elif s.name == "ketch:prompt_tokens_total":
                    prompt += s.value
    return hits, prompt


def workload(args: argparse.Namespace, seed: int) -> list[str]:
    words = CORPUS.read_text().split()
    rng = random.Random(seed)
    prefixes = []
    for _ in range(args.prefixes):
        start = rng.randrange(len(words) - args.prefix_words)
        prefixes.append(" ".join(words[start : start + args.prefix_words]))
    prompts = [
        f"{prefixes[i % args.prefixes]} Question {i}: what happened next to {rng.choice(words)}?"
        for i in range(args.requests)
    ]
    rng.shuffle(prompts)
    return prompts


async def drive(url: str, prompts: list[str], args: argparse.Namespace) -> tuple[float, int, int]:
    """Sends every prompt at the given concurrency; returns (seconds, ok, output tokens)."""
    queue = list(prompts)
    done = tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done, tokens
        while queue:
            prompt = queue.pop()
            body = {"model": "tiny", "prompt": prompt, "max_tokens": args.max_tokens,
                    "temperature": 0.0, "ignore_eos": True}  # fmt: skip
            reply = await client.post(f"{url}/v1/completions", json=body)
            if reply.status_code != 200:
                raise RuntimeError(f"request failed: {reply.status_code} {reply.text[:300]}")
            done += 1
            tokens += reply.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return time.perf_counter() - start, done, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=4, help="mixed instances (4)")
    parser.add_argument("--requests", type=int, default=64, help="requests per policy (64)")
    parser.add_argument("--prefixes", type=int, default=16, help="shared prefixes (16)")
    parser.add_argument("--prefix-words", type=int, default=120, help="words per prefix (120)")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens (8)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (8)")
    parser.add_argument("--threads", type=int, default=1, help="model threads per instance (1)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    args = parser.parse_args()
    policies = args.policies.split(",")
    ports = [free_port() for _ in range(args.instances)]
    urls = [f"http://{HOST}:{p}" for p in ports]
    t0 = time.perf_counter()
    results: dict[str, tuple[float, float, float, float]] = {}
    with contextlib.ExitStack() as stack:
        print(f"starting {args.instances} ketch serve instances (tiny model) ...", flush=True)
        for port, url in zip(ports, urls, strict=True):
            stack.enter_context(process(engine_command(port, args.threads), url))
        for seed, policy in enumerate(policies):
            router_port = free_port()
            router_url = f"http://{HOST}:{router_port}"
            command = [KETCH, "router", "--host", HOST, "--port", str(router_port), "--policy",
                       policy, "--mixed", ",".join(urls), "--log-level", "WARNING"]  # fmt: skip
            with process(command, router_url):
                hits0, prompt0 = counters(urls)
                seconds, ok, tokens = asyncio.run(drive(router_url, workload(args, seed), args))
                hits1, prompt1 = counters(urls)
            rate = (hits1 - hits0) / max(1.0, prompt1 - prompt0)
            results[policy] = (rate, ok / seconds, tokens / seconds, (prompt1 - prompt0) / ok)
            print(f"  {policy}: done ({time.perf_counter() - t0:.0f} s so far)", flush=True)
    base = results.get("round-robin")
    print(f"\n{args.instances} instances, {args.requests} requests, {args.prefixes} prefixes, "
          f"concurrency {args.concurrency}, {args.max_tokens} output tokens\n")  # fmt: skip
    head = f"{'policy':<16}{'hit rate':>10}{'x rr':>7}{'req/s':>9}{'x rr':>7}{'out tok/s':>11}"
    head += f"{'x rr':>7}{'prompt tok':>12}"
    print(head)
    print("-" * len(head))
    for policy, (rate, rps, tps, ptoks) in results.items():
        ratios = [rate / base[0] if base and base[0] else float("nan"),
                  rps / base[1] if base else float("nan"),
                  tps / base[2] if base else float("nan")]  # fmt: skip
        print(f"{policy:<16}{rate:10.3f}{ratios[0]:7.2f}{rps:9.2f}{ratios[1]:7.2f}{tps:11.1f}"
              f"{ratios[2]:7.2f}{ptoks:12.0f}")  # fmt: skip
    if base and "prefix-hash" in results:
        ratio = results["prefix-hash"][0] / base[0] if base[0] else float("inf")
        verdict = "PASS" if ratio >= 2 else "FAIL"
        print(
            f"\nprefix-hash hit rate / round-robin hit rate = {ratio:.2f} (target >= 2): {verdict}"
        )
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
