"""Serving throughput of this checkout against another commit, in the same run, same client.

Builds ``REV`` (default: the parent of the hardening work) into a private directory with
``pip install --no-deps --target`` and runs ``ketch serve`` from it through ``PYTHONPATH``; the
current checkout runs from the installed venv. The two take turns (A B A B ...), each round a
fresh server on the same settings, streaming the same token-id prompts at one concurrency.
Prints output tok/s per round, medians and the ratio current ÷ REV.

Usage:
    .venv/bin/python benchmarks/bench_ab_serving.py [--rev a897936]
        [--concurrency 32] [--num-requests 128] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_serving import ketch_server, random_prompts
from serving_client import load

REPO = Path(__file__).resolve().parent.parent


def build(rev: str, into: Path) -> Path:
    """``rev`` of this repository, installed (not editable) under ``into``."""
    tree = into / "src"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev],
                   check=True, capture_output=True)  # fmt: skip
    try:
        target = into / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", str(target), str(tree)], check=True)  # fmt: skip
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                       check=False, capture_output=True)  # fmt: skip
    return target


def measure(label: str, prompts: list[list[int]], args: argparse.Namespace) -> float:
    with ketch_server("tiny", "--max-concurrency", "1024") as url:
        load(url, "warm-up", prompts[:8], 8, concurrency=8)
        result = load(url, label, prompts, args.max_tokens, concurrency=args.concurrency)
    print(f"  {label}: {result.tok_per_s:.0f} output tok/s ({len(result.completed)} ok)")
    return result.tok_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="a897936", help="the commit to compare against")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prompts = random_prompts(vocab=1000, count=args.num_requests)
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        old_site = build(args.rev, Path(tmp))
        runs: dict[str, list[float]] = {"current": [], args.rev: []}
        for i in range(args.rounds):
            for label in ("current", args.rev):
                if label == args.rev:
                    os.environ["PYTHONPATH"] = str(old_site)
                else:
                    os.environ.pop("PYTHONPATH", None)
                runs[label].append(measure(f"{label} round {i + 1}", prompts, args))
        os.environ.pop("PYTHONPATH", None)
    new, old = statistics.median(runs["current"]), statistics.median(runs[args.rev])
    print(f"\n| c={args.concurrency} | median output tok/s |\n|---|---|")
    print(f"| {args.rev} | {old:.0f} |\n| current | {new:.0f} |")
    print(f"| current ÷ {args.rev} | {new / old:.3f} |")


if __name__ == "__main__":
    main()
