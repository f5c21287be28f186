"""Ports: what each ``ketch`` process binds vs what its container declares, its probes use,
its pod's other containers bind, and the Services send traffic to."""

from __future__ import annotations

from ketch.engine.cache_manager.config import CacheManagerConfig
from ketch.engine.ports import Listener
from ketch.engine.serving.config import ServerConfig
from ketch.operator.wiring.pods import Obj, Pod, Process, ns

PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def _listing(listeners: dict[int, Listener]) -> str:
    return ", ".join(
        f"{n} ({flag}{', 127.0.0.1 only' if flag.loopback else ''})"
        for n, flag in sorted(listeners.items())
    )


def _setting(proc: Process, flag: Listener, value: int) -> str:
    """How to make the process use ``value`` for ``flag``: the flag, or the config-file key."""
    key = f"{flag.config_key}: {value} in {proc.source}" if proc.values else None
    return f"{flag.flag} {value}" + (f" (or {key})" if key else "")


def check_ports(proc: Process) -> list[str]:
    """Declared containerPorts vs what the process binds, and the container's probes."""
    problems = []
    listeners = proc.listeners
    declared = {
        int(p["containerPort"]): p.get("name", "") for p in proc.container.get("ports") or []
    }
    by_name = {name: number for number, name in declared.items() if name}
    explained = set()
    for number, name in sorted(declared.items()):
        if number in listeners:
            continue
        compact = name.replace("-", "")
        guesses = [n for n, f in listeners.items() if compact and compact in f.replace("-", "")]
        if len(guesses) != 1:
            guesses = [n for n in listeners if n not in declared]
        label = f"{name or '(unnamed)'} {number}"
        text = f"{proc.where}: declares port {label}, but `ketch {proc.command}`"
        if len(guesses) == 1 and guesses[0] not in declared:
            flag = listeners[guesses[0]]
            explained.add(guesses[0])
            problems.append(
                f"{text} listens on {guesses[0]} ({flag}), not {number}: set "
                f"{_setting(proc, flag, number)}, or containerPort {guesses[0]}"
            )
        else:
            listing = _listing(listeners) or "nothing"
            problems.append(f"{text} does not listen on {number} (it listens on {listing})")
    for number, flag in sorted(listeners.items()):
        if number in declared or number in explained or flag.loopback:
            continue
        problems.append(
            f"{proc.where}: `ketch {proc.command}` listens on {number} ({flag.describe()}), but "
            f"the container declares no port {number}: add containerPort {number} (Services, "
            f"probes and NetworkPolicies reach only declared ports) or change {flag}"
        )
    for kind in PROBES:
        probe = proc.container.get(kind) or {}
        handler = next((h for h in ("httpGet", "tcpSocket", "grpc") if h in probe), None)
        if handler is None:
            continue
        port = probe[handler].get("port")
        path = str(probe[handler].get("path") or "/").split("?", 1)[0]
        target = f"{path} port {port}" if handler == "httpGet" else f"port {port}"
        text = f"{proc.where}: {kind} ({handler} {target})"
        named = isinstance(port, str) and not port.isdigit()
        number = by_name.get(port) if named else None if port is None else int(port)
        if number is None:
            names = sorted(by_name) or "none"
            problems.append(f"{text} names a port the container does not declare (names: {names})")
        elif number not in declared:
            problems.append(f"{text}: {number} is not a declared port of the container")
        elif number not in listeners:
            problems.append(f"{text}: nothing listens on {number}, the probe would fail")
        elif listeners[number].loopback:
            problems.append(
                f"{text}: {number} ({listeners[number]}) is bound on 127.0.0.1 only; the kubelet "
                "probes the pod IP"
            )
        elif handler == "httpGet" and path not in listeners[number].http_paths:
            flag = listeners[number]
            http = {n: f.http_paths for n, f in listeners.items() if f.http}
            serves = f"serves only {list(flag.http_paths)}" if flag.http else "is not HTTP"
            problems.append(f"{text}: {number} ({flag}) {serves}; HTTP paths by port: {http}")
    return problems


def check_pod(pod: Pod) -> list[str]:
    """Containers of one pod share its network: no port twice; engine and sidecar agree."""
    problems = []
    running = [p for p in pod.processes if not p.init]
    seen: dict[int, tuple[Process, Listener]] = {}
    for proc in running:
        for number, flag in proc.listeners.items():
            if number in seen:
                other, other_flag = seen[number]
                problems.append(
                    f"{pod.where}: {other.where.split(', ')[-1]} ({other_flag}) and "
                    f"{proc.where.split(', ')[-1]} ({flag}) both listen on {number}; containers "
                    f"share the pod's network, so one would exit with '{flag} {number} ... is "
                    "not free'"
                )
            seen[number] = (proc, flag)
    engines = [p for p in running if p.command == "serve"]
    sidecars = [p for p in running if p.command == "cache-manager"]
    for engine in engines:
        server = engine.config(ServerConfig)
        for sidecar in sidecars:
            cm = sidecar.config(CacheManagerConfig)
            keys = ["cache_queue_port"] + (["kv_transfer_port"] if server.role != "mixed" else [])
            for key in keys:
                if getattr(server, key) != getattr(cm, key):
                    flag = Listener("--" + key.replace("_", "-"), cm.host)
                    fix = _setting(sidecar, flag, getattr(server, key))
                    problems.append(
                        f"{pod.where}: {engine.where.split(', ')[-1]} uses {key} "
                        f"{getattr(server, key)} (its args over {engine.source}), but "
                        f"{sidecar.where.split(', ')[-1]} listens on {getattr(cm, key)} ({flag}): "
                        f"give both the same value, e.g. {fix} for the sidecar"
                    )
    return problems


def check_service(svc: Obj, pods: list[Pod]) -> list[str]:
    """The selector picks pods; every targetPort is declared there and not loopback-only."""
    selector = (svc.get("spec") or {}).get("selector")
    if not selector:
        return []
    name = f"service {svc['metadata']['name']}"
    matching = [p for p in pods if p.namespace == ns(svc) and p.selected_by(selector)]
    if not matching:
        return [f"{name}: selector {selector} matches no rendered pod template: no endpoints"]
    problems = []
    for port in svc["spec"].get("ports") or []:
        target = port.get("targetPort", port.get("port"))
        text = f"{name}, port {port.get('name') or port.get('port')}: targetPort {target!r}"
        named = isinstance(target, str) and not target.isdigit()
        for pod in matching:
            declared = [
                (c, p) for c in pod.spec.get("containers") or [] for p in c.get("ports") or []
            ]
            hits = [
                (c, int(p["containerPort"]))
                for c, p in declared
                if (p.get("name") == target if named else int(p["containerPort"]) == int(target))
            ]
            if not hits:
                listed = ", ".join(
                    f"{c.get('name')}/{p.get('name', '')} {p['containerPort']}" for c, p in declared
                )
                problems.append(
                    f"{text} is declared by no container of {pod.where} (declared: "
                    f"{listed or 'none'}): traffic to it reaches no listener"
                )
            for proc in pod.processes:
                for container, number in hits:
                    flag = proc.listeners.get(number) if container is proc.container else None
                    if flag is not None and flag.loopback:
                        problems.append(
                            f"{text} is {number} of {proc.where} ({flag}), bound on "
                            f"{flag.host} only: other pods cannot reach it"
                        )
    return problems
