"""CPU time per output token on each side of the engine socket, this checkout against a commit.

The engine process's share: ``LLMEngine.step`` plus encoding the step's frame. The API server's
share: decoding each frame and routing its deltas to the requests' queues (and, since the engine
emits token ids, making their text). 32 streamed requests of 64 tokens on the null runner (no
model), measured in this thread's CPU time (``time.thread_time``), the least of ``--rounds``
runs: on a loaded machine wall-clock A/B rounds vary by tens of percent, CPU time much less.

Usage:
    .venv/bin/python benchmarks/bench_output_path.py [--rev 1d5b531] [--rounds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_ab_serving import checkout

BATCH, TOKENS = 32, 64


def measure(rounds: int, stop: list[str]) -> tuple[float, float]:
    """(engine µs/token, API server µs/token) with the ``ketch`` on ``sys.path``."""
    from ketch.engine import LLM, EngineConfig, SamplingParams
    from ketch.engine.engine_client import EngineClient

    try:  # this layout, or the one before the engine emitted token ids
        from ketch.engine.engine_messages import encode_step
        from ketch.engine.output_processor import OutputProcessor
    except ImportError:
        from ketch.engine.core.messages import encode_step

        OutputProcessor = None

    llm = LLM("tiny", runner="null", block_size=16, kv_cache_memory="64MiB", max_num_seqs=64)
    client = EngineClient(EngineConfig(model="tiny"), port=9, run_dir=Path(tempfile.mkdtemp()))
    if OutputProcessor is not None:
        client.processor = OutputProcessor(llm.tokenizer)
    ids = itertools.count()

    def one() -> tuple[float, float]:
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, stop=stop)
        prompts = {f"r{next(ids)}": [5 + i, 6, 7, 8] for i in range(BATCH)}
        for request_id, prompt in prompts.items():
            llm.engine.add_request(request_id, prompt, params)
            client._queues[request_id] = asyncio.Queue()
            if OutputProcessor is not None:
                client.processor.add_request(request_id, prompt, params)
        frames, tokens, engine_s = [], 0, 0.0
        while llm.engine.has_unfinished_requests():
            start = time.thread_time()
            deltas = llm.engine.step()
            frames += encode_step(deltas, llm.engine.snapshot())
            engine_s += time.thread_time() - start
            tokens += sum(len(d.new_token_ids) for d in deltas)
        start = time.thread_time()
        for frame in frames:
            client._take(frame)
        api_s = time.thread_time() - start
        for request_id in prompts:
            del client._queues[request_id]
        return engine_s / tokens * 1e6, api_s / tokens * 1e6

    try:
        runs = [one() for _ in range(rounds)]
    finally:
        client._requests.close(linger=0)
        client._outputs.close(linger=0)
        client._context.term()
    return min(r[0] for r in runs), min(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="1d5b531", help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one side: print its figures
        for stop in ([], ["zzzz"]):
            engine, api = measure(args.rounds, stop)
            print(f"stop={stop!s:9} engine {engine:5.1f} us/token, API server {api:5.1f} us/token")
        return
    here = [str(Path(__file__).resolve().parent.parent / p) for p in ("engine", "kernels")]
    with (
        tempfile.TemporaryDirectory(prefix="bench-output-") as tmp,
        checkout(args.rev, Path(tmp) / "old") as old_path,
    ):
        for label, path in ((args.rev, old_path), ("current", os.pathsep.join(here))):
            print(f"{label}:", flush=True)
            env = {**os.environ, "PYTHONPATH": path or ""}
            command = [sys.executable, __file__, "--child", "--rounds", str(args.rounds)]
            subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()
