"""The packed GEMM on float32, bfloat16 and int8 weight panels, weights far larger than the L3.

Decode at c=1 multiplies one row by every weight of the model, once per token: the GEMM streams
the weight from memory and is bound by its bytes. bfloat16 panels halve them and int8 panels
quarter them (plus one float32 scale per column), so at 1 row the bfloat16 GEMM should take about
half the float32 time and the int8 one about a quarter; with more rows the FMAs take over (every
panel element is widened to float32 once per tile of rows, then the same FMAs run) and the three
converge. Each call uses the next of ``--copies`` weights, so together they are several times the
L3 and every call reads its weight from DRAM, as a model's layers do.

Prints, per weight shape and row count, the median ms per GEMM of each panel type, the weight
bytes per second it streamed (``PackedWeight.nbytes``), and float32 ÷ bfloat16 and float32 ÷ int8.

Usage: benchmarks/bench_packed_gemm_precision.py [--shapes 4096x4096,4096x11008] [--copies 3]
       [--threads 1] [--isa avx2] [--repeats 30] [--rows 1,8,32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

DTYPES = ("float32", "bfloat16", "int8")


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


def bench_shape(kernel, k: int, n: int, rows: list[int], args, rng) -> None:
    import paddle

    forms: dict[str, list] = {d: [] for d in DTYPES}
    for _ in range(args.copies):
        w = paddle.to_tensor(rng.standard_normal((k, n), np.float32))
        for dtype, packed in forms.items():
            packed.append(kernel.prepare(w, dtype=dtype))
        del w
    nbytes = {d: forms[d][0].nbytes for d in DTYPES}
    sizes = ", ".join(f"{args.copies * nbytes[d] / 2**20:.0f} MiB {d}" for d in DTYPES)
    print(
        f"packed GEMM, isa {kernel.isa}, {args.threads} thread(s), weight [{k}, {n}] "
        f"x {args.copies} copies ({sizes})"
    )
    print(
        f"{'rows':>5} {'f32 ms':>8} {'bf16 ms':>8} {'int8 ms':>8} {'f32 GB/s':>9} "
        f"{'bf16 GB/s':>10} {'int8 GB/s':>10} {'f32/bf16':>9} {'f32/int8':>9}"
    )
    for m in rows:
        x = paddle.to_tensor(rng.standard_normal((m, k), np.float32))
        t = median_seconds({d: rotating(kernel, x, forms[d]) for d in DTYPES}, args.repeats)
        rate = {d: nbytes[d] / t[d] / 1e9 for d in DTYPES}
        print(
            f"{m:>5} {t['float32'] * 1e3:>8.2f} {t['bfloat16'] * 1e3:>8.2f} "
            f"{t['int8'] * 1e3:>8.2f} {rate['float32']:>9.1f} {rate['bfloat16']:>10.1f} "
            f"{rate['int8']:>10.1f} {t['float32'] / t['bfloat16']:>9.2f} "
            f"{t['float32'] / t['int8']:>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x4096,4096x11008", help="KxN,KxN,...")
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--isa", default=None, help="default: the widest this CPU runs")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", default="1,8,32")
    args = parser.parse_args()

    from ketch.kernels.packed_linear import PackedLinear, select_packed_linear

    kernel = select_packed_linear(num_threads=args.threads)
    if args.isa:
        kernel = PackedLinear(args.isa, args.threads)
    rng = np.random.default_rng(0)
    rows = [int(r) for r in args.rows.split(",")]
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.lower().split("x"))
        bench_shape(kernel, k, n, rows, args, rng)


if __name__ == "__main__":
    main()
