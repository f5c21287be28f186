"""What structured outputs cost a served model: a constrained-JSON workload against the same
prompts unconstrained, through ``ketch serve`` and the official ``openai`` client (issue 16).

Each request is a chat completion (temperature 0, ``max_tokens``, ``ignore_eos`` so both sides
generate the same number of tokens) from ``--concurrency`` clients at once; the constrained side
adds ``response_format: json_schema`` (strict) with a schema that stays open for the whole
output (16 bounded records), so every token is sampled under the grammar's mask. One server
serves both; the sides take turns (U C U C ...) so load on a shared machine hits both alike.
Prints per-round and median output tok/s, and the ratio constrained / unconstrained (target:
the mask costs at most 10%, ratio >= 0.90). Nothing is asserted: this is a measurement.

Usage:
    .venv/bin/python benchmarks/bench_structured_serving.py [--model tiny|qwen2-23m|llama-63m|DIR]
        [--concurrency 8] [--num-requests 32] [--max-tokens 64] [--rounds 3]

``qwen2-23m`` and ``llama-63m`` are ``bench_vs_vllm``'s random checkpoints (vocabularies of 4k and
16k tokens: the mask's cost grows with the vocabulary), made once under ``--checkpoints``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import ketch_server
from serving_client import SERVED_MODEL

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": RECORD, "minItems": 16, "maxItems": 16}},
    "required": ["people"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "people", "schema": SCHEMA, "strict": True},
}
TOPICS = ["a library", "a ship's crew", "a chess club", "a bakery", "a choir", "a lab", "a farm"]


def messages(count: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"List the people of {TOPICS[i % len(TOPICS)]} #{i}."}]
        for i in range(count)
    ]


async def run_side(
    base_url: str, conversations: list[list[dict[str, str]]], args: argparse.Namespace, json_: bool
) -> tuple[float, int, int]:
    """(seconds, completion tokens, outputs that start a JSON object) of one side."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    extra: dict[str, Any] = {"response_format": RESPONSE_FORMAT} if json_ else {}
    queue = list(reversed(conversations))
    tokens = objects = 0

    async def worker() -> None:
        nonlocal tokens, objects
        while queue:
            response = await client.chat.completions.create(
                model=SERVED_MODEL, messages=queue.pop(), max_tokens=args.max_tokens,
                temperature=0.0, extra_body={"ignore_eos": True}, **extra,
            )  # fmt: skip
            tokens += response.usage.completion_tokens if response.usage else 0
            # The schema's 16 records do not fit in max_tokens: a document's start, not a whole.
            objects += (response.choices[0].message.content or "").startswith('{"people"')

    start = time.perf_counter()
    async with client:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return time.perf_counter() - start, tokens, objects


def model_path(name: str, root: Path) -> str:
    """A bench_vs_vllm checkpoint's directory (made on first use), else ``name`` as given."""
    if name not in ("qwen2-23m", "llama-63m"):
        return name
    from bench_vs_vllm import checkpoint  # torch and transformers: only to make one

    return str(checkpoint(name, root))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpoints", type=Path, default=Path("/tmp/ketch-bench-checkpoints"))
    args = parser.parse_args()
    conversations = messages(args.num_requests)
    rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    t0 = time.perf_counter()
    with ketch_server(model_path(args.model, args.checkpoints)) as url:
        # Warm-up: every prompt cached, the grammar compiled, before either side is timed.
        short = argparse.Namespace(**{**vars(args), "max_tokens": 4})
        asyncio.run(run_side(url, conversations, short, True))
        for i in range(args.rounds):
            for side in rates:
                seconds, tokens, objects = asyncio.run(
                    run_side(url, conversations, args, side == "json_schema")
                )
                rate = tokens / seconds
                rates[side].append(rate)
                print(f"  round {i + 1} {side:<14} {rate:7.1f} tok/s ({tokens} tokens, "
                      f"{seconds:.1f} s, {objects} outputs open a people document)")  # fmt: skip
    plain, constrained = (statistics.median(rates[s]) for s in rates)
    print(
        f"\nmodel {args.model}, c={args.concurrency}, {args.num_requests} chat requests x "
        f"{args.max_tokens} tokens (ignore_eos, greedy), {args.rounds} rounds, "
        f"{os.cpu_count()} cores, {time.perf_counter() - t0:.0f} s\n"
    )
    print("| workload | median output tok/s |\n|---|---|")
    print(f"| unconstrained | {plain:.1f} |\n| json_schema (strict) | {constrained:.1f} |")
    ratio = constrained / plain
    verdict = "ok" if ratio >= 0.90 else "MISS"
    print(f"| json_schema / unconstrained | {ratio:.3f} (target >= 0.90: {verdict}) |")


if __name__ == "__main__":
    main()
