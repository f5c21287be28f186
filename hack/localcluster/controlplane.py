"""Start and stop one local cluster: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler (upstream binaries, see ``hack/build-control-plane.sh``), the node agent and the
service proxy with cluster DNS.

``start(layout)`` makes the certificates and kubeconfigs, starts each program as a detached
process (its log in ``<dir>/logs``), waits until each answers, and records every process in
``<dir>/state.json``; ``stop(directory)`` ends them all (node agent first, so pods terminate
gracefully), removes the cluster's network (bridge, service interface, pod network namespaces)
and leaves nothing running. ``start(..., watch_pid=P)`` also starts a watchdog that stops the
cluster when process P ends (the test run's fixture uses it: a killed pytest leaves nothing).

The API server is configured as a production one would be where it matters to Ketch: TLS on
every connection, client-certificate identities, ``Node,RBAC`` authorization, the default
admission plugins (PodSecurity, ServiceAccount, LimitRanger, ...) plus NodeRestriction and
PodTolerationRestriction, service-account token issuing, the aggregation layer (custom metrics
API), and an audit log of every write (the tests read what the operator sent from it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from localcluster import components, pki
from localcluster.kubeapi import ApiError, KubeApi, write_kubeconfig
from localcluster.layout import Layout

log = logging.getLogger("localcluster")

HACK = components.HACK
NODE_TAINT = components.NODE_TAINT
STATE = "state.json"
KUBE_DNS_PATH = "/api/v1/namespaces/kube-system/services/kube-dns"
# Order of stopping: pods first (the node agent terminates them), then what watches the API,
# then the API server, then its store.
STOP_ORDER = (
    "watchdog",
    "node-agent",
    "service-proxy",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-apiserver",
    "etcd",
)


def bin_cache() -> Path:
    return Path(os.environ.get("KETCH_BIN_CACHE", Path.home() / ".cache" / "ketch"))


def module_version(module_dir: str, module: str) -> str:
    """The version the wrapper module ``hack/<module_dir>/go.mod`` requires of ``module``."""
    text = (HACK / module_dir / "go.mod").read_text()
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", text, re.M)
    if not match:
        raise RuntimeError(f"hack/{module_dir}/go.mod requires no {module}")
    return match.group(1)


def binaries() -> dict[str, Path]:
    """Where the built programs are; says how to build them when one is missing."""
    k8s = bin_cache() / "k8s" / module_version("k8s", "k8s.io/kubernetes") / "bin"
    etcd = bin_cache() / "etcd" / module_version("etcd", "go.etcd.io/etcd/server/v3") / "bin"
    out = {
        "etcd": etcd / "etcd",
        "kube-apiserver": k8s / "kube-apiserver",
        "kube-controller-manager": k8s / "kube-controller-manager",
        "kube-scheduler": k8s / "kube-scheduler",
    }
    missing = [str(p) for p in out.values() if not os.access(p, os.X_OK)]
    if missing:
        raise RuntimeError(
            f"not built: {', '.join(missing)}; run hack/build-control-plane.sh (needs Go)"
        )
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def ensure_bridge(layout: Layout) -> None:
    """The pods' bridge with the node's address: the API server listens there, pods reach it
    (and every ClusterIP) through it. The node agent adds the pods' veths to it."""
    if _ip("link", "show", layout.bridge, check=False).returncode != 0:
        _ip("link", "add", layout.bridge, "type", "bridge")
    addr = f"{layout.gateway}/{layout.pod_cidr.prefixlen}"
    if addr not in _ip("-o", "addr", "show", "dev", layout.bridge).stdout:
        _ip("addr", "add", addr, "dev", layout.bridge)
    _ip("link", "set", layout.bridge, "up")


def remove_network(layout: Layout) -> None:
    """Everything of this cluster's network that is still there (idempotent)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(layout.netns_prefix):
            _ip("netns", "delete", name, check=False)
    for dev in (layout.bridge, layout.service_interface):
        _ip("link", "delete", dev, check=False)


def _write_files(layout: Layout, server: str) -> None:
    d, p = layout.directory, layout.pki
    ca = p / "ca.crt"
    for name, user in (
        ("admin", "ketch-admin"),
        ("controller-manager", "system:kube-controller-manager"),
        ("scheduler", "system:kube-scheduler"),
        ("node", f"system:node:{layout.node_name}"),
        ("service-proxy", "ketch:service-proxy"),
    ):
        write_kubeconfig(
            layout.kubeconfig(name),
            server,
            ca,
            user=user,
            cert=p / f"{name}.crt",
            key=p / f"{name}.key",
        )
    # Every pod tolerates the node's taint by default (PodTolerationRestriction's cluster-wide
    # default); fake (KWOK) nodes carry their own taint, which only the pods meant for them
    # tolerate.
    key, rest = NODE_TAINT.split("=", 1)
    effect = rest.split(":", 1)[1]
    (d / "admission.yaml").write_text(
        "apiVersion: apiserver.config.k8s.io/v1\n"
        "kind: AdmissionConfiguration\n"
        "plugins:\n"
        "- name: PodTolerationRestriction\n"
        "  configuration:\n"
        "    apiVersion: podtolerationrestriction.admission.k8s.io/v1alpha1\n"
        "    kind: Configuration\n"
        "    default:\n"
        f"    - {{key: {key}, operator: Exists, effect: {effect}}}\n"
    )
    # Writes at Request level (their bodies: what a client sent), reads at Metadata level (who
    # asked for what; the tests count a client's lists), nothing for leases and events (the
    # node agent's and controllers' heartbeats).
    (d / "audit-policy.yaml").write_text(
        "apiVersion: audit.k8s.io/v1\n"
        "kind: Policy\n"
        "omitStages: [RequestReceived]\n"
        "rules:\n"
        "- level: None\n"
        "  resources:\n"
        "  - {group: coordination.k8s.io, resources: [leases]}\n"
        "  - {group: '', resources: [events]}\n"
        "  - {group: events.k8s.io, resources: [events]}\n"
        "- level: None\n"
        "  nonResourceURLs: ['/healthz*', '/readyz*', '/livez*', '/version', '/openapi*']\n"
        "- level: None\n"
        "  nonResourceURLs: ['/api', '/api/*', '/apis', '/apis/*']\n"
        "- level: Request\n"
        "  verbs: [create, update, patch, delete, deletecollection]\n"
        "- level: Metadata\n"
    )


def _spawn(layout: Layout, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Start one program detached (its own session), output to ``logs/<name>.log``."""
    layout.logs.mkdir(parents=True, exist_ok=True)
    with open(layout.logs / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env or os.environ.copy(),
            cwd=str(layout.directory),
        )
    log.info("started %s (pid %d)", name, proc.pid)
    return proc.pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie of ours (we are its parent) is not alive.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


def _wait(what: str, check: Any, timeout: float, pid: int | None, log_file: Path) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if pid is not None and not _alive(pid):
            tail = log_file.read_text(errors="replace")[-3000:] if log_file.exists() else ""
            raise RuntimeError(f"{what} exited while starting; its log ends:\n{tail}")
        try:
            result = check()
            if result:
                return result
        except Exception as exc:
            last = exc
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s (last error: {last})")


def _healthz(port: int) -> bool:
    import ssl
    import urllib.request

    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=2) as r:
        return r.status == 200


BOOTSTRAP_RBAC = [
    # The service proxy reads Services and EndpointSlices, nothing else.
    (
        "/apis/rbac.authorization.k8s.io/v1/clusterroles/ketch:service-proxy",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "ketch:service-proxy"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["services"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
    ),
    (
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/ketch:service-proxy",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "ketch:service-proxy"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "ketch:service-proxy",
            },
            "subjects": [
                {
                    "kind": "User",
                    "apiGroup": "rbac.authorization.k8s.io",
                    "name": "ketch:service-proxy",
                }
            ],
        },
    ),
]


def start(
    layout: Layout,
    *,
    node_agent: bool = True,
    service_proxy: bool = True,
    watch_pid: int | None = None,
    hpa_sync_period: str = "5s",
    agent_args: tuple[str, ...] = (),
    timeout: float = 90,
) -> dict[str, Any]:
    """Start a cluster in ``layout.directory`` (made fresh) and return its state record."""
    d = layout.directory
    if (d / STATE).exists():
        raise RuntimeError(f"{d} holds a cluster already (state.json): stop it first")
    bins = binaries()
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o755)
    layout.logs.mkdir(exist_ok=True)
    state: dict[str, Any] = {
        "tag": layout.tag,
        "index": layout.index,
        "processes": {},
        "argv": {},
    }

    def run(name: str, argv: list[str], ready: Any = None, what: str = "", env: Any = None) -> None:
        """Starts ``name`` and records it; waits until ``ready()`` when given."""
        state["argv"][name] = argv
        state["processes"][name] = _spawn(layout, name, argv, env)
        (d / STATE).write_text(json.dumps(state, indent=1))
        if ready is not None:
            log_file = layout.logs / f"{name}.log"
            _wait(what or name, ready, timeout, state["processes"][name], log_file)

    try:
        ensure_bridge(layout)
        host = str(layout.gateway)
        pki.make_all(
            layout.pki,
            node_name=layout.node_name,
            server_names=components.apiserver_names(layout),
            node_ip=host,
        )
        api_port = free_port(host)
        state["server"] = f"https://{host}:{api_port}"
        _write_files(layout, state["server"])

        etcd = components.Etcd(free_port(), free_port(), free_port())
        state["etcd"] = etcd.url
        run("etcd", etcd.argv(bins["etcd"], layout), lambda: _etcd_healthy(etcd.url))
        argv = components.apiserver(bins["kube-apiserver"], layout, etcd.url, api_port)
        with _admin(layout) as api:
            run("kube-apiserver", argv, lambda: api.get("/readyz") == "ok")
            for path, obj in BOOTSTRAP_RBAC:
                api.apply(path, obj)

        kcm_port, sched_port = free_port(), free_port()
        kcm = components.controller_manager(bins, layout, kcm_port, hpa_sync_period)
        run("kube-controller-manager", kcm, lambda: _healthz(kcm_port))
        sched = components.scheduler(bins, layout, sched_port)
        run("kube-scheduler", sched, lambda: _healthz(sched_port))

        py_env = components.python_env()
        if service_proxy:
            with _admin(layout) as api:  # cluster DNS's address, reserved as kube-dns's is
                api.apply(KUBE_DNS_PATH, components.kube_dns_service(layout))
            from localcluster.proxy.dns import probe

            run(
                "service-proxy",
                components.service_proxy(layout),
                lambda: probe(str(layout.dns_ip)),
                "service proxy (cluster DNS answers)",
                py_env,
            )
        if node_agent:
            argv = components.node_agent(layout, _image_table(layout), agent_args)
            with _admin(layout) as api:
                ready = lambda: _node_ready(api, layout.node_name)  # noqa: E731
                run("node-agent", argv, ready, "node agent (Node Ready)", py_env)
        if watch_pid:
            run("watchdog", components.watchdog(layout, watch_pid), env=py_env)
        with _admin(layout) as api:  # pods can be made in `default` once its SA exists
            default_sa = "/api/v1/namespaces/default/serviceaccounts/default"
            kcm_log = layout.logs / "kube-controller-manager.log"
            _wait(
                "the default ServiceAccount",
                lambda: api.get(default_sa),
                timeout,
                None,
                kcm_log,
            )
            state["version"] = api.get("/version")["gitVersion"]
        (d / STATE).write_text(json.dumps(state, indent=1))
        return state
    except BaseException:
        stop(d, remove=False)
        raise


@contextlib.contextmanager
def _admin(layout: Layout) -> Iterator[KubeApi]:
    api = KubeApi(layout.admin_kubeconfig)
    try:
        yield api
    finally:
        api.close()


def _etcd_healthy(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
        return json.loads(r.read()).get("health") == "true"


def _image_table(layout: Layout) -> Path:
    """The node agent's image table: its built-in images (Ketch's engine and operator run
    this checkout's install) and the monitoring stack's (built by build-control-plane.sh)."""
    from localcluster import metrics
    from localcluster.nodeagent import images

    path = layout.directory / "images.json"
    path.write_text(json.dumps(images.default_table() + metrics.image_entries(), indent=1))
    return path


def _node_ready(api: KubeApi, node: str) -> bool:
    try:
        body = api.get(f"/api/v1/nodes/{node}")
    except ApiError:
        return False
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in body.get("status", {}).get("conditions", [])
    )


def _terminate(pid: int, grace: float) -> None:
    """SIGTERM the process (and its session), SIGKILL what is left after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)


def stop(directory: Path, *, remove: bool = False, skip: tuple[str, ...] = ()) -> None:
    """Stop the cluster recorded in ``directory`` (idempotent); ``remove`` deletes the directory.
    ``skip``: process names not to stop (the watchdog stopping the cluster skips itself)."""
    directory = Path(directory)
    state_file = directory / STATE
    if not state_file.exists():
        if remove:
            shutil.rmtree(directory, ignore_errors=True)
        return
    state = json.loads(state_file.read_text())
    procs: dict[str, int] = state.get("processes", {})
    grace = {"node-agent": 60.0}
    for name in STOP_ORDER:
        if name in procs and name not in skip:
            _terminate(procs[name], grace.get(name, 10.0))
    layout = Layout(directory, state["tag"], state["index"])
    remove_network(layout)
    state_file.unlink(missing_ok=True)
    if remove:
        shutil.rmtree(directory, ignore_errors=True)


def restart(directory: Path, name: str, timeout: float = 60) -> None:
    """Stop one program of the cluster and start it again with the same command line (the
    tests restart kube-apiserver: every watch ends and old resourceVersions become too old)."""
    directory = Path(directory)
    state = json.loads((directory / STATE).read_text())
    layout = Layout(directory, state["tag"], state["index"])
    _terminate(state["processes"][name], 10.0)
    pid = _spawn(layout, name, state["argv"][name], components.python_env())
    state["processes"][name] = pid
    (directory / STATE).write_text(json.dumps(state, indent=1))
    if name == "kube-apiserver":
        api = KubeApi(layout.admin_kubeconfig)
        try:
            _wait(
                name,
                lambda: api.get("/readyz") == "ok",
                timeout,
                pid,
                layout.logs / f"{name}.log",
            )
        finally:
            api.close()
