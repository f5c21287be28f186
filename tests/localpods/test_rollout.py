"""The Deployment controller's decisions (``rollout.py``), without processes: the rounding of
maxSurge/maxUnavailable, and whole rollouts played step by step against the invariants a
Deployment keeps (never more than replicas + maxSurge pods, never fewer than replicas -
maxUnavailable available, Recreate's new pods only once every old pod is gone)."""

from __future__ import annotations

import itertools

import pytest

from localpods.rollout import PodView, Strategy, complete, next_step, scaled_value


def deployment(replicas: int, strategy: dict | None = None, min_ready: int = 0) -> dict:
    spec: dict = {"replicas": replicas, "template": {}}
    if strategy is not None:
        spec["strategy"] = strategy
    if min_ready:
        spec["minReadySeconds"] = min_ready
    return {"spec": spec}


def rolling(surge: int | str, unavailable: int | str) -> dict:
    return {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable},
    }


@pytest.mark.parametrize(
    ("replicas", "surge", "unavailable", "want"),
    [
        (2, 1, 0, (1, 0)),
        (2, 0, 0, (0, 1)),  # both 0: unavailable 1, or nothing could move
        (10, "25%", "25%", (3, 2)),  # surge rounds up (2.5 -> 3), unavailable down (2.5 -> 2)
        (3, "10%", "10%", (1, 0)),  # 0.3: surge 1, unavailable 0
        (1, "0%", "0%", (0, 1)),
        (4, "50%", 1, (2, 1)),
    ],
)
def test_surge_rounds_up_and_unavailable_down(replicas, surge, unavailable, want) -> None:
    strategy = Strategy.of(deployment(replicas, rolling(surge, unavailable)))
    assert (strategy.max_surge, strategy.max_unavailable) == want


def test_defaults_are_apps_v1s() -> None:
    strategy = Strategy.of(deployment(4))  # RollingUpdate, 25% / 25%
    assert (strategy.kind, strategy.max_surge, strategy.max_unavailable) == ("RollingUpdate", 1, 1)
    assert Strategy.of(deployment(2, {"type": "Recreate"}, min_ready=7)).min_ready_s == 7


@pytest.mark.parametrize("bad", ["25", "x%", "-1%", 1.5, True])
def test_values_that_are_neither_an_int_nor_a_percentage_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="int or a percentage"):
        scaled_value(bad, 10, round_up=True)


class Simulated:
    """Pods that become ready ``start_ticks`` after creation and available ``min_ready_ticks``
    after that; deleted pods run ``stop_ticks`` more before they are gone."""

    def __init__(self, replicas: int, start_ticks: int = 3, stop_ticks: int = 2, min_ready=0):
        self.ids = itertools.count()
        self.start, self.stop, self.min_ready = start_ticks, stop_ticks, min_ready
        self.pods: dict[str, dict] = {}  # name -> {template, age, deleted_at}
        self.tick = 0
        for _ in range(replicas):
            self._create("old", age=100)

    def _create(self, template: str, age: int = 0) -> None:
        self.pods[f"p{next(self.ids)}"] = {
            "template": template,
            "born": self.tick - age,
            "gone": None,
        }

    def view(self, template: str) -> tuple[list[PodView], list[PodView], bool]:
        new, old, old_running = [], [], False
        for name, pod in self.pods.items():
            age = self.tick - pod["born"]
            if pod["template"] != template and (pod["gone"] is None or pod["gone"] > self.tick):
                old_running = True
            if pod["gone"] is not None:
                continue
            ready = age >= self.start
            view = PodView(name, ready, ready and age - self.start >= self.min_ready)
            (new if pod["template"] == template else old).append(view)
        return new, old, old_running

    def roll(self, strategy: Strategy, replicas: int) -> list[tuple[int, int, bool, bool]]:
        """Plays the rollout to "new"; per tick: pods not deleted, available, any old pod
        running, any new pod there."""
        history = []
        for _ in range(500):
            new, old, old_running = self.view("new")
            history.append((len(new) + len(old), sum(p.available for p in new + old),
                            old_running, bool(new)))  # fmt: skip
            if complete(replicas, new, old):
                return history
            step = next_step(strategy, replicas, new, old, old_running)
            for _ in range(step.create):
                self._create("new")
            for name in step.delete:
                self.pods[name]["gone"] = self.tick + self.stop
            self.tick += 1
        raise AssertionError("the rollout never completed")


@pytest.mark.parametrize(
    ("replicas", "surge", "unavailable"),
    [(2, 1, 0), (2, 0, 1), (5, "25%", "25%"), (10, 3, 2), (3, 0, 0), (1, 1, 0), (4, "100%", 0)],
)
@pytest.mark.parametrize("min_ready", [0, 4])
def test_rolling_update_stays_within_surge_and_unavailable(
    replicas, surge, unavailable, min_ready
) -> None:
    strategy = Strategy.of(deployment(replicas, rolling(surge, unavailable)))
    history = Simulated(replicas, min_ready=min_ready).roll(strategy, replicas)
    assert max(pods for pods, *_ in history) <= replicas + strategy.max_surge
    assert min(available for _, available, *_ in history) >= replicas - strategy.max_unavailable


def test_two_replicas_surge_one_go_one_new_pod_at_a_time() -> None:
    strategy = Strategy.of(deployment(2, rolling(1, 0)))
    history = Simulated(2, min_ready=0).roll(strategy, 2)
    assert max(pods for pods, *_ in history) == 3
    assert min(available for _, available, *_ in history) == 2


def test_min_ready_seconds_hold_the_next_step_back() -> None:
    strategy = Strategy.of(deployment(2, rolling(1, 0), min_ready=5))
    new = [PodView("n", ready=True, available=False)]
    old = [PodView("a", True, True), PodView("b", True, True)]
    assert next_step(strategy, 2, new, old, old_running=True).delete == []
    new = [PodView("n", ready=True, available=True)]
    assert len(next_step(strategy, 2, new, old, old_running=True).delete) == 1


def test_unavailable_old_pods_go_first() -> None:
    strategy = Strategy.of(deployment(2, rolling(1, 0)))
    new = [PodView("n", True, True)]
    old = [PodView("fine", True, True), PodView("broken", False, False)]
    assert next_step(strategy, 2, new, old, old_running=True).delete == ["broken"]


def test_recreate_starts_new_pods_only_when_every_old_one_is_gone() -> None:
    strategy = Strategy.of(deployment(3, {"type": "Recreate"}))
    history = Simulated(3, stop_ticks=4).roll(strategy, 3)
    assert not any(old_running and new for *_, old_running, new in history)
    assert min(available for _, available, *_ in history) == 0


def test_scaling_down_deletes_the_least_ready_first() -> None:
    strategy = Strategy.of(deployment(1, rolling(1, 0)))
    new = [PodView("ready", True, True), PodView("starting", False, False)]
    assert next_step(strategy, 1, new, [], old_running=False).delete == ["starting"]
