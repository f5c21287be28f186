"""Runs one forward pass of a checkpoint split across tensor-parallel ranks, one process each
(what ``RemoteRunner`` starts), and returns rank 0's logits at every position: the model-level
check of the sharding, the shared-memory all-reduce and the per-rank KV heads, against Hugging
Face. Spawned processes import this module by name (tests/ is on their path)."""

from __future__ import annotations

import multiprocessing
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

BLOCK = 16


def parallel_logits(
    path: Path, world: int, sequences: list[list[int]], splits: list[int], group: str = "shm"
) -> list[np.ndarray]:
    """Logits at every position of every sequence, computed in two chunked steps (the second
    attends to the first through the KV cache), by ``world`` ranks."""
    from ketch.engine.models.config import ModelConfig
    from ketch.engine.worker.kv_cache import KVCache
    from ketch.engine.worker.remote_runner import free_tcp_port
    from ketch.kernels.collective import ShmGroup, tp_environment

    config = ModelConfig.from_dir(path)
    num_blocks = num_blocks_for(sequences)
    size = KVCache.nbytes(
        config.num_hidden_layers, num_blocks, BLOCK, config.num_key_value_heads, config.head_dim
    )
    kv = SharedMemory(create=True, size=size)
    comm = SharedMemory(create=True, size=ShmGroup.nbytes(world, 1 << 16))
    endpoints = [f"127.0.0.1:{free_tcp_port()}" for _ in range(world)]
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [
        spawn.Process(
            target=_rank,
            args=(str(path), r, world, kv.name, comm.name, sequences, splits, group, results),
            kwargs={"environment": tp_environment(r, endpoints) if group == "paddle" else {}},
            daemon=True,
        )
        for r in range(world)
    ]
    try:
        for process in ranks:
            process.start()
        outcome = results.get(timeout=300)
        for process in ranks:
            process.join(60)
        if isinstance(outcome, str):
            raise AssertionError(f"a rank failed: {outcome}")
        assert all(p.exitcode == 0 for p in ranks), [p.exitcode for p in ranks]
        return outcome
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(5)
        for segment in (kv, comm):
            segment.close()
            segment.unlink()


def _rank(path, rank, world, kv_name, comm_name, sequences, splits, group, results, environment):
    import os
    import traceback

    os.environ.update(environment)
    try:
        logits = _forward(Path(path), rank, world, kv_name, comm_name, sequences, splits, group)
        if rank == 0:
            results.put(logits)
    except Exception:
        results.put(f"rank {rank}: {traceback.format_exc()}")


def _forward(path, rank, world, kv_name, comm_name, sequences, splits, group_kind):
    from ketch.engine.models.backend import build_model
    from ketch.engine.models.config import ModelConfig
    from ketch.engine.models.loader import load_weights
    from ketch.engine.models.sharding import Shard
    from ketch.engine.worker.kv_cache import KVCache
    from ketch.engine.worker.model_runner import configure_paddle
    from ketch.engine.worker.shm import attach_segment
    from ketch.kernels.collective import PaddleGroup, ShmGroup

    configure_paddle(1)
    config = ModelConfig.from_dir(path)
    shard = Shard.of(config, rank, world)
    kv, comm = attach_segment(kv_name), attach_segment(comm_name)
    if group_kind == "paddle":
        group = PaddleGroup()
    else:
        group = ShmGroup(comm.buf, rank, world, slot_bytes=1 << 16)
    weights = load_weights(path, config, "float32", shard)
    model = build_model("native", config, weights, 1024, 1, shard=shard, group=group)
    cache = KVCache(
        config.num_hidden_layers,
        num_blocks_for(sequences),
        BLOCK,
        config.num_key_value_heads,
        config.head_dim,
        buffer=kv.buf,
        heads=shard.kv_heads,
    )
    logits = chunked_logits(model, cache, sequences, splits)
    assert (logits is None) == (rank != 0), "only rank 0 computes logits"
    del cache, model  # the views go before the mappings close
    return logits


def num_blocks_for(sequences: list[list[int]]) -> int:
    """KV blocks for every sequence's own table, plus the reserved block 0."""
    return sum(-(-len(s) // BLOCK) for s in sequences) + 1


def chunked_logits(model, cache, sequences: list[list[int]], splits: list[int]):
    """Logits at every position of every sequence from ``model`` over ``cache``, in two batched
    steps: ``[0, split)`` of each, then the rest (a split at the last token is a decode step).
    None on a tensor-parallel rank other than 0."""
    import paddle

    from ketch.engine.models.attention import SequenceSpan

    tables, next_block = [], 1
    for seq in sequences:
        n = -(-len(seq) // BLOCK)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    pieces: list[list[np.ndarray]] = [[] for _ in sequences]
    for chunk in range(2):
        ids, pos, spans = [], [], []
        for seq, split, table in zip(sequences, splits, tables, strict=True):
            lo, hi = (0, split) if chunk == 0 else (split, len(seq))
            spans.append(SequenceSpan(len(ids), hi - lo, hi, table))
            ids += seq[lo:hi]
            pos += list(range(lo, hi))
        with paddle.no_grad():
            logits = model.forward(
                paddle.to_tensor(np.array(ids, dtype=np.int64)),
                paddle.to_tensor(np.array(pos, dtype=np.int64)),
                cache.layers,
                model.metadata(spans, BLOCK, cache.num_blocks),
                paddle.to_tensor(np.arange(len(ids), dtype=np.int64)),
            )
        if logits is None:
            continue
        logits = logits.numpy()
        for i, span in enumerate(spans):
            pieces[i].append(logits[span.start : span.start + span.query_len])
    return [np.concatenate(p) for p in pieces] if pieces[0] else None


def run_ranks(job, world: int, slot_bytes: int, *args) -> list:
    """``job(group, *args)`` on ``world`` spawned ranks sharing one ``ShmGroup`` segment; each
    rank's return value (or the text of what it raised), in rank order."""
    from ketch.kernels.collective import ShmGroup

    comm = SharedMemory(create=True, size=ShmGroup.nbytes(world, slot_bytes))
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [
        spawn.Process(
            target=_group_job,
            args=(job, r, world, comm.name, slot_bytes, args, results),
            daemon=True,
        )
        for r in range(world)
    ]
    try:
        for process in ranks:
            process.start()
        found = dict(results.get(timeout=120) for _ in ranks)
        return [found[r] for r in range(world)]
    finally:
        for process in ranks:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)
        comm.close()
        comm.unlink()


def _group_job(job, rank, world, comm_name, slot_bytes, args, results):
    import traceback

    from ketch.engine.worker.shm import attach_segment
    from ketch.kernels.collective import ShmGroup

    segment = attach_segment(comm_name)
    group = ShmGroup(segment.buf, rank, world, slot_bytes=slot_bytes, timeout_s=args[-1])
    try:
        results.put((rank, job(group, *args[:-1])))
    except Exception as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-300:]}"))
    finally:
        del group
