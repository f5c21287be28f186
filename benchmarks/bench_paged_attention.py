"""Paged attention: the C++ kernels against the plain-paddle reference and the engine's eager path.

Shapes of the 23M Qwen2 of the vLLM comparison (8 heads / 2 KV heads, head dim 64) with the
engine's default 64-token blocks, block ids shuffled over a cache with room to spare:

- decode: batch 16, every sequence 2048 tokens of context, one new token each;
- prefill chunk: 4 sequences, each a 256-token chunk after a 768-token cached prefix;
- mixed: 12 decodes (2048 context) and 2 such chunks in one call.

Columns are median milliseconds per layer call, all measured in the same run, taking turns in
every round, each call after a 256 MB read that evicts the caches (``--warm`` skips it).
"reference" is ``paged_attention_reference`` (the spec, a Python loop over sequences); "eager"
is ``ketch.engine.models.attention.paged_attention`` (the eager backend's: block gathers into
padded tensors, dense masks; its KV write included, since it cannot be separated); "C++ <isa>
xN" is the kernel on N OpenMP threads (the KV write included in "+write"); "bf16" rows run it
over a bfloat16 copy of the same cache (``--kv-cache-dtype bfloat16``: half the bytes to stream,
each row widened to float32 as it is loaded). Ratios are reference or eager time ÷ kernel time.
Instruction sets the CPU lacks are left out.

Usage: benchmarks/bench_paged_attention.py [--repeats 30] [--threads 1 2] [--warm]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import paddle

from ketch.engine.models.attention import LayerCache, SequenceSpan, build_metadata
from ketch.engine.models.attention import paged_attention as eager_attention
from ketch.kernels.cpu_features import ISA_SPECIFIC_OPS, CpuFeatures
from ketch.kernels.paged_attention import (
    AVX2_OP,
    AVX512_OP,
    PagedAttention,
    PagedAttentionMetadata,
    paged_attention_reference,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 64
CASES = {
    "decode b16 ctx2048": [(1, 2048)] * 16,
    "prefill 4x256 after 768": [(256, 1024)] * 4,
    "mixed 12 decodes + 2 chunks": [(1, 2048)] * 12 + [(256, 1024)] * 2,
}


def timed(
    fns: dict[str, Callable[[], object]], repeats: int, flush: np.ndarray | None = None
) -> dict[str, float]:
    """Median seconds per function; the functions take turns within every round. With ``flush``
    (an array larger than the last-level cache), it is read before every call, untimed, so
    every call finds the KV cache where a model's step does: in memory, not left in the cache
    by the call before (which otherwise favours whichever function follows one that read the
    same blocks)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if flush is not None:
                flush.sum()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in samples.items()}


class Case:
    """One batch: random caches (numpy-backed, as the worker's), queries and both metadatas."""

    def __init__(self, seqs: list[tuple[int, int]], rng: np.random.Generator) -> None:
        blocks_per = [-(-ctx // BLOCK) for _, ctx in seqs]
        num_blocks = sum(blocks_per) + 8
        ids = rng.permutation(np.arange(1, num_blocks))
        offsets = np.cumsum([0, *blocks_per])
        block_ids = [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(seqs))]
        shape = (2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
        self.kv = rng.standard_normal(shape).astype(np.float32)
        # The same keys and values in a bfloat16 cache (rounded to nearest even).
        self.k16, self.v16 = (paddle.to_tensor(self.kv[i]).astype("bfloat16") for i in range(2))
        self.cache = LayerCache(
            k_blocks=paddle.from_dlpack(self.kv[0]),
            v_blocks=paddle.from_dlpack(self.kv[1]),
            k_slots=paddle.from_dlpack(self.kv[0].reshape(-1, HEAD_DIM)),
            v_slots=paddle.from_dlpack(self.kv[1].reshape(-1, HEAD_DIM)),
        )
        tokens = sum(n for n, _ in seqs)
        self.q = paddle.to_tensor(rng.standard_normal((tokens, HEADS, HEAD_DIM), np.float32))
        self.k = paddle.to_tensor(rng.standard_normal((tokens, KV_HEADS, HEAD_DIM), np.float32))
        self.v = paddle.to_tensor(rng.standard_normal((tokens, KV_HEADS, HEAD_DIM), np.float32))
        qlens, ctxs = [n for n, _ in seqs], [c for _, c in seqs]
        self.meta = PagedAttentionMetadata.build(qlens, ctxs, block_ids, BLOCK)
        starts = np.cumsum([0, *qlens])
        rows = zip(starts, qlens, ctxs, block_ids, strict=False)
        spans = [SequenceSpan(int(s), n, c, b) for s, n, c, b in rows]
        self.eager_meta = build_metadata(spans, BLOCK, num_blocks, KV_HEADS, HEADS // KV_HEADS)


def functions(case: Case, kernels: dict[str, PagedAttention]) -> dict[str, Callable[[], object]]:
    c, scale = case, HEAD_DIM**-0.5
    fns: dict[str, Callable[[], object]] = {
        "reference": lambda: paged_attention_reference(
            c.q, c.cache.k_blocks, c.cache.v_blocks, c.meta, scale
        ),
        "eager (+write)": lambda: eager_attention(c.q, c.k, c.v, c.cache, c.eager_meta),
    }
    for name, kernel in kernels.items():
        fns[name] = lambda k=kernel: k(c.q, c.cache.k_blocks, c.cache.v_blocks, c.meta, scale)

    first = next(iter(kernels.values()))

    def with_write() -> object:
        first.write_kv(c.k, c.v, c.cache.k_blocks, c.cache.v_blocks, c.meta)
        return first(c.q, c.cache.k_blocks, c.cache.v_blocks, c.meta, scale)

    fns[f"{next(iter(kernels))} +write"] = with_write
    for name, kernel in kernels.items():
        fns[f"{name} bf16"] = lambda k=kernel: k(c.q, c.k16, c.v16, c.meta, scale)

    def with_write_bf16() -> object:
        first.write_kv(c.k, c.v, c.k16, c.v16, c.meta)
        return first(c.q, c.k16, c.v16, c.meta, scale)

    fns[f"{next(iter(kernels))} bf16 +write"] = with_write_bf16
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--warm",
        action="store_true",
        help="leave the caches as the previous call left them (default: read a 256 MB buffer "
        "before every call, so the KV comes from memory as in a model's step)",
    )
    args = parser.parse_args()
    flush = None if args.warm else np.ones(256 << 18, np.float32)  # 256 MB
    paddle.base.core.set_num_threads(1)
    paddle.set_flags({"FLAGS_use_stride_kernel": False})  # as the worker runs
    features = CpuFeatures.detect()
    isas = [isa for isa, op in (("avx512", AVX512_OP), ("avx2", AVX2_OP)) if features.can_run(op)]
    kernels = {
        f"C++ {isa} x{n}": PagedAttention(isa, n) for isa in [*isas, "generic"]
        for n in args.threads if isa != "generic" or n == 1
    }  # fmt: skip
    print(f"CPU flags from {features.source}; ISA-specific ops: {sorted(ISA_SPECIFIC_OPS)}")
    rng = np.random.default_rng(0)
    for label, seqs in CASES.items():
        case = Case(seqs, rng)
        times = timed(functions(case, kernels), args.repeats, flush)
        ref, eager = times["reference"], times["eager (+write)"]
        print(f"\n{label}  ({len(seqs)} sequences, {case.q.shape[0]} query tokens)")
        print(f"| {'path':<23} | {'ms':>8} | {'ref ÷ this':>10} | {'eager ÷ this':>12} |")
        print(f"|{'-' * 25}|{'-' * 10}|{'-' * 12}|{'-' * 14}|")
        for name, t in times.items():
            print(f"| {name:<23} | {t * 1e3:8.3f} | {ref / t:10.2f} | {eager / t:12.2f} |")


if __name__ == "__main__":
    main()
