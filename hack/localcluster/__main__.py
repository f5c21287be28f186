"""python -m localcluster up|down|status|watchdog (``make cluster-up`` / ``make cluster-down``).

up      builds nothing (run hack/build-control-plane.sh first; ``make cluster-up`` does), starts
        etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the service proxy with
        cluster DNS and the node agent, waits until the node is Ready, prints
        ``export KUBECONFIG=<dir>/admin.kubeconfig`` and returns; the cluster keeps running.
down    stops everything ``up`` started and removes the cluster's network; ``--purge`` also
        deletes the directory (state, certificates, logs).
status  says what runs, the server and its version.
Must run as root (network namespaces, veths, the bridge).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from localcluster import controlplane
from localcluster.layout import Layout

DEFAULT_DIR = Path(os.environ.get("KETCH_CLUSTER_DIR", "/tmp/ketch-cluster"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m localcluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster")
    down = sub.add_parser("down", help="stop a cluster")
    status = sub.add_parser("status", help="what runs")
    watchdog = sub.add_parser("watchdog", help=argparse.SUPPRESS)
    for p in (up, down, status, watchdog):
        p.add_argument(
            "--dir",
            type=Path,
            default=DEFAULT_DIR,
            help=f"the cluster's directory (default {DEFAULT_DIR}; $KETCH_CLUSTER_DIR)",
        )
    up.add_argument(
        "--tag",
        default="k0",
        help="short name ([a-z0-9]{1,6}) of its interfaces and namespaces (default k0)",
    )
    up.add_argument(
        "--index",
        type=int,
        default=0,
        help="address block 0-99: pods 10.244.N.0/24, Services 10.96.N.0/24 (default 0)",
    )
    up.add_argument("--no-node-agent", action="store_true", help="no node: pods stay Pending")
    up.add_argument("--no-service-proxy", action="store_true", help="no ClusterIPs, no DNS")
    up.add_argument(
        "--hpa-sync-period",
        default="5s",
        help="kube-controller-manager's --horizontal-pod-autoscaler-sync-period",
    )
    down.add_argument("--purge", action="store_true", help="delete the directory too")
    watchdog.add_argument("--pid", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    if args.cmd in ("up", "down") and os.geteuid() != 0:
        print(
            "localcluster: must run as root (network namespaces, veths, a bridge)", file=sys.stderr
        )
        return 2
    if args.cmd == "up":
        layout = Layout(args.dir.resolve(), args.tag, args.index)
        try:
            state = controlplane.start(
                layout,
                node_agent=not args.no_node_agent,
                service_proxy=not args.no_service_proxy,
                hpa_sync_period=args.hpa_sync_period,
            )
        except RuntimeError as exc:
            print(f"localcluster: {exc}", file=sys.stderr)
            return 1
        print(
            f"# Kubernetes {state['version']} at {state['server']}; logs in {layout.logs}",
            file=sys.stderr,
        )
        print(f"export KUBECONFIG={layout.admin_kubeconfig}")
        return 0
    if args.cmd == "down":
        controlplane.stop(args.dir, remove=args.purge)
        print(f"# cluster in {args.dir} stopped", file=sys.stderr)
        return 0
    if args.cmd == "status":
        state_file = args.dir / controlplane.STATE
        if not state_file.exists():
            print(f"no cluster in {args.dir}")
            return 1
        state = json.loads(state_file.read_text())
        print(f"server {state.get('server')} version {state.get('version')}")
        for name, pid in state["processes"].items():
            print(f"  {name:<24} pid {pid:<8} {'running' if controlplane._alive(pid) else 'gone'}")
        return 0
    # watchdog: stop the cluster when the process that started it ends
    while True:
        try:
            os.kill(args.pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
        if not (args.dir / controlplane.STATE).exists():
            return 0
        time.sleep(1)
    controlplane.stop(args.dir, remove=True, skip=("watchdog",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
