"""Serving throughput of this checkout against another commit, in the same run, same client.

Checks ``REV`` (default: the parent of the hardening work) out as a temporary git worktree and
runs ``ketch serve`` from its sources through ``PYTHONPATH`` (ahead of the venv's editable
install; the venv's dependencies are shared); the current checkout runs from the venv as it is.
The two take turns (A B A B ...), each round a fresh server on the same settings, streaming the
same token-id prompts at one concurrency. Prints output tok/s and median TPOT (time per output
token after the first, per request) per round, their medians and the ratios current ÷ REV.
``--runner null`` (a fixed token, instantly) measures the serving path alone;
``--current-rev`` runs the current side from a worktree of that commit too (a shared checkout
with others' work in progress).

Usage:
    .venv/bin/python benchmarks/bench_ab_serving.py [--rev a897936] [--runner model|null]
        [--current-rev HEAD] [--concurrency 32] [--num-requests 128] [--max-tokens 64]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_serving import ketch_server, random_prompts
from serving_client import load

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def checkout(rev: str | None, into: Path) -> Iterator[str | None]:
    """``rev`` of this repository as a worktree under ``into``; yields the PYTHONPATH that
    imports ``ketch`` from it (removed on the way out). No rev: None, the venv's install."""
    if rev is None:
        yield None
        return
    tree = into / "src"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev],
                   check=True, capture_output=True)  # fmt: skip
    try:
        yield os.pathsep.join(str(tree / part) for part in ("engine", "operator", "kernels"))
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                       check=False, capture_output=True)  # fmt: skip


def measure(label: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, float]:
    """(output tok/s, median TPOT in ms) of one round on a fresh server."""
    with ketch_server("tiny", "--max-concurrency", "1024", "--runner", args.runner) as url:
        load(url, "warm-up", prompts[:8], 8, concurrency=8)
        result = load(url, label, prompts, args.max_tokens, concurrency=args.concurrency)
    tpot = result.percentiles("tpot")[0]
    print(
        f"  {label}: {result.tok_per_s:.0f} output tok/s, TPOT p50 {tpot:.2f} ms "
        f"({len(result.completed)} ok)"
    )
    return result.tok_per_s, tpot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="a897936", help="the commit to compare against")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runner", choices=["model", "null"], default="model")
    parser.add_argument("--current-rev", help="run the current side from this commit")
    args = parser.parse_args()
    prompts = random_prompts(vocab=1000, count=args.num_requests)
    with (
        tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp,
        checkout(args.rev, Path(tmp) / "old") as old_path,
        checkout(args.current_rev, Path(tmp) / "new") as new_path,
    ):
        runs: dict[str, list[tuple[float, float]]] = {"current": [], args.rev: []}
        for i in range(args.rounds):
            for label, path in (("current", new_path), (args.rev, old_path)):
                os.environ.pop("PYTHONPATH", None)
                if path is not None:
                    os.environ["PYTHONPATH"] = path
                runs[label].append(measure(f"{label} round {i + 1}", prompts, args))
        os.environ.pop("PYTHONPATH", None)
    new = [statistics.median(v) for v in zip(*runs["current"], strict=True)]
    old = [statistics.median(v) for v in zip(*runs[args.rev], strict=True)]
    title = f"c={args.concurrency}, --runner {args.runner}"
    print(f"\n| {title} | median output tok/s | median TPOT p50 (ms) |\n|---|---|---|")
    print(
        f"| {args.rev} | {old[0]:.0f} | {old[1]:.2f} |\n| current | {new[0]:.0f} | {new[1]:.2f} |"
    )
    print(f"| current ÷ {args.rev} | {new[0] / old[0]:.3f} | {new[1] / old[1]:.3f} |")


if __name__ == "__main__":
    main()
