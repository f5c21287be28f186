"""Run an InferenceService's pods on this machine, as the operator would render them.

    .venv/bin/python tests/localpods/run.py examples/mixed.yaml
    .venv/bin/python tests/localpods/run.py examples/disaggregated.yaml \
        --secret qwen-api-key=api-key=s3cret

Renders the file with the operator's builders (``ketch-operator render``), localises it (the
built-in tiny model, no GPUs: ``--as-is`` keeps the spec unchanged), starts every pod's
containers as processes and every ClusterIP Service as a proxy on 127.0.0.1, waits until all pods
are ready, prints each Service's local URL, and runs until Ctrl-C (which terminates the pods as
Kubernetes would: preStop, SIGTERM, grace period). Pod logs are under the printed directory.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml

from localpods import LocalCluster, localize


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="an InferenceService YAML file")
    parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("--as-is", action="store_true", help="don't localise the spec")
    parser.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME=KEY=VALUE",
        help="a Secret the pods mount (repeatable)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for ready")
    parser.add_argument(
        "--endpoint-lag",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how long a Service keeps sending to a deleted or unready pod (kube-proxy's lag)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    isvc = yaml.safe_load(Path(args.file).read_text())
    if not args.as_is:
        isvc = localize(isvc)
    secrets: dict[str, dict[str, str]] = {}
    for item in args.secret:
        name, key, value = item.split("=", 2)
        secrets.setdefault(name, {})[key] = value
    cluster = LocalCluster(
        isvc, namespace=args.namespace, secrets=secrets, endpoint_lag_s=args.endpoint_lag
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        cluster.start().wait_ready(args.timeout)
        print(f"pods ready; logs under {cluster.dir}")
        for (service, port), local in sorted(cluster.proxy_ports.items(), key=str):
            if isinstance(port, str):
                print(f"  service {service} port {port}: http://127.0.0.1:{local}")
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        print("terminating the pods")
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
