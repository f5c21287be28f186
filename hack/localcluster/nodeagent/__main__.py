"""``python -m localcluster.nodeagent``: run the node agent of one local cluster until signalled.

    PYTHONPATH=hack .venv/bin/python -m localcluster.nodeagent \\
        --kubeconfig D/node.kubeconfig --dir D --tag T --index N [--images IMAGES.json] \\
        [--taint key=value:Effect ...] [--capacity cpu=16 ...] [--backoff-base 10] \
        [--backoff-max 300] [--shutdown-grace-period 30] [--keep-logs] [--log-level INFO]

Must run as root (network namespaces, mounts, other users' processes). Stops, cleaning up, on
SIGTERM or SIGINT (a second one kills the pods at once), and when the process whose pid is in
KETCH_WATCH_PID exits. Exit status: 0 after a clean stop, 1 if it could not start.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from localcluster.kubeconfig import Kubeconfig
from localcluster.layout import Layout
from localcluster.nodeagent.agent import Agent, Config
from localcluster.nodeagent.api import Api
from localcluster.nodeagent.images import ImageTable
from localcluster.nodeagent.node import parse_taint
from localcluster.nodeagent.runtime import start_time

logger = logging.getLogger("localcluster.nodeagent")
DEFAULT_TAINT = "ketch.dev/local-node=true:NoSchedule"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m localcluster.nodeagent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--kubeconfig", required=True, type=Path, help="the node's kubeconfig")
    p.add_argument("--dir", required=True, type=Path, help="the cluster's directory")
    p.add_argument("--tag", default="k0", help="the cluster's tag (layout.Layout)")
    p.add_argument("--index", default=0, type=int, help="the cluster's index (layout.Layout)")
    p.add_argument("--images", type=Path, help="image table (JSON); default: the built-in one")
    p.add_argument(
        "--taint", action="append", default=None,
        help=f"key[=value]:Effect, repeatable (default {DEFAULT_TAINT}; 'none': no taint)",
    )  # fmt: skip
    p.add_argument(
        "--backoff-base", type=float, default=10.0,
        help="seconds of the first crash-loop/image-pull back-off (doubles per restart)",
    )  # fmt: skip
    p.add_argument(
        "--capacity", action="append", default=[], metavar="RESOURCE=QUANTITY",
        help="announce this capacity instead of the machine's (e.g. cpu=16), repeatable",
    )  # fmt: skip
    p.add_argument("--backoff-max", type=float, default=300.0, help="back-off limit, seconds")
    p.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="at stop, the most seconds a pod gets to terminate")  # fmt: skip
    p.add_argument("--keep-logs", action="store_true",
                   help="keep container logs under DIR/pods after their pods are gone")  # fmt: skip
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


def watch_pid(stop: threading.Event) -> None:
    """Sets ``stop`` when the process in KETCH_WATCH_PID exits (a test run that died)."""
    value = os.environ.get("KETCH_WATCH_PID", "")
    if not value.isdigit():
        return
    pid = int(value)
    started = start_time(pid)

    def loop() -> None:
        while start_time(pid) == started and started is not None:
            if stop.wait(0.5):
                return
        logger.warning("process %d (KETCH_WATCH_PID) is gone: stopping", pid)
        stop.set()

    threading.Thread(target=loop, name="watch-pid", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if os.geteuid() != 0:
        logger.error("the node agent must run as root")
        return 1
    layout = Layout(directory=args.dir.resolve(), tag=args.tag, index=args.index)
    taint_args = [DEFAULT_TAINT] if args.taint is None else args.taint
    taints = [parse_taint(t) for t in taint_args if t and t != "none"]
    capacity = tuple(tuple(item.split("=", 1)) for item in args.capacity if "=" in item)
    config = Config(
        args.backoff_base, args.backoff_max, args.shutdown_grace_period, args.keep_logs, capacity
    )
    agent = Agent(Api(Kubeconfig(args.kubeconfig)), layout, ImageTable(args.images), taints, config)
    stop, fast = threading.Event(), threading.Event()
    first_signal: list[float] = []

    def on_signal(signum: int, _frame: object) -> None:
        # A second signal more than a second after the first (one sent to the process group and
        # one to the process are a single request) kills the pods without their grace periods.
        if first_signal and time.monotonic() - first_signal[0] > 1.0:
            logger.warning("second %s: killing the pods now", signal.Signals(signum).name)
            fast.set()
        first_signal[:1] = first_signal[:1] or [time.monotonic()]
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    watch_pid(stop)
    try:
        agent.start()
    except Exception:
        logger.exception("node agent could not start")
        agent.stop(fast)
        return 1
    while not stop.wait(1.0):
        pass
    agent.stop(fast)
    return 0


if __name__ == "__main__":
    sys.exit(main())
