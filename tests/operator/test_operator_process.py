"""`ketch-operator run` as a process: metrics, health, clean shutdown, and peering failover."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import operator_rbac
import pytest
from test_e2e import Cluster, condition, cpu_example, fresh_namespace, ready, wait_for

from ketch.operator import api_names
from procs import free_ports

ROOT = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).parent / "ketch-operator")


class OperatorProcess:
    """`ketch-operator run` signed in as its ServiceAccount with the manifests' RBAC."""

    def __init__(self, cluster: Cluster, *args: str, log: Path):
        (self.metrics_port,) = free_ports(1)
        self.log = log
        kubeconfig = operator_rbac.install(
            cluster.kube, cluster.namespace, log.with_suffix(".rbac")
        )
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        self.proc = subprocess.Popen(
            [
                EXE,
                "run",
                "--namespace",
                cluster.namespace,
                "--metrics-port",
                str(self.metrics_port),
                "--log-level",
                "INFO",
                *args,
            ],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}{path}", timeout=5
            ) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
        return self.proc.returncode


@pytest.fixture
def cluster(kube) -> Iterator[Cluster]:
    with fresh_namespace(kube, "proc") as c:
        yield c


def test_operator_process_serves_metrics_and_health_and_stops_cleanly(cluster, tmp_path):
    op = OperatorProcess(cluster, "--standalone", log=tmp_path / "operator.log")
    try:
        wait_for(lambda: op.get("/healthz")[0] == 200, "/healthz", timeout=60)
        cluster.apply(cpu_example("metered"))
        wait_for(lambda: ready(cluster, "metered"), "metered Ready")
        status, text = op.get("/metrics")
        assert status == 200
        full = [
            line
            for line in text.splitlines()
            if line.startswith('ketch_operator_reconciles_total{kind="full"}')
        ]
        assert full and float(full[0].split()[-1]) >= 1
        assert "ketch_operator_reconcile_duration_seconds_bucket" in text
        assert "ketch_operator_inferenceservices 1.0" in text
        health = json.loads(op.get("/healthz")[1])
        assert health["ok"] is True
    finally:
        code = op.stop()
    assert code == 0, op.output()
    assert "generation 1 applied" in op.output()


def test_two_replicas_with_peering_one_acts_and_the_other_takes_over(cluster, tmp_path):
    """kopf peering: the higher priority acts, the lower pauses; when the leader stops, the
    standby resumes and reconciles what changed meanwhile."""
    for name in ("kopfpeerings.kopf.dev.yaml",):
        cluster.run("apply", "-f", str(ROOT / "manifests" / "crds" / name), ns=False)
    peering = {
        "apiVersion": "kopf.dev/v1",
        "kind": "KopfPeering",
        "metadata": {"name": "ketch-operator", "namespace": cluster.namespace},
    }
    cluster.apply(peering)
    leader = OperatorProcess(cluster, "--priority", "2", log=tmp_path / "leader.log")
    standby = None
    try:
        wait_for(lambda: leader.get("/healthz")[0] == 200, "the leader to start", timeout=60)
        standby = OperatorProcess(cluster, "--priority", "1", log=tmp_path / "standby.log")
        wait_for(lambda: standby.get("/healthz")[0] == 200, "the standby to start", timeout=60)
        time.sleep(2)  # the standby reads the peering object and stays paused
        cluster.apply(cpu_example("led"))
        wait_for(lambda: ready(cluster, "led"), "led Ready")
        assert "led: generation 1 applied" in leader.output()
        assert "led: generation" not in standby.output()
        assert leader.stop() == 0, leader.output()
        wait_for(
            lambda: "Resuming" in standby.output() or "resuming" in standby.output(),
            "the standby to resume",
            timeout=90,
        )
        cluster.run(
            "patch",
            api_names.PLURAL,
            "led",
            "--type",
            "merge",
            "-p",
            json.dumps({"spec": {"engine": {"maxNumSeqs": 9}}}),
        )
        body = wait_for(
            lambda: (b := ready(cluster, "led")) and b["metadata"]["generation"] == 2 and b,
            "the standby to reconcile generation 2",
        )
        assert condition(body, "Ready")["status"] == "True"
        assert "led: generation 2 applied" in standby.output()
    finally:
        leader.stop(signal.SIGKILL)
        if standby is not None:
            assert standby.stop() == 0, standby.output()
