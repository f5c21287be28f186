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
import sys
import time
from pathlib import Path
from typing import Any

from localcluster import pki
from localcluster.kubeapi import ApiError, KubeApi, write_kubeconfig
from localcluster.layout import CLUSTER_DOMAIN, Layout

log = logging.getLogger("localcluster")

HACK = Path(__file__).resolve().parents[1]
NODE_TAINT = "ketch.dev/local-node=true:NoSchedule"
STATE = "state.json"
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
                {"apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch"]},
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
    state: dict[str, Any] = {"tag": layout.tag, "index": layout.index, "processes": {}, "argv": {}}

    def record(name: str, pid: int) -> None:
        state["processes"][name] = pid
        (d / STATE).write_text(json.dumps(state, indent=1))

    def run(name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        state["argv"][name] = argv
        record(name, _spawn(layout, name, argv, env))

    try:
        ensure_bridge(layout)
        host = str(layout.gateway)
        api_ip = str(layout.service_cidr.network_address + 1)
        names = (
            "127.0.0.1",
            host,
            api_ip,
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            f"kubernetes.default.svc.{CLUSTER_DOMAIN}",
        )
        pki.make_all(layout.pki, node_name=layout.node_name, server_names=names, node_ip=host)
        api_port = free_port(host)
        server = f"https://{host}:{api_port}"
        state["server"] = server
        _write_files(layout, server)
        p = layout.pki

        # ---- etcd
        etcd_client, etcd_peer = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_client}"
        run(
            "etcd",
            [
                str(bins["etcd"]),
                "--name",
                "ketch",
                "--data-dir",
                str(d / "etcd"),
                "--listen-client-urls",
                etcd_url,
                "--advertise-client-urls",
                etcd_url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
                "--initial-cluster",
                f"ketch=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync=true",
                "--quota-backend-bytes=4294967296",
                "--listen-metrics-urls",
                f"http://127.0.0.1:{free_port()}",
                "--log-level",
                "warn",
            ],
        )
        state["etcd"] = etcd_url

        def etcd_ok() -> bool:
            import urllib.request

            with urllib.request.urlopen(f"{etcd_url}/health", timeout=2) as r:
                return json.loads(r.read()).get("health") == "true"

        _wait("etcd", etcd_ok, timeout, state["processes"]["etcd"], layout.logs / "etcd.log")

        # ---- kube-apiserver
        run(
            "kube-apiserver",
            [
                str(bins["kube-apiserver"]),
                "--etcd-servers",
                etcd_url,
                "--bind-address",
                host,
                "--advertise-address",
                host,
                "--secure-port",
                str(api_port),
                "--tls-cert-file",
                str(p / "apiserver.crt"),
                "--tls-private-key-file",
                str(p / "apiserver.key"),
                "--client-ca-file",
                str(p / "ca.crt"),
                "--authorization-mode",
                "Node,RBAC",
                "--enable-admission-plugins",
                "NodeRestriction,PodTolerationRestriction",
                "--admission-control-config-file",
                str(d / "admission.yaml"),
                "--service-cluster-ip-range",
                str(layout.service_cidr),
                "--service-account-issuer",
                f"https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
                "--service-account-key-file",
                str(p / "sa.pub"),
                "--service-account-signing-key-file",
                str(p / "sa.key"),
                "--api-audiences",
                f"https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
                "--allow-privileged=true",
                "--requestheader-client-ca-file",
                str(p / "front-proxy-ca.crt"),
                "--requestheader-allowed-names",
                "front-proxy-client",
                "--requestheader-username-headers",
                "X-Remote-User",
                "--requestheader-group-headers",
                "X-Remote-Group",
                "--requestheader-extra-headers-prefix",
                "X-Remote-Extra-",
                "--proxy-client-cert-file",
                str(p / "front-proxy-client.crt"),
                "--proxy-client-key-file",
                str(p / "front-proxy-client.key"),
                "--enable-aggregator-routing=true",
                # kubectl logs: the node agent's endpoint on the node's InternalIP
                "--kubelet-client-certificate",
                str(p / "apiserver-kubelet-client.crt"),
                "--kubelet-client-key",
                str(p / "apiserver-kubelet-client.key"),
                "--kubelet-certificate-authority",
                str(p / "ca.crt"),
                "--kubelet-preferred-address-types",
                "InternalIP",
                "--audit-policy-file",
                str(d / "audit-policy.yaml"),
                "--audit-log-path",
                str(layout.logs / "audit.log"),
                "--audit-log-format",
                "json",
                "--audit-log-mode",
                "blocking",
                "--profiling=false",
                "--v",
                "1",
            ],
        )
        api = KubeApi(layout.admin_kubeconfig)
        try:
            _wait(
                "kube-apiserver",
                lambda: api.get("/readyz") == "ok",
                timeout,
                state["processes"]["kube-apiserver"],
                layout.logs / "kube-apiserver.log",
            )
            for path, obj in BOOTSTRAP_RBAC:
                api.apply(path, obj)
        finally:
            api.close()

        # ---- kube-controller-manager, kube-scheduler
        kcm_port, sched_port = free_port(), free_port()
        kcm_cfg = str(layout.kubeconfig("controller-manager"))
        run(
            "kube-controller-manager",
            [
                str(bins["kube-controller-manager"]),
                "--kubeconfig",
                kcm_cfg,
                "--authentication-kubeconfig",
                kcm_cfg,
                "--authorization-kubeconfig",
                kcm_cfg,
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                str(kcm_port),
                "--leader-elect=false",
                "--controllers",
                "*",
                "--use-service-account-credentials=true",
                "--service-account-private-key-file",
                str(p / "sa.key"),
                "--root-ca-file",
                str(p / "ca.crt"),
                "--cluster-signing-cert-file",
                str(p / "ca.crt"),
                "--cluster-signing-key-file",
                str(p / "ca.key"),
                "--horizontal-pod-autoscaler-sync-period",
                hpa_sync_period,
                "--v",
                "1",
            ],
        )
        sched_cfg = str(layout.kubeconfig("scheduler"))
        run(
            "kube-scheduler",
            [
                str(bins["kube-scheduler"]),
                "--kubeconfig",
                sched_cfg,
                "--authentication-kubeconfig",
                sched_cfg,
                "--authorization-kubeconfig",
                sched_cfg,
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                str(sched_port),
                "--leader-elect=false",
                "--v",
                "1",
            ],
        )
        for name, port in (("kube-controller-manager", kcm_port), ("kube-scheduler", sched_port)):
            _wait(
                name,
                lambda port=port: _healthz(port),
                timeout,
                state["processes"][name],
                layout.logs / f"{name}.log",
            )

        # ---- our own: service proxy + DNS, node agent
        py_env = os.environ.copy()
        py_env["PYTHONPATH"] = os.pathsep.join(
            [str(HACK), *filter(None, [py_env.get("PYTHONPATH")])]
        )
        common = ["--dir", str(d), "--tag", layout.tag, "--index", str(layout.index)]
        if service_proxy:
            api = KubeApi(layout.admin_kubeconfig)
            try:  # cluster DNS's address, reserved as a real cluster's kube-dns Service is
                api.apply(
                    "/api/v1/namespaces/kube-system/services/kube-dns",
                    {
                        "apiVersion": "v1",
                        "kind": "Service",
                        "metadata": {
                            "name": "kube-dns",
                            "namespace": "kube-system",
                            "labels": {"k8s-app": "kube-dns"},
                        },
                        "spec": {
                            "clusterIP": str(layout.dns_ip),
                            "ports": [
                                {"name": "dns", "port": 53, "protocol": "UDP"},
                                {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                            ],
                        },
                    },
                )
            finally:
                api.close()
            run(
                "service-proxy",
                [
                    sys.executable,
                    "-m",
                    "localcluster.proxy",
                    "--kubeconfig",
                    str(layout.kubeconfig("service-proxy")),
                    *common,
                ],
                py_env,
            )
            from localcluster.proxy.dns import probe

            _wait(
                "service proxy (cluster DNS answers)",
                lambda: probe(str(layout.dns_ip)),
                timeout,
                state["processes"]["service-proxy"],
                layout.logs / "service-proxy.log",
            )
        if node_agent:
            run(
                "node-agent",
                [
                    sys.executable,
                    "-m",
                    "localcluster.nodeagent",
                    "--kubeconfig",
                    str(layout.kubeconfig("node")),
                    *common,
                    "--taint",
                    NODE_TAINT,
                    # Examples ask for 2 CPUs and several GiB (KV cache, swap space) a pod:
                    # the node offers more than the machine has, and the pods' processes share
                    # its cores and memory (a tiny-model engine pod uses ~1 GB).
                    "--capacity",
                    "cpu=16",
                    "--capacity",
                    "memory=96Gi",
                    "--images",
                    str(_image_table(layout)),
                    *agent_args,
                ],
                py_env,
            )
            api = KubeApi(layout.admin_kubeconfig)
            try:
                _wait(
                    "node agent (Node Ready)",
                    lambda: _node_ready(api, layout.node_name),
                    timeout,
                    state["processes"]["node-agent"],
                    layout.logs / "node-agent.log",
                )
            finally:
                api.close()
        if watch_pid:
            run(
                "watchdog",
                [
                    sys.executable,
                    "-m",
                    "localcluster",
                    "watchdog",
                    "--dir",
                    str(d),
                    "--pid",
                    str(watch_pid),
                ],
                py_env,
            )
        api = KubeApi(layout.admin_kubeconfig)
        try:  # pods can be made in `default` once its ServiceAccount exists
            _wait(
                "the default ServiceAccount",
                lambda: api.get("/api/v1/namespaces/default/serviceaccounts/default"),
                timeout,
                None,
                layout.logs / "kube-controller-manager.log",
            )
            state["version"] = api.get("/version")["gitVersion"]
        finally:
            api.close()
        (d / STATE).write_text(json.dumps(state, indent=1))
        return state
    except BaseException:
        stop(d, remove=False)
        raise


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
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(HACK), *filter(None, [env.get("PYTHONPATH")])])
    pid = _spawn(layout, name, state["argv"][name], env)
    state["processes"][name] = pid
    (directory / STATE).write_text(json.dumps(state, indent=1))
    if name == "kube-apiserver":
        api = KubeApi(layout.admin_kubeconfig)
        try:
            _wait(
                name, lambda: api.get("/readyz") == "ok", timeout, pid, layout.logs / f"{name}.log"
            )
        finally:
            api.close()
