"""The packed GEMM on float32 against bfloat16 weight panels, weights far larger than the L3.

Decode at c=1 multiplies one row by every weight of the model, once per token: the GEMM streams
the weight from memory and is bound by its bytes. bfloat16 panels halve them, so at 1 row the
bfloat16 GEMM should take about half the float32 time; with more rows the FMAs take over and the
two converge. Each call uses the next of ``--copies`` weights, so together they are several
times the L3 and every call reads its weight from DRAM, as a model's layers do.

Prints, per row count, the median ms per GEMM, the weight bytes per second it streamed, and the
float32 ÷ bfloat16 time.

Usage: benchmarks/bench_packed_gemm_bf16.py [--k 4096] [--n 4096] [--copies 3] [--threads 1]
       [--isa avx2] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

ROWS = (1, 8, 32)


def median_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each function; they take turns, so drift hits them alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def rotating(kernel, x, weights) -> Callable[[], object]:
    """A call that multiplies by the next weight each time."""
    state = {"i": 0}

    def call() -> object:
        w = weights[state["i"] % len(weights)]
        state["i"] += 1
        return kernel(x, w)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--isa", default=None, help="default: the widest this CPU runs")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    import paddle

    from ketch.kernels.packed_linear import PackedLinear, select_packed_linear

    kernel = select_packed_linear(num_threads=args.threads)
    if args.isa:
        kernel = PackedLinear(args.isa, args.threads)
    rng = np.random.default_rng(0)
    forms: dict[str, list] = {"float32": [], "bfloat16": []}
    for _ in range(args.copies):
        w = paddle.to_tensor(rng.standard_normal((args.k, args.n), np.float32))
        for dtype, packed in forms.items():
            packed.append(kernel.prepare(w, dtype=dtype))
    mib = {d: args.k * args.n * (4 if d == "float32" else 2) / 2**20 for d in forms}
    print(
        f"packed GEMM, isa {kernel.isa}, {args.threads} thread(s), weight [{args.k}, {args.n}] "
        f"x {args.copies} copies ({args.copies * mib['float32']:.0f} MiB float32, "
        f"{args.copies * mib['bfloat16']:.0f} MiB bfloat16)"
    )
    print(
        f"{'rows':>5} {'f32 ms':>8} {'bf16 ms':>8} {'f32 GB/s':>9} {'bf16 GB/s':>10} {'ratio':>6}"
    )
    for rows in ROWS:
        x = paddle.to_tensor(rng.standard_normal((rows, args.k), np.float32))
        fns = {d: rotating(kernel, x, forms[d]) for d in forms}
        t = median_seconds(fns, args.repeats)
        rate = {d: mib[d] * 2**20 / t[d] / 1e9 for d in forms}
        print(
            f"{rows:>5} {t['float32'] * 1e3:>8.2f} {t['bfloat16'] * 1e3:>8.2f} "
            f"{rate['float32']:>9.1f} {rate['bfloat16']:>10.1f} "
            f"{t['float32'] / t['bfloat16']:>6.2f}"
        )


if __name__ == "__main__":
    main()
