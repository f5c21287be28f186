"""Benchmark: coordinated autoscaling decisions (ketch.operator.autoscaling.decisions), load traces.

Pure logic, no cluster: each trace is the total RequestsWaiting of one role per sync period
(5 s); every pod reports an even share. Compared with

- oracle: the pod count the load needs at that instant, ``ceil(load / target)`` clamped (no lag,
  no hysteresis: a lower bound on replica-seconds, and what a scale-up should reach);
- naive: the same HPA formula with no stabilisation and no cool-down;
- ketch: the defaults (scale-down window 300 s, cool-down 30 s).

Columns: replica-seconds relative to the oracle, periods under-provisioned (fewer pods than the
oracle), reversals (a change in the other direction than the last one: flapping), and the delay
of the first scale-up after the first load step, in sync periods.

Run: ``.venv/bin/python benchmarks/bench_autoscaler.py``.
"""

from __future__ import annotations

import itertools
import math

from ketch.operator.autoscaling import decisions

SYNC = 5.0
TARGET = 4.0
MIN, MAX = 1, 16
STEPS = 240  # 20 minutes


def traces() -> dict[str, list[float]]:
    step = [4.0] * 24 + [40.0] * 96 + [4.0] * 120
    ramp = [4.0 + 56.0 * min(i, 120) / 120 for i in range(STEPS)]
    saw = [40.0 if (i // 6) % 2 == 0 else 4.0 for i in range(STEPS)]
    spiky = [4.0 + (36.0 if i % 17 == 0 else 0.0) for i in range(STEPS)]
    return {"step": step, "ramp": ramp, "sawtooth 30 s": saw, "spikes": spiky}


def oracle(load: float) -> int:
    return min(max(math.ceil(load / TARGET), MIN), MAX)


def run(load: list[float], down_window: float, cooldown: float) -> list[int]:
    coord = decisions.Coordinator(
        {"mixed": decisions.RoleSpec(MIN, MAX, {"RequestsWaiting": TARGET}, 0.0, down_window)},
        cooldown=cooldown,
    )
    current, out = oracle(load[0]), []
    for i, total in enumerate(load):
        values = {"mixed": {"RequestsWaiting": [total / current] * current}}
        decision = coord.step(i * SYNC, {"mixed": current}, values)
        assert decision is not None
        current = decision["mixed"]["to"]
        out.append(current)
    return out


def reversals(replicas: list[int]) -> int:
    changes = [b - a for a, b in itertools.pairwise(replicas) if b != a]
    return sum(1 for x, y in itertools.pairwise(changes) if (x > 0) != (y > 0))


def main() -> None:
    header = f"{'trace':<14} {'policy':<7} {'replica-s':>10} {'vs oracle':>9} "
    header += f"{'under':>6} {'reversals':>9} {'up delay':>8}"
    print(header)
    print("-" * len(header))
    for name, load in traces().items():
        ideal = [oracle(x) for x in load]
        first_step = next((i for i in range(1, len(ideal)) if ideal[i] > ideal[i - 1]), None)
        policies = {
            "oracle": ideal,
            "naive": run(load, 0.0, 0.0),
            "ketch": run(load, decisions.DEFAULT_DOWN_WINDOW, decisions.DEFAULT_COOLDOWN),
        }
        for policy, reps in policies.items():
            used = sum(reps) * SYNC
            under = sum(1 for r, o in zip(reps, ideal, strict=True) if r < o)
            delay = "-"
            if first_step is not None:
                reached = next(
                    (i for i in range(first_step, len(reps)) if reps[i] >= ideal[first_step]),
                    None,
                )
                delay = "never" if reached is None else str(reached - first_step)
            print(
                f"{name:<14} {policy:<7} {used:>10.0f} {used / (sum(ideal) * SYNC):>9.2f} "
                f"{under:>6} {reversals(reps):>9} {delay:>8}"
            )


if __name__ == "__main__":
    main()
