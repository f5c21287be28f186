"""The router's settings vs the engines it routes to: instance DNS names and ports."""

from __future__ import annotations

from ketch.engine.router.config import RouterConfig
from ketch.engine.serving.config import ServerConfig
from ketch.operator.wiring.pods import Obj, Pod, Process, ns


def _service_for(dns: str, namespace: str, services: list[Obj]) -> Obj | None:
    parts = dns.rstrip(".").split(".")
    if len(parts) > 2 and parts[2] != "svc":
        return None
    where = parts[1] if len(parts) > 1 else namespace
    return next((s for s in services if s["metadata"]["name"] == parts[0] and ns(s) == where), None)


def check_router(proc: Process, pod: Pod, pods: list[Pod], services: list[Obj]) -> list[str]:
    """The router's instance DNS names, engine_port and pd_comm_port vs the engines."""
    problems = []
    config = proc.config(RouterConfig)
    headless = [
        f"{s['metadata']['name']}.{ns(s)}.svc"
        for s in services
        if (s.get("spec") or {}).get("clusterIP") == "None"
    ]
    for entry in config.entries():
        if entry.dns_name is None:
            continue
        text = f"{proc.where}: {entry.role} instances {entry.dns_name!r} ({proc.source})"
        svc = _service_for(entry.dns_name, pod.namespace, services)
        if svc is None or (svc.get("spec") or {}).get("clusterIP") != "None":
            what = (
                "names no rendered Service"
                if svc is None
                else "names a Service that is not headless"
            )
            problems.append(f"{text} {what}: the router would find no pods; headless: {headless}")
            continue
        selector = svc["spec"].get("selector") or {}
        engines = [
            (p, e)
            for p in pods
            if p.namespace == ns(svc) and selector and p.selected_by(selector)
            for e in p.processes
            if e.command == "serve"
        ]
        if not engines and not any(p.broken for p in pods):
            problems.append(f"{text}: Service {svc['metadata']['name']} selects no `ketch serve`")
        for _, engine in engines:
            server = engine.config(ServerConfig)
            if server.role != entry.role:
                problems.append(f"{text} selects {engine.where}, whose role is {server.role}")
            wanted = [("engine_port", server.port, "--port")]
            if server.role != "mixed":
                wanted.append(("pd_comm_port", server.pd_comm_port, "--pd-comm-port"))
            for key, value, flag in wanted:
                if getattr(config, key) != value:
                    problems.append(
                        f"{proc.where}: router {key} is {getattr(config, key)} "
                        f"({proc.source}), but {engine.where} listens on {value} ({flag}): set "
                        f"{key}: {value} (or --{key.replace('_', '-')} {value})"
                    )
    return problems
