"""The ``ketch-operator`` command: run the operator, render an InferenceService, print the CRD."""

from __future__ import annotations

import argparse
import logging
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ketch.engine.models.architectures import SUPPORTED_ARCHITECTURES
from ketch.operator import api_names, children
from ketch.operator.autoscaling import metric_table
from ketch.operator.crd.document import crd_document
from ketch.operator.spec.parse import InvalidSpec, parse
from ketch.operator.yaml_text import dump_yaml

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"

_EXAMPLES = """examples:
  ketch-operator run                          # every namespace, with peering
  ketch-operator run --standalone -n dev      # no peering object needed (local testing)
  ketch-operator run --namespace llm          # one namespace (repeatable)
  ketch-operator render examples/mixed.yaml   # the children the operator would apply
  ketch-operator check-wiring my-isvc.yaml    # do ports, probes, Services, engine config fit?
  ketch-operator crd | kubectl apply -f -     # install or upgrade the CRD
  ketch-operator adapter-rules                # prometheus-adapter rules for autoscaling
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ketch-operator",
        allow_abbrev=False,
        description="The Ketch Kubernetes operator: reconciles InferenceService objects "
        f"({api_names.CRD_NAME}) into engine Deployments, Services and policies.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        allow_abbrev=False,
        help="run the operator (in a pod, or against $KUBECONFIG)",
        description="Watches InferenceServices and their children and reconciles them. "
        "Credentials: the pod's service account, else $KUBECONFIG or ~/.kube/config.",
    )
    run.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="serve only this namespace (repeatable; kopf glob patterns allowed); "
        "default: every namespace",
    )
    run.add_argument(
        "--standalone",
        action="store_true",
        help="no peering: act even if other operator replicas run (tests, single replica)",
    )
    run.add_argument(
        "--peering",
        default="ketch-operator",
        help="peering object name shared by replicas, so only the highest-priority one acts "
        "(default: ketch-operator; needs the kopf peering CRDs from manifests/)",
    )
    run.add_argument(
        "--priority",
        type=_priority,
        default=0,
        help="peering priority: the replica with the highest acts, the others stand by; 'random' "
        "picks one at start, which makes replicas of one Deployment elect a leader (replicas "
        "of equal priority all pause). Default: 0",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        help="port of /metrics and /healthz (default: 8080; 0 disables)",
    )
    run.add_argument(
        "--resync-seconds",
        type=float,
        default=300.0,
        help="re-apply every InferenceService this often, whatever the events (default: 300)",
    )
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    render = commands.add_parser(
        "render",
        allow_abbrev=False,
        help="print the children the operator would apply for InferenceService file(s)",
        description="Validates each InferenceService in FILE(s) as the API server and the "
        "operator would (CRD schema, its CEL rules, the engine's own checks) and prints, as YAML "
        "documents, the objects the operator applies (same code path). Owner references "
        "need the object's uid: taken from the file when present (e.g. from 'kubectl get -o "
        "yaml'), else from --owner-uid, else a placeholder.",
    )
    render.add_argument(
        "files", nargs="+", metavar="FILE", help="InferenceService YAML ('-' = stdin)"
    )
    render.add_argument(
        "-n", "--namespace", help="namespace of objects that name none (default: 'default')"
    )
    render.add_argument(
        "--owner-uid", help=f"uid for owner references (default: {PLACEHOLDER_UID})"
    )

    check = commands.add_parser(
        "check-wiring",
        allow_abbrev=False,
        help="render InferenceService file(s) and check the children's wiring and engine config",
        description="Renders each InferenceService in FILE(s) like 'render', then reads every "
        "'ketch' container as the process would (its args through the real 'ketch' parser, its "
        "--config file from the rendered ConfigMap) and checks that declared ports, probes, "
        "Services and the router's settings match what the processes listen on, and that each "
        "engine's configuration, GPUs and /dev/shm are what this engine build runs (what it "
        "would refuse at start-up, named by the spec field), and that prefill and decode hold "
        "their KV caches in one dtype. With --model-config, the checkpoint's config.json too: "
        f"its architecture (this build serves {', '.join(SUPPORTED_ARCHITECTURES)}), every "
        "field the engine would refuse at load, at each role's context length and backend, and "
        "the engine container's memory limit against its weights at their precision, the KV "
        "cache and a headroom. Prints each problem and exits 1, or prints one OK line and "
        "exits 0.",
    )
    check.add_argument(
        "files", nargs="+", metavar="FILE", help="InferenceService YAML ('-' = stdin)"
    )
    check.add_argument(
        "-n", "--namespace", help="namespace of objects that name none (default: 'default')"
    )
    check.add_argument(
        "--model-config",
        metavar="PATH",
        type=Path,
        help="a local copy of the served checkpoint (its directory, or its config.json): "
        "checked as the engine checks it at load",
    )

    commands.add_parser(
        "crd",
        allow_abbrev=False,
        help="print the InferenceService CustomResourceDefinition",
        description="Prints the CRD generated from Ketch's configuration definitions.",
    )
    commands.add_parser(
        "adapter-rules",
        allow_abbrev=False,
        help="print the prometheus-adapter rules (Helm values) for the engine's metrics",
        description="Prints the prometheus-adapter Helm values that expose the engine's "
        "Prometheus metrics as the custom metrics the operator's HPAs use "
        "(manifests/metrics/prometheus-adapter-values.yaml).",
    )
    return parser


def _priority(value: str) -> int:
    if value == "random":
        return random.SystemRandom().randint(1, 2**31 - 1)
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither an integer nor 'random'") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "crd":
        sys.stdout.write(dump_yaml(crd_document()))
        return 0
    if args.command == "adapter-rules":
        sys.stdout.write(metric_table.adapter_values())
        return 0
    if args.command == "render":
        return _render(args)
    if args.command == "check-wiring":
        return _check_wiring(args)
    return _run(args)


def load_documents(path: str) -> list[dict[str, Any]]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    for doc in docs:
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: every document must be a mapping")
    return docs


def render_object(
    body: dict[str, Any], *, namespace: str | None = None, owner_uid: str | None = None
) -> list[dict[str, Any]]:
    """The children of one InferenceService object, as the operator builds them."""
    if body.get("apiVersion") != api_names.API_VERSION or body.get("kind") != api_names.KIND:
        raise ValueError(
            f"not an InferenceService: apiVersion {body.get('apiVersion')!r}, kind "
            f"{body.get('kind')!r} (want {api_names.API_VERSION}, {api_names.KIND})"
        )
    body = dict(body)
    meta = dict(body.get("metadata") or {})
    meta.setdefault("namespace", namespace or "default")
    meta["uid"] = meta.get("uid") or owner_uid or PLACEHOLDER_UID
    body["metadata"] = meta
    return children.build(parse(body))


def _render_files(
    args: argparse.Namespace,
) -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]] | int:
    """(file, InferenceService, children) for each object in ``args.files``; or the exit code
    after printing why one could not be rendered."""
    out = []
    for path in args.files:
        try:
            docs = load_documents(path)
            for doc in docs:
                uid = getattr(args, "owner_uid", None)
                out.append((path, doc, render_object(doc, namespace=args.namespace, owner_uid=uid)))
        except FileNotFoundError:
            print(f"ketch-operator: error: {path}: no such file", file=sys.stderr)
            return 2
        except InvalidSpec as exc:
            print(f"ketch-operator: error: {path}: invalid InferenceService:", file=sys.stderr)
            for problem in exc.problems:
                print(f"  {problem}", file=sys.stderr)
            return 1
        except ValueError as exc:
            print(f"ketch-operator: error: {exc}", file=sys.stderr)
            return 1
    return out


def _render(args: argparse.Namespace) -> int:
    rendered = _render_files(args)
    if isinstance(rendered, int):
        return rendered
    sys.stdout.write(render_documents([obj for _, _, children in rendered for obj in children]))
    return 0


def _check_wiring(args: argparse.Namespace) -> int:
    from ketch.operator.wiring import check_wiring

    rendered = _render_files(args)
    if isinstance(rendered, int):
        return rendered
    model_dir = args.model_config
    if model_dir is not None:
        model_dir = model_dir.parent if model_dir.name == "config.json" else model_dir
        if not (model_dir / "config.json").is_file():
            print(
                f"ketch-operator: --model-config: {model_dir} has no config.json", file=sys.stderr
            )
            return 2
    problems = []
    for path, doc, objs in rendered:
        name = (doc.get("metadata") or {}).get("name")
        found = check_wiring(objs, model_dir)
        problems += [f"{path}: {name}: {problem}" for problem in found]
    for problem in problems:
        print(problem)
    if problems:
        print(f"ketch-operator: {len(problems)} wiring problem(s)", file=sys.stderr)
        return 1
    pods = sum(o["kind"] == "Deployment" for _, _, objs in rendered for o in objs)
    print(f"wiring OK: {len(rendered)} InferenceService(s), {pods} Deployment(s) checked")
    return 0


def render_documents(children: list[dict[str, Any]]) -> str:
    return "".join("---\n" + dump_yaml(obj) for obj in children)


def _run(args: argparse.Namespace) -> int:
    import kopf

    from ketch.engine.lifecycle import watch_supervisor
    from ketch.operator.handlers import make_registry

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    watch_supervisor()  # KETCH_WATCH_PID: stop when that process is gone
    registry = make_registry(
        metrics_port=args.metrics_port or None, resync_seconds=args.resync_seconds
    )
    namespaces = list(args.namespace)
    if not args.standalone:
        logging.getLogger("ketch.operator").info(
            "peering %r with priority %d", args.peering, args.priority
        )
    kopf.run(
        registry=registry,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=args.priority,
        clusterwide=not namespaces,
        namespaces=namespaces,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
