"""Coordinated autoscaling decisions (ketch.operator.autoscaling.decisions), with a fake clock."""

from __future__ import annotations

import itertools

from ketch.operator.autoscaling import decisions as a

SYNC = 5.0


def _run(coord: a.Coordinator, loads: list[dict[str, float]], start: dict[str, int], apply=True):
    """Feeds per-role total load (RequestsWaiting summed over pods) one sync period apart;
    returns the replica counts after each step and the decisions."""
    current = dict(start)
    trace, decisions = [], []
    for i, load in enumerate(loads):
        values = {
            role: {"RequestsWaiting": [load[role] / current[role]] * current[role]}
            for role in coord.roles
        }
        out = coord.step(i * SYNC, current, values)
        assert out is not None
        decisions.append(out)
        if apply:
            current = {**current, **{role: d["to"] for role, d in out.items()}}
        trace.append(dict(current))
    return trace, decisions


def _coord(**kw):
    spec = dict(min_replicas=1, max_replicas=10, targets={"RequestsWaiting": 4.0})
    spec.update(kw.pop("spec", {}))
    roles = kw.pop("roles", ("mixed",))
    return a.Coordinator({r: a.RoleSpec(**spec) for r in roles}, **kw)


def test_recommend_is_the_hpa_formula():
    rec = a.recommend(2, {"RequestsWaiting": [8.0, 8.0]}, {"RequestsWaiting": 4.0}, 1, 10)
    assert rec is not None and rec.replicas == 4
    assert rec.metrics == {"RequestsWaiting": 8.0}
    # within the 10% tolerance: no change
    assert (
        a.recommend(3, {"RequestsWaiting": [4.3] * 3}, {"RequestsWaiting": 4.0}, 1, 10).replicas
        == 3
    )
    # the largest metric wins, clamped to maxReplicas
    rec = a.recommend(
        2,
        {"RequestsWaiting": [1.0, 1.0], "KVCacheUsage": [0.9, 0.9]},
        {"RequestsWaiting": 4.0, "KVCacheUsage": 0.1},
        1,
        5,
    )
    assert rec.replicas == 5 and "maxReplicas" in rec.rule and "KVCacheUsage" in rec.rule
    # pods still starting (3 replicas, 1 ready) count as idle: no second scale-up for them
    rec = a.recommend(3, {"RequestsWaiting": [12.0]}, {"RequestsWaiting": 4.0}, 1, 10)
    assert rec.replicas == 3
    assert a.recommend(0, {}, {"RequestsWaiting": 4.0}, 1, 5) is None
    assert a.recommend(2, {"RequestsWaiting": []}, {"RequestsWaiting": 4.0}, 1, 5) is None


def test_load_step_scales_up_within_one_sync():
    coord = _coord(spec={"down_window": 30.0})
    trace, decisions = _run(coord, [{"mixed": 2}, {"mixed": 24}, {"mixed": 24}], {"mixed": 1})
    assert [t["mixed"] for t in trace] == [1, 6, 6]
    assert decisions[1]["mixed"]["from"] == 1 and "scale up" in decisions[1]["mixed"]["rule"]


def test_scale_down_only_after_the_window():
    coord = _coord(spec={"down_window": 30.0}, cooldown=0)
    loads = [{"mixed": 24}] * 2 + [{"mixed": 4}] * 12
    trace, decisions = _run(coord, loads, {"mixed": 1})
    replicas = [t["mixed"] for t in trace]
    first_down = next(i for i, r in enumerate(replicas) if r < 6)
    # the load dropped at step 2 (t=10); the last high recommendation was at t=5, so the window
    # (30 s) lets the scale-down happen at t=40 at the earliest: step 8
    assert replicas[1] == 6 and first_down == 8 and replicas[-1] == 1
    assert all("stabilisation" in decisions[i]["mixed"]["rule"] for i in range(2, 8))


def test_sawtooth_does_not_flap():
    coord = _coord(spec={"down_window": 60.0})
    loads = [{"mixed": 24 if (i // 3) % 2 == 0 else 2} for i in range(40)]
    trace, _ = _run(coord, loads, {"mixed": 1})
    replicas = [t["mixed"] for t in trace]
    changes = [b - a_ for a_, b in itertools.pairwise(replicas) if b != a_]
    reversals = sum(1 for x, y in itertools.pairwise(changes) if (x > 0) != (y > 0))
    assert reversals == 0 and max(replicas) == 6


def test_cooldown_blocks_an_opposite_change():
    stab = a.Stabilizer(up_window=0, down_window=0, cooldown=30)
    to, _ = stab.decide(0, 1, 4)
    stab.changed(0, 1, to)
    to, rule = stab.decide(10, 4, 1)
    assert to == 4 and "cool-down" in rule
    to, _ = stab.decide(31, 4, 1)
    assert to == 1


def test_ratio_bounds_hold_at_every_step():
    coord = _coord(roles=("prefill", "decode"), ratio_min=0.5, ratio_max=2.0, cooldown=0)
    loads = [
        {"prefill": p, "decode": d}
        for p, d in [(4, 4), (40, 2), (40, 2), (2, 40), (2, 40), (1, 1), (80, 1), (1, 80)]
    ]
    trace, decisions = _run(coord, loads, {"prefill": 1, "decode": 1})
    for t in trace:
        assert 0.5 <= t["prefill"] / t["decode"] <= 2.0, trace
    assert any("ratio" in d["decode"]["rule"] for d in decisions)


def test_ratio_unreachable_is_said():
    p, d, rule = a.coordinate(1, 8, 0.5, 2.0, prefill_max=2, decode_max=10)
    assert (p, d) == (2, 8) and "not reachable" in rule
    assert a.coordinate(2, 2, 0.5, 2.0, prefill_max=5, decode_max=5) == (2, 2, None)


def test_missing_metrics_means_no_decision():
    coord = _coord(roles=("prefill", "decode"))
    out = coord.step(0, {"prefill": 1, "decode": 1}, {"prefill": {"RequestsWaiting": [9.0]}})
    assert out is None


def test_advisory_records_without_changing():
    coord = _coord(spec={"down_window": 0.0}, cooldown=0)
    trace, decisions = _run(coord, [{"mixed": 24}] * 3, {"mixed": 1}, apply=False)
    assert [t["mixed"] for t in trace] == [1, 1, 1]
    history: list = []
    for d in decisions:
        a.record(
            history,
            a.decision(
                "t",
                **{
                    "before": d["mixed"]["from"],
                    "after": d["mixed"]["to"],
                    "metrics": d["mixed"]["metrics"],
                    "rule": d["mixed"]["rule"],
                },
            ),
        )
    assert len(history) == 1 and history[0]["to"] == 6


def test_history_keeps_the_last_ten():
    history: list = []
    for i in range(15):
        a.record(history, a.decision(str(i), i, i + 1, {}, "scale up"))
    assert len(history) == a.HISTORY and history[0]["time"] == "5"


def test_status_writes_carry_new_decisions():
    """The controller writes status.autoscaling when only a decision was added (the loop
    appends in place; what was written must not change with it)."""
    import asyncio

    import yaml
    from test_autoscaling import ROOT, UID

    from ketch.operator.autoscaling.loop import Autoscale
    from ketch.operator.cache import ServiceState
    from ketch.operator.controller import Controller
    from ketch.operator.spec.parse import parse

    class Client:
        def __init__(self):
            self.patches = []

        async def patch_status(self, kind, namespace, name, status):
            self.patches.append(status)

        async def post(self, *args):
            return {}

    body = yaml.safe_load((ROOT / "examples" / "mixed.yaml").read_text())
    body["metadata"].update(name="s", namespace="n", uid=UID, generation=1)
    body["spec"]["roles"]["mixed"]["autoscaling"] = {"mode": "ketch", "maxReplicas": 3}

    async def scenario():
        client = Client()
        c = Controller(client, resync_seconds=0)
        key = ("n", "s")
        tracked = c.cache.tracked[key] = ServiceState(
            body=body, svc=parse(body), applied_generation=1
        )
        state = c.autoscaling.states[key] = Autoscale(settings=None)
        state.status = {"advisory": False, "roles": {"mixed": {"decisions": []}}}
        await c.status.write(key, tracked)
        a.record(state.status["roles"]["mixed"]["decisions"], a.decision("t", 1, 2, {}, "up"))
        await c.status.write(key, tracked)
        return client.patches

    patches = asyncio.run(scenario())
    assert len(patches) == 2
    assert patches[-1]["autoscaling"]["roles"]["mixed"]["decisions"][0]["to"] == 2


def test_scale_order_keeps_the_ratio_between_the_two_calls():
    from ketch.operator.autoscaling.decisions import scale_order

    def d(a: int, b: int) -> dict:
        return {"from": a, "to": b}

    # decode 1 -> 4 and prefill 1 -> 2 with prefill/decode >= 0.5: prefill first ((2, 1) is
    # within [0.5, 1]? no: 2 > 1) -> decode first gives (1, 4) = 0.25, also out; no safe order
    assert set(scale_order({"prefill": d(1, 2), "decode": d(1, 4)}, 0.5, 1)) == {
        "prefill",
        "decode",
    }
    # decode 2 -> 4, prefill 2 -> 3, ratio [0.5, 1.5]: prefill first gives 3/2 = 1.5: fine
    assert scale_order({"prefill": d(2, 3), "decode": d(2, 4)}, 0.5, 1.5) == ["prefill", "decode"]
    # scaling down: decode 4 -> 2, prefill 4 -> 2, ratio [0.75, 1.25]: prefill first gives
    # 2/4 = 0.5 (out), decode first gives 4/2 = 2 (out) -> unchanged order
    assert scale_order({"prefill": d(4, 2), "decode": d(4, 2)}, 0.75, 1.25) == [
        "prefill",
        "decode",
    ]
    # prefill 2 -> 1, decode 4 -> 2, ratio [0.5, 1]: decode first gives 2/2 = 1: fine
    assert scale_order({"prefill": d(2, 1), "decode": d(4, 2)}, 0.5, 1) == ["decode", "prefill"]
    assert scale_order({"mixed": d(1, 3)}, None, None) == ["mixed"]
    assert scale_order({"prefill": d(1, 1), "decode": d(1, 2)}, 0.5, 1) == ["decode"]
