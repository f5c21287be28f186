"""Benchmark: scheduler and KV block manager cost per running sequence per step.

The model is fake (sampled tokens are precomputed), so what is timed is ``Scheduler.schedule()``
plus ``Scheduler.update_from_output()``, including the block manager work they do. Two workloads:

- steady decode: N sequences (prompts of 100-500 tokens sharing a few prefixes, block size 64,
  prefix caching on) all decoding, none finishing while measured;
- chunked admission: the same N decode while finished sequences are replaced by new ones whose
  prompts are prefilled in chunks next to the decodes.

Each is compared with a baseline measured in the same run: a plain loop doing the irreducible
per-sequence work of a step (append the sampled token to a list, compare a counter).

Run as a script, ``.venv/bin/python benchmarks/bench_scheduler.py [--steps 300] [--repeats 5]``;
``--profile`` prints a cProfile of steady decode at N=256 instead. Timings on a shared
machine vary by up to 2x between runs; compare rows of one run, and the ratio column.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from ketch.engine.core.kv_cache_manager import KVCacheManager
from ketch.engine.core.request import Request
from ketch.engine.core.scheduler import Scheduler, SchedulerConfig
from ketch.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ketch.engine.sampling_params import SamplingParams

BLOCK_SIZE = 64
VOCAB_SIZE = 32000
TARGET_US = 1.0
TARGET_N = 256
SIZES = (1, 8, 64, 256, 512)
CHUNK_BUDGET = 2048
"""Tokens per step left for prefill chunks in the chunked-admission workload."""
REPLACEMENT_OUTPUT_TOKENS = (100, 300)
"""Output lengths there: at N=512, ~2.6 replacements of ~300 prompt tokens a step fit the budget."""


class Args(argparse.Namespace):
    """Command-line options."""

    steps: int
    repeats: int
    profile: bool


@dataclass
class Measurement:
    """Seconds spent in the scheduler, summed over the measured steps."""

    schedule_seconds: float = 0.0
    update_seconds: float = 0.0
    seq_steps: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    admitted: int = 0

    @property
    def us_per_seq_step(self) -> float:
        return self.per_seq_step(self.schedule_seconds + self.update_seconds)

    def per_seq_step(self, seconds: float) -> float:
        return 1e6 * seconds / max(self.seq_steps, 1)


class Workload:
    """Makes requests with prompts of 100-500 tokens that share a few prefixes."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.prefixes = [self._tokens(self.rng.randrange(64, 257)) for _ in range(4)]
        self.count = 0

    def request(self, max_tokens: int) -> Request:
        prefix = self.rng.choice(self.prefixes)
        length = self.rng.randrange(100, 501)
        prompt = prefix[:length] + self._tokens(max(length - len(prefix), 1))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.count += 1
        return Request(f"req-{self.count}", prompt, params, max_tokens)

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB_SIZE) for _ in range(n)]


def make_scheduler(n: int, max_tokens: int, chunked: bool) -> Scheduler:
    blocks_per_request = -(-(500 + max_tokens + 1) // BLOCK_SIZE) + 1
    num_blocks = 2 * n * blocks_per_request + 64
    budget = n + CHUNK_BUDGET if chunked else max(n, 8192)
    config = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=budget, max_model_len=4096)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=True))


def fake_model(sched: Scheduler, out: SchedulerOutput, tokens: list[int]) -> ModelRunnerOutput:
    """Samples a precomputed token for every request whose scheduled tokens reach its end."""
    requests = sched.requests
    ids = [
        rid
        for rid, n in out.num_scheduled_tokens.items()
        if requests[rid].num_computed_tokens + n == requests[rid].num_tokens
    ]
    return ModelRunnerOutput(request_ids=ids, sampled_token_ids=tokens[: len(ids)])


def run_steps(
    sched: Scheduler,
    steps: int,
    tokens: list[list[int]],
    on_step: Callable[[SchedulerOutput], None] | None = None,
) -> Measurement:
    """Runs ``steps`` steps, timing only the scheduler's two calls."""
    m = Measurement()
    clock = time.perf_counter
    for step in range(steps):
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        runner_out = fake_model(sched, out, tokens[step % len(tokens)])
        t2 = clock()
        sched.update_from_output(out, runner_out)
        t3 = clock()
        m.schedule_seconds += t1 - t0
        m.update_seconds += t3 - t2
        m.seq_steps += len(out.num_scheduled_tokens)
        m.prefill_tokens += out.total_num_scheduled_tokens - len(out.num_scheduled_tokens)
        m.admitted += len(out.new_requests)
        m.steps += 1
        if on_step is not None:
            on_step(out)
    return m


def until_all_decode(sched: Scheduler, n: int, tokens: list[list[int]]) -> None:
    """Steps (untimed) until all ``n`` requests run and each gets exactly one token."""
    for step in range(10_000):
        out = sched.schedule()
        sched.update_from_output(out, fake_model(sched, out, tokens[step % len(tokens)]))
        scheduled = out.num_scheduled_tokens
        if len(scheduled) == n and all(v == 1 for v in scheduled.values()):
            return
    raise RuntimeError("the workload never reached steady decode")


def steady_decode(n: int, steps: int, seed: int) -> Measurement:
    workload = Workload(seed)
    max_tokens = steps + 100
    sched = make_scheduler(n, max_tokens, chunked=False)
    for _ in range(n):
        sched.add_request(workload.request(max_tokens))
    tokens = precomputed_tokens(n, seed)
    until_all_decode(sched, n, tokens)
    gc.collect()
    m = run_steps(sched, steps, tokens)
    assert sched.num_unfinished == n, "a request finished while measured"
    sched.check_integrity()
    return m


def chunked_admission(n: int, steps: int, seed: int) -> Measurement:
    """N decoding; each finished request is replaced by a new one, prefilled in chunks."""
    workload = Workload(seed)
    rng = random.Random(seed + 1)
    low, high = REPLACEMENT_OUTPUT_TOKENS
    sched = make_scheduler(n, high, chunked=True)

    def refill(out: SchedulerOutput | None = None) -> None:
        for _ in range(n - sched.num_unfinished):
            sched.add_request(workload.request(rng.randrange(low, high + 1)))

    refill()
    tokens = precomputed_tokens(n, seed)
    warmup = 0
    # Untimed: fill every batch slot and let the requests' ages spread out.
    while len(sched.running) < n or warmup < high:
        if warmup > 20 * high:
            raise RuntimeError("admission cannot keep every batch slot filled")
        out = sched.schedule()
        sched.update_from_output(out, fake_model(sched, out, tokens[warmup % len(tokens)]))
        refill()
        warmup += 1
    gc.collect()
    m = run_steps(sched, steps, tokens, refill)
    sched.check_integrity()
    return m


def precomputed_tokens(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed + 2)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for _ in range(16)]


def baseline(n: int, steps: int, seed: int) -> Measurement:
    """The plain loop: per sequence per step, append a token and compare a counter."""
    rng = random.Random(seed)
    seqs = [[0] * rng.randrange(100, 501) for _ in range(n)]
    limits = [len(s) + steps + 100 for s in seqs]
    tokens = precomputed_tokens(n, seed)
    m = Measurement()
    clock = time.perf_counter
    finished = 0
    for step in range(steps):
        sampled = tokens[step % len(tokens)]
        t0 = clock()
        for seq, limit, token in zip(seqs, limits, sampled, strict=False):
            seq.append(token)
            if len(seq) >= limit:
                finished += 1
        m.update_seconds += clock() - t0
        m.seq_steps += n
        m.steps += 1
    assert finished == 0
    return m


@dataclass
class Row:
    """Medians over repeats of one workload at one N, and of the baseline run next to it."""

    total: float
    schedule: float
    update: float
    baseline: float
    prefill_per_step: float
    admitted: float
    steps: int


def measure_row(
    fn: Callable[[int, int, int], Measurement], n: int, steps: int, repeats: int
) -> Row:
    """Alternates workload and baseline runs, so both see the same machine load."""
    runs, bases = [], []
    for seed in range(repeats):
        runs.append(fn(n, steps, seed))
        bases.append(baseline(n, steps, seed))
    med = statistics.median
    return Row(
        total=med(r.us_per_seq_step for r in runs),
        schedule=med(r.per_seq_step(r.schedule_seconds) for r in runs),
        update=med(r.per_seq_step(r.update_seconds) for r in runs),
        baseline=med(b.us_per_seq_step for b in bases),
        prefill_per_step=med(r.prefill_tokens / r.steps for r in runs),
        admitted=med(r.admitted for r in runs),
        steps=runs[0].steps,
    )


def print_table(
    title: str, fn: Callable[[int, int, int], Measurement], args: Args
) -> dict[int, Row]:
    rows = {}
    print(title)
    print(
        f"{'N':>5} {'us/seq/step':>12} {'schedule':>9} {'update':>8} {'plain loop':>11} "
        f"{'ratio':>6} {'prefill tok/step':>17} {'admitted':>9} {'steps':>6}"
    )
    for n in SIZES:
        row = rows[n] = measure_row(fn, n, args.steps, args.repeats)
        print(
            f"{n:>5} {row.total:>12.3f} {row.schedule:>9.3f} {row.update:>8.3f} "
            f"{row.baseline:>11.3f} {row.total / row.baseline:>6.1f} "
            f"{row.prefill_per_step:>17.1f} {row.admitted:>9.0f} {row.steps:>6}"
        )
    print()
    return rows


def print_tables(args: Args) -> None:
    print(
        f"block size {BLOCK_SIZE}, prefix caching on, medians of {args.repeats} runs; times in us"
    )
    print("ratio = scheduler us / plain-loop us (append a token, compare a counter) at that N\n")
    steady = print_table("steady decode", steady_decode, args)
    print_table(
        f"chunked admission: finished requests replaced, prefilled in <= {CHUNK_BUDGET} "
        "tokens/step",
        chunked_admission,
        args,
    )
    verdict = "met" if steady[TARGET_N].total <= TARGET_US else "MISSED"
    print(
        f"target: <= {TARGET_US:.1f} us/seq/step at N={TARGET_N} in steady decode: {verdict} "
        f"({steady[TARGET_N].total:.3f})"
    )


def profile(n: int, steps: int) -> None:
    """cProfile of the steady-decode steps (profiler overhead inflates the absolute times)."""
    workload = Workload(0)
    sched = make_scheduler(n, steps + 100, chunked=False)
    for _ in range(n):
        sched.add_request(workload.request(steps + 100))
    tokens = precomputed_tokens(n, 0)
    until_all_decode(sched, n, tokens)
    profiler = cProfile.Profile()
    profiler.enable()
    run_steps(sched, steps, tokens)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="measured steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per cell (median)")
    parser.add_argument("--profile", action="store_true", help=f"cProfile N={TARGET_N} instead")
    args = parser.parse_args(namespace=Args())
    if args.profile:
        profile(TARGET_N, args.steps)
    else:
        print_tables(args)


if __name__ == "__main__":
    main()
