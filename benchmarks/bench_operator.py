"""Benchmark: how fast the operator turns a burst of InferenceServices into Ready ones.

Against the API-server emulator of the tests (tests/kubeemu, one subprocess), three runs:

- baseline: a no-op kopf operator (one event handler that only notes the time it saw each
  object) on a trivial custom resource; a burst of N objects is created. objects/s = N / (time
  from the first create to the handler seeing the last object): the ceiling of kopf + emulator.
- ketch: the real operator (same kopf, in-process the same way) and a burst of N
  InferenceServices (examples/mixed.yaml with one CPU pod each). Each must get its ConfigMap,
  NetworkPolicy, Services, PodDisruptionBudget and Deployment applied, the emulator's Deployment
  controller must report the pod ready, and the operator must write status Ready=True.
  InferenceServices/s = N / (first create -> last Ready); latency = create -> Ready, per object.
- floor: the same InferenceServices and exactly the operator's requests (6 applies, 2 events, 1
  status patch, one Deployment watch), rendered before the clock starts and sent with no logic
  (``operator_floor``). The emulator's controllers do the same work as in the ketch run, so no
  operator can beat this against this emulator on this machine: ketch / floor is the
  operator's own efficiency, floor / no-op what the API side costs per object. Its creates are
  paced by its own applies (16 connections), so compare obj/s, not its latencies.

Targets (issue #4): ketch ≥ 25% of the no-op ceiling, p99 create -> Ready under 2 s.

Figures (issue 14, burst of 200, the emulator with ReplicaSets, RBAC, Pod Security and CEL
budgets; a shared 2-core machine, so three before/after pairs run alternately and medians taken;
"before" is the commit before the change, operator and emulator both):

    run                         no-op obj/s   ketch obj/s   ratio   p50 s   p99 s
    before (2b47706)                 1026          26.9      0.02     5.2     7.2
    after                            1256          34.3      0.03     4.4     5.5

    operator requests per InferenceService     before   after
    apply (cm, netpol, 2 svc, pdb, deploy)       6.0      6.0   one per child, none repeated
    create events (Reconciled, Ready)            2.0      2.0   (+1 create: the benchmark's)
    patch inferenceservices/status               2.5-2.8  1.0  progress held up to 1 s
    committed writes, all clients + controllers  19.6-19.8 18.0

Where the time goes (py-spy over a whole run, both processes busy): the no-op ceiling is the
speed of the create burst itself (16 connections, ~0.2 s for 200), so the ratio compares a
pipeline of ~18 commits and ~15 watch events per object against one create. About half the
CPU is the emulator (request handling and admission, server-side apply and managedFields,
canonical-JSON comparisons, the Deployment/ReplicaSet controllers and kubelet, watch fan-out
to the operator, kopf and the benchmark's watcher); serialising managedFields was a quarter of
it before FieldsV1 trees were memoised. The other half is the operator process, where kopf's
per-event machinery (watch decoding, causes, handler invocation) costs about three times the
reconciles themselves. Latency is queueing behind that CPU: a single object is Ready in about
0.3 s; in a burst p50 ≈ p99 because everything waits on the same two cores. The 0.25 target is
out of reach while the emulator shares those cores and kopf decodes every child event.

Floor figures (issue 14, 2026-12-02, burst of 200, other work sharing the 2 cores, load 2+):

    run                               obj/s    p50 s    p99 s   ratio to no-op
    no-op kopf handler                294.7    0.293    0.358   1.00
    floor: same writes, no logic       17.0    1.528    2.216   0.06
    ketch operator                      7.7   21.3     25.3     0.03   (ketch / floor 0.45)

So the 0.25 target is out of reach of any operator against this emulator: the ~18 commits
and the controllers' work per object cost the emulator ~16x one create, before the operator
does anything. A real kube-apiserver (Go, on control-plane nodes) is not available here (not
on PyPI, Debian or npm), so the operator cannot be measured against one.

Run as a script: ``.venv/bin/python benchmarks/bench_operator.py [--count 200]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import yaml
from kopf.testing import KopfRunner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from operator_floor import floor_burst, prerender  # noqa: E402

from ketch.operator import crd  # noqa: E402
from ketch.operator.handlers import make_registry  # noqa: E402
from kubeemu import start_emulator  # noqa: E402

NOOP_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "noops.bench.ketch.dev"},
    "spec": {
        "group": "bench.ketch.dev",
        "scope": "Namespaced",
        "names": {"kind": "Noop", "plural": "noops", "singular": "noop", "listKind": "NoopList"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                        },
                    }
                },
            }
        ],
    },
}


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], exists_ok: bool = False
) -> None:
    async with session.post(url, json=body) as response:
        if response.status == 409 and exists_ok:
            return
        if response.status >= 300:
            raise RuntimeError(f"POST {url}: {response.status} {await response.text()}")


async def create_burst(
    base: str, path: str, bodies: list[dict[str, Any]], concurrency: int = 16
) -> dict[str, float]:
    """Creates every object as fast as ``concurrency`` connections allow; returns create times."""
    created: dict[str, float] = {}
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                created[body["metadata"]["name"]] = time.monotonic()
                await post(session, base + path, body)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return created


async def setup(base: str, namespace: str, crds: list[dict[str, Any]]) -> None:
    async with aiohttp.ClientSession() as session:
        for obj in crds:
            await post(
                session,
                base + "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                obj,
                exists_ok=True,
            )
        await post(
            session,
            base + "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        )
    await asyncio.sleep(0.5)  # CRDs become served


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_noop(base: str, count: int) -> dict[str, float]:
    namespace = "bench-noop"
    asyncio.run(setup(base, namespace, [NOOP_CRD]))
    seen: dict[str, float] = {}
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.event("bench.ketch.dev", "v1", "noops", registry=registry)
    def noop(name: str, **_: Any) -> None:
        seen.setdefault(name, time.monotonic())

    bodies = [
        {
            "apiVersion": "bench.ketch.dev/v1",
            "kind": "Noop",
            "metadata": {"name": f"noop-{i}", "namespace": namespace},
            "spec": {"i": i},
        }
        for i in range(count)
    ]
    with KopfRunner(["run", "--standalone", "--namespace", namespace], registry=registry):
        time.sleep(1.0)  # the watch is up
        created = asyncio.run(
            create_burst(base, f"/apis/bench.ketch.dev/v1/namespaces/{namespace}/noops", bodies)
        )
        deadline = time.monotonic() + 120
        while len(seen) < count and time.monotonic() < deadline:
            time.sleep(0.01)
    return summarise("no-op kopf handler", created, seen, count)


def isvc_bodies(namespace: str, count: int) -> list[dict[str, Any]]:
    template = yaml.safe_load((ROOT / "examples" / "mixed.yaml").read_text())
    template["spec"]["roles"]["mixed"]["replicas"] = 1
    bodies = []
    for i in range(count):
        body = json.loads(json.dumps(template))
        body["metadata"] = {"name": f"svc-{i}", "namespace": namespace}
        bodies.append(body)
    return bodies


def start_ready_watcher(base: str, namespace: str, count: int) -> tuple[Any, Any]:
    """A process that watches the namespace's InferenceServices and returns (via the queue)
    when each was first seen Ready=True. Its own process, so that decoding the watch stream
    does not take the measured side's GIL; time.monotonic() is system-wide, so times compare."""
    ready: dict[str, float] = {}

    async def watch() -> None:
        url = f"{base}/apis/{crd.API_VERSION}/namespaces/{namespace}/{crd.PLURAL}"
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                params = {"watch": "true", "timeoutSeconds": "5"}
                async with session.get(url, params=params) as response:
                    async for line in response.content:
                        obj = json.loads(line).get("object") or {}
                        for cond in (obj.get("status") or {}).get("conditions") or []:
                            if cond["type"] == "Ready" and cond["status"] == "True":
                                ready.setdefault(obj["metadata"]["name"], time.monotonic())
                        if len(ready) >= count:
                            return

    results: multiprocessing.Queue = multiprocessing.Queue()

    def watch_process() -> None:
        asyncio.run(watch())
        results.put(dict(ready))

    watcher = multiprocessing.get_context("fork").Process(target=watch_process, daemon=True)
    watcher.start()
    return watcher, results


def collect_ready(watcher: Any, results: Any) -> dict[str, float]:
    try:
        return results.get(timeout=300)
    except queue.Empty:
        watcher.kill()
        return {}


def run_ketch(base: str, count: int) -> dict[str, float]:
    namespace = "bench-ketch"
    asyncio.run(setup(base, namespace, [crd.crd()]))
    bodies = isvc_bodies(namespace, count)
    registry = make_registry(resync_seconds=0)
    with KopfRunner(["run", "--standalone", "--namespace", namespace], registry=registry):
        watcher, results = start_ready_watcher(base, namespace, count)
        time.sleep(1.0)
        created = asyncio.run(
            create_burst(
                base, f"/apis/{crd.API_VERSION}/namespaces/{namespace}/{crd.PLURAL}", bodies
            )
        )
        ready = collect_ready(watcher, results)
    return summarise("ketch operator (create -> Ready)", created, ready, count)


def run_floor(base: str, count: int) -> dict[str, float]:
    """The same requests as the operator's, pre-rendered (``operator_floor``)."""
    namespace = "bench-floor"
    asyncio.run(setup(base, namespace, [crd.crd()]))
    bodies = isvc_bodies(namespace, count)
    rendered = prerender(bodies)
    watcher, results = start_ready_watcher(base, namespace, count)
    time.sleep(1.0)
    created: dict[str, float] = {}
    asyncio.run(floor_burst(namespace, bodies, rendered, created))
    ready = collect_ready(watcher, results)
    return summarise("floor: same writes, no logic", created, ready, count)


def summarise(label: str, created: dict[str, float], done: dict[str, float], count: int) -> dict:
    latencies = [done[n] - created[n] for n in created if n in done]
    start = min(created.values())
    wall = max(done.values()) - start if done else float("nan")
    return {
        "label": label,
        "done": len(done),
        "count": count,
        "wall": wall,
        "rate": len(done) / wall if done else 0.0,
        "p50": percentile(latencies, 0.5) if latencies else float("nan"),
        "p99": percentile(latencies, 0.99) if latencies else float("nan"),
        "mean": statistics.fmean(latencies) if latencies else float("nan"),
    }


def write_counts(before: Any, after: Any, count: int) -> str:
    """The operator's requests during the ketch run, per InferenceService, by verb and resource
    (the emulator's counters), and the writes every client and controller committed."""
    b = before.get("requests_by_resource") or {}
    a = after.get("requests_by_resource") or {}
    lines = []
    for key in sorted(a):
        agent, _, what = key.partition(" ")
        if agent == "ketch-operator" and a[key] != b.get(key, 0):
            lines.append(f"  {what:45} {(a[key] - b.get(key, 0)) / count:5.2f}")
    commits = (after["resourceVersion"] - before["resourceVersion"]) / count
    lines.append(f"  {'committed writes (operator + controllers)':45} {commits:5.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200, help="objects per burst (200)")
    args = parser.parse_args()
    os.environ.setdefault("KOPF_LOG_LEVEL", "WARNING")
    import logging

    logging.basicConfig(level=logging.WARNING)
    emulator = start_emulator()
    os.environ["KUBECONFIG"] = str(emulator.kubeconfig)
    try:
        base = emulator.url
        noop = run_noop(base, args.count)
        floor = run_floor(base, args.count)
        before = emulator.stats()
        ketch = run_ketch(base, args.count)
        after = emulator.stats()
    finally:
        emulator.stop()
    print(f"\nburst of {args.count} objects against the API-server emulator\n")
    print(
        f"{'run':36} {'done':>7} {'wall s':>8} {'obj/s':>8} {'p50 s':>7} {'p99 s':>7} {'ratio':>7}"
    )
    for row in (noop, floor, ketch):
        ratio = row["rate"] / noop["rate"] if noop["rate"] else float("nan")
        print(
            f"{row['label']:36} {row['done']:>3}/{row['count']:<3} {row['wall']:>8.2f} "
            f"{row['rate']:>8.1f} {row['p50']:>7.3f} {row['p99']:>7.3f} {ratio:>7.2f}"
        )
    counts = write_counts(before, after, args.count)
    print(f"\noperator requests per InferenceService (emulator counters):\n{counts}")
    if floor["rate"]:
        own = ketch["rate"] / floor["rate"]
        print(f"\nketch / floor (the operator's own efficiency): {own:.2f}")
    ratio = ketch["rate"] / noop["rate"] if noop["rate"] else 0
    print(
        f"\ntargets: ratio >= 0.25 ({'met' if ratio >= 0.25 else 'MISSED'}), "
        f"p99 < 2 s ({'met' if ketch['p99'] < 2 else 'MISSED'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
