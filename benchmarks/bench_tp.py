"""Tensor parallelism on the CPU: TP 1 against TP 2 on a checkpoint where compute dominates, and
where a TP 2 step's time goes.

(a) End to end, offline ``LLM.generate`` of the same requests (greedy, ``ignore_eos``):
    TP 1 with 2 threads in-process, TP 1 with 2 threads in a worker process, TP 2 with one
    thread per rank (the question of issue 17: on 2 cores, does TP 2 beat TP 1 with 2 threads?).
(b) A decode step's breakdown at batch B: each rank runs the sharded model on its own
    (``tp_harness``-style spawned ranks), timing its all-reduces inside the step; compute is
    the rest. The engine's step broadcast (encode once, one send per rank) is timed on its own.
(c) The all-reduce itself: the shared-memory group against paddle.distributed's gloo.

Usage: benchmarks/bench_tp.py [--model PATH] [--requests 32] [--max-tokens 64] [--batch 32]
Default model: the 23M Qwen2 of bench_backend (hidden 512, 8 layers, 8/2 heads, MLP 1408).
Prints one table per part; ratios are within this run.

Results, 2026-12-03, a 2-core AMD EPYC with AVX-512, quiet, defaults (23M Qwen2, 32 requests x
64 tokens; step at batch 32, context 200):

    (a) TP 1, 2 threads, in-process 421.9 tok/s (1.00); TP 1, 2 threads, worker process 402.5
        (0.95); TP 2, 1 thread per rank 553.4 (1.31)
    (b) step ms (compute / all-reduce / step broadcast): TP 1 2 threads 32.57 (32.57 / 0 /
        0.057); TP 1 1 thread 37.83; TP 2 1 thread per rank 23.59 (20.77 / 2.82 / 0.057)
    (c) all-reduce [rows, 512] shared memory vs gloo: 1 row 11.6 vs 1472 us, 32 rows 28.6 vs
        1998 us, 256 rows 122 vs 2052 us

The all-reduce column of (b) is the time a rank spends inside its 16 all-reduces, waiting for
the other rank included (176 us a call against 28.6 us for the collective alone): the ranks'
halves of the step do not take exactly the same time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import threading
import time
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

BLOCK = 16


def end_to_end(model: str, prompts: list[list[int]], max_tokens: int) -> list[tuple]:
    from ketch.engine import LLM, SamplingParams
    from ketch.engine.llm_engine import LLMEngine
    from ketch.engine.worker.remote_runner import free_tcp_port

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    settings = dict(
        max_num_seqs=len(prompts), max_num_batched_tokens=2048, kv_cache_memory="512MiB",
        block_size=BLOCK,
    )  # fmt: skip
    rows = []
    for label, tp, threads, remote in (
        ("TP 1, 2 threads, in-process", 1, 2, False),
        ("TP 1, 2 threads, worker process", 1, 2, True),
        ("TP 2, 1 thread per rank", 2, 1, True),
    ):
        llm = LLM(model, tensor_parallel_size=tp, num_threads=threads, **settings)
        if remote and tp == 1:  # the worker process `ketch serve` uses
            llm.engine.close()
            llm.engine = LLMEngine(llm.engine.config, worker_port=free_tcp_port())
        try:
            llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
        finally:
            llm.engine.close()
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append((label, tokens / elapsed, elapsed))
    return rows


def _step_rank(path, rank, world, threads, kv_name, comm_name, batch, context, steps, out):
    import paddle

    from ketch.engine.models.attention import SequenceSpan
    from ketch.engine.models.backend import build_model
    from ketch.engine.models.config import ModelConfig
    from ketch.engine.models.loader import load_weights
    from ketch.engine.models.sharding import Shard
    from ketch.engine.worker.kv_cache import KVCache
    from ketch.engine.worker.model_runner import configure_paddle
    from ketch.engine.worker.shm import attach_segment
    from ketch.kernels.collective import ShmGroup

    configure_paddle(threads)
    config = ModelConfig.from_dir(Path(path))
    shard = Shard.of(config, rank, world)
    kv = attach_segment(kv_name)
    timed = [0.0]
    group = None
    if world > 1:
        comm = attach_segment(comm_name)
        inner = ShmGroup(comm.buf, rank, world)

        class Timed:
            def __init__(self) -> None:
                self.rank, self.world = rank, world

            def all_reduce(self, x):
                start = time.perf_counter()
                y = inner.all_reduce(x)
                timed[0] += time.perf_counter() - start
                return y

            def broadcast_bytes(self, payload):
                return inner.broadcast_bytes(payload)

        group = Timed()
    weights = load_weights(Path(path), config, "float32", shard)
    model = build_model("native", config, weights, 4096, threads, shard=shard, group=group)
    per_seq = -(-(context + 1) // BLOCK)
    cache = KVCache(
        config.num_hidden_layers, batch * per_seq + 1, BLOCK, config.num_key_value_heads,
        config.head_dim, buffer=kv.buf, heads=shard.kv_heads,
    )  # fmt: skip
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    spans = [SequenceSpan(i, 1, context + 1, tables[i]) for i in range(batch)]
    ids = paddle.to_tensor(np.ones(batch, dtype=np.int64))
    pos = paddle.to_tensor(np.full(batch, context, dtype=np.int64))
    rows = paddle.to_tensor(np.arange(batch, dtype=np.int64))
    meta = model.metadata(spans, BLOCK, cache.num_blocks)
    times = []
    with paddle.no_grad():
        for i in range(steps + 3):
            if i == 3:
                timed[0] = 0.0
            start = time.perf_counter()
            model.forward(ids, pos, cache.layers, meta, rows)
            times.append(time.perf_counter() - start)
    out.put((rank, float(np.median(times[3:])), timed[0] / steps))
    del cache, model


def step_breakdown(path: str, world: int, threads: int, batch: int, context: int, steps: int):
    from ketch.engine.models.config import ModelConfig
    from ketch.engine.worker.kv_cache import KVCache
    from ketch.kernels.collective import ShmGroup

    config = ModelConfig.from_dir(Path(path))
    per_seq = -(-(context + 1) // BLOCK)
    size = KVCache.nbytes(
        config.num_hidden_layers, batch * per_seq + 1, BLOCK, config.num_key_value_heads,
        config.head_dim,
    )  # fmt: skip
    kv = SharedMemory(create=True, size=size)
    comm = SharedMemory(create=True, size=ShmGroup.nbytes(max(world, 1)))
    try:
        results = _on_ranks(
            world,
            _step_rank,
            lambda r, out: (
                path,
                r,
                world,
                threads,
                kv.name,
                comm.name,
                batch,
                context,
                steps,
                out,
            ),
        )
    finally:
        for segment in (kv, comm):
            segment.close()
            segment.unlink()
    step = max(r[1] for r in results)
    reduce = max(r[2] for r in results)
    return step, reduce


def _on_ranks(world: int, target, args) -> list:
    """``target(*args(rank, queue))`` on ``world`` spawned ranks; what each put, by rank."""
    spawn = multiprocessing.get_context("spawn")
    out = spawn.Queue()
    ranks = [spawn.Process(target=target, args=args(r, out)) for r in range(world)]
    try:
        for p in ranks:
            p.start()
        results = sorted(out.get(timeout=600) for _ in ranks)
        for p in ranks:
            p.join(60)
        return results
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()


def broadcast_cost(batch: int, world: int, repeats: int = 300) -> float:
    """The engine's side of a decode step of ``batch`` requests: encode once, send per rank."""
    import zmq

    from ketch.engine.core.scheduler_output import CachedRequestData, SchedulerOutput
    from ketch.engine.worker.messages import encode_step

    ids = [f"req-{i}" for i in range(batch)]
    sched = SchedulerOutput(
        new_requests=[],
        cached_requests=CachedRequestData(ids, [[] for _ in ids], [False] * batch, [200] * batch),
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=batch,
        finished_request_ids=set(),
    )
    context = zmq.Context.instance()
    pairs = []
    for r in range(world):
        a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        address = f"inproc://bench-{r}-{time.monotonic_ns()}"
        a.bind(address)
        b.connect(address)
        pairs.append((a, b))
    stop = threading.Event()

    def drain(sock) -> None:
        while not stop.is_set():
            if sock.poll(10):
                sock.recv()

    drains = [threading.Thread(target=drain, args=(b,), daemon=True) for _, b in pairs]
    for t in drains:
        t.start()
    start = time.perf_counter()
    for _ in range(repeats):
        data = encode_step(sched)
        for a, _ in pairs:
            a.send(data)
    elapsed = (time.perf_counter() - start) / repeats
    stop.set()
    for t in drains:
        t.join()
    for a, b in pairs:
        a.close(0)
        b.close(0)
    return elapsed


def all_reduce_costs(shape: tuple[int, ...]) -> tuple[float, float]:
    from tp_harness import parallel_logits  # noqa: F401  (tests/ on the path)

    shm = _reduce_timing(shape, "shm")
    gloo = _reduce_timing(shape, "paddle")
    return shm, gloo


def _reduce_rank(kind, rank, comm_name, endpoints, shape, out):
    import os

    import paddle

    from ketch.engine.worker.model_runner import configure_paddle
    from ketch.engine.worker.shm import attach_segment
    from ketch.kernels.collective import PaddleGroup, ShmGroup, tp_environment

    configure_paddle(1)
    if kind == "paddle":
        os.environ.update(tp_environment(rank, endpoints))
        group = PaddleGroup()
    else:
        segment = attach_segment(comm_name)
        group = ShmGroup(segment.buf, rank, 2)
    x = paddle.ones(list(shape))
    for _ in range(20):
        group.all_reduce(x)
    start = time.perf_counter()
    for _ in range(200):
        group.all_reduce(x)
    out.put((rank, (time.perf_counter() - start) / 200))
    del group


def _reduce_timing(shape, kind: str) -> float:
    from ketch.engine.worker.remote_runner import free_tcp_port
    from ketch.kernels.collective import ShmGroup

    comm = SharedMemory(create=True, size=ShmGroup.nbytes(2))
    endpoints = [f"127.0.0.1:{free_tcp_port()}" for _ in range(2)]
    try:
        results = _on_ranks(
            2, _reduce_rank, lambda r, out: (kind, r, comm.name, endpoints, shape, out)
        )
    finally:
        comm.close()
        comm.unlink()
    return max(r[1] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: a generated 23M Qwen2)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    from bench_backend import make_23m

    from ketch.engine.models.config import ModelConfig

    tmp = tempfile.TemporaryDirectory()
    path = args.model or str(make_23m(Path(tmp.name) / "qwen2-23m"))
    vocab = ModelConfig.from_dir(Path(path)).vocab_size
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(64, 256, args.requests)
    ]

    rows = end_to_end(path, prompts, args.max_tokens)
    base = rows[0][1]
    print(f"\n(a) offline generate: {args.requests} requests x {args.max_tokens} tokens")
    print(f"{'configuration':34} {'tok/s':>8} {'seconds':>8} {'vs TP 1 in-process':>19}")
    for label, rate, elapsed in rows:
        print(f"{label:34} {rate:8.1f} {elapsed:8.2f} {rate / base:19.2f}")

    print(f"\n(b) one decode step, batch {args.batch}, context {args.context} (ms)")
    print(f"{'configuration':26} {'step':>7} {'compute':>8} {'all-reduce':>11} {'broadcast':>10}")
    for label, world, threads in (("TP 1, 2 threads", 1, 2), ("TP 1, 1 thread", 1, 1),
                                  ("TP 2, 1 thread per rank", 2, 1)):  # fmt: skip
        step, reduce = step_breakdown(path, world, threads, args.batch, args.context, args.steps)
        cast = broadcast_cost(args.batch, world)
        print(
            f"{label:26} {step * 1e3:7.2f} {(step - reduce) * 1e3:8.2f} {reduce * 1e3:11.3f} "
            f"{cast * 1e3:10.3f}"
        )

    hidden = ModelConfig.from_dir(Path(path)).hidden_size
    print("\n(c) all-reduce of float32 [rows, hidden] on 2 ranks (us)")
    print(f"{'rows':>5} {'shared memory':>14} {'gloo':>9} {'gloo / shm':>11}")
    for n in (1, args.batch, 256):
        shm, gloo = all_reduce_costs((n, hidden))
        print(f"{n:5} {shm * 1e6:14.1f} {gloo * 1e6:9.1f} {gloo / shm:11.1f}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
