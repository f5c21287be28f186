"""Pure builders for the containers of an engine pod: the engine, the cache-manager sidecar and
the model-fetch init container, with the probes, mounts and security context they share.

``children.pods`` assembles them into pods; like it, nothing here does I/O.
"""

from __future__ import annotations

from typing import Any

from ketch.operator.pod_layout import (
    API_KEY_PATH,
    CONFIG_DIR,
    FETCH_CREDENTIAL_KEYS,
    MODEL_FETCH,
    MODEL_MOUNT,
    PEER_KEY_PATH,
    PEER_KEY_VOLUME,
)
from ketch.operator.port_names import (
    PORT_CM_HTTP,
    PORT_HTTP,
    PORT_KV_TRANSFER,
    PORT_METRICS,
    PORT_PD_COMM,
)
from ketch.operator.quantity import canonical, plus_gi
from ketch.operator.spec.model import ServiceSpec

# Seconds the preStop hook waits before SIGTERM, so endpoints stop sending new requests first.
PRESTOP_SLEEP = 5

Obj = dict[str, Any]


def peer_key_mounts(svc: ServiceSpec, role: str) -> list[Obj]:
    """The peer-key Secret, for the engine and the sidecar of a prefill or decode pod (both read
    ``peer_key_file`` from the role's config file)."""
    if role == "mixed" or "peerKeySecretRef" not in svc.spec.get("auth", {}):
        return []
    directory = PEER_KEY_PATH.rsplit("/", 1)[0]
    return [{"name": PEER_KEY_VOLUME, "mountPath": directory, "readOnly": True}]


def tmp_mount() -> Obj:
    """The pod's /tmp emptyDir: tempfile's directory (the engine's IPC sockets) and HOME."""
    return {"name": "tmp", "mountPath": "/tmp"}


def home_env() -> Obj:
    """HOME on /tmp: what libraries cache under ~ (~/.cache of paddle, Hugging Face) lands
    on the emptyDir, the root filesystem being read-only."""
    return {"name": "HOME", "value": "/tmp"}


def container_security() -> Obj:
    """Every container's: restricted Pod Security, and a read-only root filesystem. What the
    processes write goes to emptyDir volumes: /tmp, /dev/shm (KV cache segments,
    multiprocessing) and the model-fetch container's destination."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def http_probe(path: str, period: int, failures: int, port: str = PORT_HTTP) -> Obj:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def _port(name: str, number: int) -> Obj:
    return {"name": name, "containerPort": number, "protocol": "TCP"}


def needs_model_volume(svc: ServiceSpec) -> bool:
    return svc.spec["model"]["uri"].split("://", 1)[0] in ("pvc", "hf", "s3")


def engine_container(svc: ServiceSpec, role: str) -> Obj:
    """``ketch serve --config /etc/ketch/<role>.yaml``: the API, and in prefill/decode roles the
    pd-comm port the other role's pods connect to."""
    engine = svc.spec["engine"]
    ports = svc.ports
    res = svc.role(role)["resources"]
    container_ports = [_port(PORT_HTTP, ports["http"])]
    if ports.get("metrics") is not None:
        container_ports.append(_port(PORT_METRICS, ports["metrics"]))
    if role != "mixed":
        container_ports.append(_port(PORT_PD_COMM, ports["pdComm"]))
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    for key in ("cpu", "memory"):
        if res.get(key):
            limits[key] = requests[key] = canonical(res[key])
    if res["gpus"] > 0:
        limits[res["gpuResourceName"]] = requests[res["gpuResourceName"]] = str(res["gpus"])
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        tmp_mount(),
    ]
    if needs_model_volume(svc):
        mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
    if "apiKeySecretRef" in svc.spec.get("auth", {}):
        mounts.append(
            {"name": "api-key", "mountPath": API_KEY_PATH.rsplit("/", 1)[0], "readOnly": True}
        )
    mounts += peer_key_mounts(svc, role)
    env = [home_env(), *engine.get("env", [])]
    if role == "decode":  # where prefill peers push this pod's KV: its own IP, never a header
        pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
        env.append({"name": "KETCH_KV_TRANSFER_HOST", "valueFrom": pod_ip})
    return {
        "name": "engine",
        "image": engine["image"],
        "imagePullPolicy": engine["imagePullPolicy"],
        "command": ["ketch", "serve"],
        "args": ["--config", f"{CONFIG_DIR}/{role}.yaml", *engine.get("extraArgs", [])],
        "ports": container_ports,
        "env": env,
        "resources": {"limits": limits, "requests": requests} if limits else {},
        "volumeMounts": mounts,
        # Model loading can take minutes: the startup probe allows 20 before liveness applies.
        "startupProbe": http_probe("/health", 10, 120),
        "livenessProbe": http_probe("/health", 10, 3),
        "readinessProbe": http_probe("/ready", 5, 2),
        # The server drains on SIGTERM (/ready turns 503, in-flight requests finish); the sleep
        # first lets the endpoints controller take the pod out of its Services.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP}}},
        "securityContext": container_security(),
    }


def cache_manager_args(svc: ServiceSpec, role: str) -> list[str]:
    """The sidecar's ``ketch cache-manager`` arguments: it reads the role's config file (ports,
    role, timeouts) like the engine, and holds ``hostSwapSpace`` of host memory."""
    swap = svc.spec["cacheManager"]["hostSwapSpace"]
    return ["--config", f"{CONFIG_DIR}/{role}.yaml", "--swap-space", swap]


def cache_manager_container(svc: ServiceSpec, role: str) -> Obj:
    """The cache-manager sidecar: host swap space for evicted prefix-cache blocks and, in
    prefill/decode roles, KV transfer from prefill pods to decode pods.

    Ports: ``kv-transfer`` (prefill sidecars push KV blocks to decode sidecars; prefill/decode
    roles only: a mixed pod's sidecar reads ``role: mixed`` from its role file and opens no such
    port) and ``cm-http`` (``/health``, ``/metrics``). The engine reaches the sidecar through a
    Unix socket in the run directory under the shared ``/tmp`` (``ketch.engine.rundir``), not
    through a port.
    """
    cm = svc.spec["cacheManager"]
    ports = svc.ports
    memory = canonical(cm["memory"]) if cm.get("memory") else plus_gi(cm["hostSwapSpace"], 1)
    container_ports = [_port(PORT_CM_HTTP, ports["cacheManager"])]
    if role != "mixed":
        container_ports.insert(0, _port(PORT_KV_TRANSFER, ports["kvTransfer"]))
    return {
        "name": "cache-manager",
        "image": svc.spec["engine"]["image"],
        "imagePullPolicy": svc.spec["engine"]["imagePullPolicy"],
        "command": ["ketch", "cache-manager"],
        "args": cache_manager_args(svc, role),
        "ports": container_ports,
        "env": [home_env()],
        "resources": {
            "limits": {"cpu": canonical(cm["cpu"]), "memory": memory},
            "requests": {"cpu": canonical(cm["cpu"]), "memory": memory},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            tmp_mount(),
            *peer_key_mounts(svc, role),
        ],
        # Reserving the swap space takes a moment: up to 2 minutes before liveness applies.
        "startupProbe": http_probe("/health", 5, 24, PORT_CM_HTTP),
        "livenessProbe": http_probe("/health", 10, 3, PORT_CM_HTTP),
        "readinessProbe": http_probe("/health", 5, 2, PORT_CM_HTTP),
        "securityContext": container_security(),
    }


def model_volume(svc: ServiceSpec) -> Obj:
    uri = svc.spec["model"]["uri"]
    scheme, rest = uri.split("://", 1)
    if scheme == "pvc":
        claim = rest.split("/", 1)[0]
        return {"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return {"name": "models", "emptyDir": {}}


def model_fetch_container(svc: ServiceSpec) -> Obj:
    """hf:// and s3:// weights are fetched into the pod's model volume before the engine starts.

    Its environment is HOME and the fetch credentials of ``model.credentialsSecretRef``, never
    ``engine.env``: an endpoint variable there (HF_ENDPOINT, AWS_ENDPOINT_URL) would send the
    credentials wherever the spec says."""
    engine = svc.spec["engine"]
    return {
        "name": MODEL_FETCH,
        "image": engine["image"],
        "imagePullPolicy": engine["imagePullPolicy"],
        "command": ["ketch", "fetch-model"],
        "args": [svc.spec["model"]["uri"], MODEL_MOUNT],
        "env": [home_env(), *fetch_credentials_env(svc)],
        "volumeMounts": [{"name": "models", "mountPath": MODEL_MOUNT}, tmp_mount()],
        "securityContext": container_security(),
    }


def fetch_credentials_env(svc: ServiceSpec) -> list[Obj]:
    """The credential keys the model's URI scheme uses, each from the Secret if it has it."""
    ref = svc.spec["model"].get("credentialsSecretRef")
    if not ref:
        return []
    scheme = svc.spec["model"]["uri"].split("://", 1)[0]
    return [
        {
            "name": key,
            "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": key, "optional": True}},
        }
        for key in FETCH_CREDENTIAL_KEYS.get(scheme, ())
    ]
