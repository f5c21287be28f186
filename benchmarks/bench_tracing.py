"""What tracing costs a ``ketch serve``: throughput and TTFT with --otlp-traces-endpoint off
and on, in the same run.

Two servers on the same settings run side by side, one without the flag and one exporting to
a real OTLP receiver in this process (``tests/otlp_receiver.py``, gRPC); the load
(``serving_client``: streamed completions of token-id prompts at one concurrency) takes turns
between them, off on off on ..., so drift on a shared machine hits both alike. Prints each
round, then medians and the ratio on ÷ off. How "off" compares with an earlier commit (no cost
when off) is ``bench_ab_serving.py``'s job.

Usage:
    .venv/bin/python benchmarks/bench_tracing.py [--runner model|null] [--concurrency 32]
        [--num-requests 128] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_serving import ketch_server, random_prompts
from otlp_receiver import receiving
from serving_client import LoadResult, load


def api_server_pid(url: str) -> int:
    """The ``ketch serve`` process (the API server, not its engine) listening on url's port."""
    wanted = f"--port\0{url.rsplit(':', 1)[1]}\0".encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"\0serve\0" in cmdline and wanted in cmdline and b"spawn_main" not in cmdline:
                return int(proc.name)
    raise RuntimeError(f"no ketch serve process for {url}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (its threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runner", choices=["model", "null"], default="model")
    args = parser.parse_args()
    prompts = random_prompts(vocab=1000, count=args.num_requests)
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # exports during the load, not after it
    common = ("--max-concurrency", "1024", "--runner", args.runner)
    runs: dict[str, list[LoadResult]] = {"off": [], "on": []}
    cpu_ms: dict[str, list[float]] = {"off": [], "on": []}
    with receiving() as receiver:
        with (
            ketch_server("tiny", *common) as off_url,
            ketch_server("tiny", *common, "--otlp-traces-endpoint", receiver.grpc_url) as on_url,
        ):
            pids = {"off": api_server_pid(off_url), "on": api_server_pid(on_url)}
            for url in (off_url, on_url):
                load(url, "warm-up", prompts[:8], 8, concurrency=8)
            for i in range(args.rounds):
                for label, url in (("off", off_url), ("on", on_url)):
                    before = cpu_seconds(pids[label])
                    result = load(
                        url, label, prompts, args.max_tokens, concurrency=args.concurrency
                    )
                    cpu = (cpu_seconds(pids[label]) - before) / len(prompts) * 1000
                    ttft, _ = result.percentiles("ttft")
                    print(
                        f"  round {i + 1} {label:>3}: {result.tok_per_s:7.0f} output tok/s, "
                        f"TTFT p50 {ttft:6.1f} ms, API server CPU {cpu:5.2f} ms/request "
                        f"({len(result.completed)} ok)",
                        flush=True,
                    )
                    runs[label].append(result)
                    cpu_ms[label].append(cpu)
        spans = len(receiver.spans)  # the on server flushed what it held as it stopped
    expected = (args.rounds * args.num_requests + 8) * 4  # a server span and three phases each
    print(f"\nspans received: {spans} (expected about {expected})")
    rows = {}
    for label, results in runs.items():
        rows[label] = (
            statistics.median(r.tok_per_s for r in results),
            statistics.median(r.percentiles("ttft")[0] for r in results),
            statistics.median(r.percentiles("ttft")[1] for r in results),
        )
    cpu = {label: statistics.median(values) for label, values in cpu_ms.items()}
    pairs = [on.tok_per_s / off.tok_per_s for off, on in zip(runs["off"], runs["on"], strict=True)]
    print(
        f"\n| c={args.concurrency}, --runner {args.runner} | tok/s | TTFT p50 ms | TTFT p99 ms "
        "| API server CPU ms/request |"
    )
    print("|---|---|---|---|---|")
    for label, (tok, p50, p99) in rows.items():
        print(f"| tracing {label} | {tok:.0f} | {p50:.1f} | {p99:.1f} | {cpu[label]:.2f} |")
    (t_off, p50_off, p99_off), (t_on, p50_on, p99_on) = rows["off"], rows["on"]
    print(
        f"| on ÷ off | {t_on / t_off:.3f} | {p50_on / p50_off:.3f} | {p99_on / p99_off:.3f} "
        f"| {cpu['on'] / cpu['off']:.3f} |"
    )
    print(f"median of the rounds' on ÷ off tok/s: {statistics.median(pairs):.3f}")
    spread = {
        label: (min(r.tok_per_s for r in rs), max(r.tok_per_s for r in rs))
        for label, rs in runs.items()
    }
    print("round-to-round tok/s range (noise): " + ", ".join(
        f"{label} {lo:.0f}-{hi:.0f} ({(hi - lo) / lo:.1%})" for label, (lo, hi) in spread.items()
    ))  # fmt: skip


if __name__ == "__main__":
    main()
