"""Builders and render: valid Kubernetes objects, secure by default, deterministic."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ketch.engine.cli_args import read_config_file
from ketch.engine.config import EngineConfig
from ketch.engine.serving.config import ServerConfig
from ketch.operator import api_names, pod_layout
from ketch.operator.cli import main as operator_main
from ketch.operator.cli import render_object
from ketch.operator.labels import ANNOTATION_CONFIG_HASH
from ketch.operator.spec.parse import InvalidSpec, parse

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
UID = "5f1c2a8e-0000-4000-8000-000000000001"


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())


def children(body: dict) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in render_object(body, owner_uid=UID)}


def _validator() -> str:
    exe = shutil.which("kubernetes-validate") or str(
        Path(sys.executable).parent / "kubernetes-validate"
    )
    if not Path(exe).exists():
        pytest.skip("kubernetes-validate is not installed")
    return exe


def test_examples_exist():
    assert {p.stem for p in EXAMPLES} >= {"mixed", "disaggregated", "autoscaled"}


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_every_rendered_child_passes_kubernetes_validate_strict(version, tmp_path, capsys):
    assert operator_main(["render", *map(str, EXAMPLES)]) == 0
    rendered = capsys.readouterr().out
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    assert len(docs) >= 20
    path = tmp_path / "children.yaml"
    path.write_text(rendered)
    result = subprocess.run(
        [_validator(), "--strict", "-k", version, str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(docs)


def test_mixed_children_and_wiring():
    kids = children(example("mixed"))
    assert set(kids) == {
        ("ConfigMap", "tiny-config"),
        ("NetworkPolicy", "tiny"),
        ("Service", "tiny-mixed"),
        ("Service", "tiny-mixed-peers"),
        ("PodDisruptionBudget", "tiny-mixed"),
        ("Deployment", "tiny-mixed"),
    }
    for child in kids.values():
        meta = child["metadata"]
        assert meta["ownerReferences"] == [
            {
                "apiVersion": api_names.API_VERSION,
                "kind": api_names.KIND,
                "name": "tiny",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        for label in ("name", "instance", "managed-by", "part-of"):
            assert f"app.kubernetes.io/{label}" in meta["labels"]
    dep = kids[("Deployment", "tiny-mixed")]
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert kids[("Service", "tiny-mixed")]["spec"]["selector"] == selector
    engine = pod["spec"]["containers"][0]
    assert engine["command"] == ["ketch", "serve"]
    assert engine["args"] == ["--config", "/etc/ketch/mixed.yaml"]
    assert all(p.get("name") for c in pod["spec"]["containers"] for p in c["ports"])
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert engine["lifecycle"]["preStop"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > 30  # the engine's drain timeout
    # gpus: 0 -> no GPU resources; cpu/memory as asked
    assert engine["resources"]["limits"] == {"cpu": "2", "memory": "2Gi"}
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_engine_config_file_is_what_ketch_serve_reads(tmp_path):
    """The ConfigMap's role file parses with the engine's own reader into valid configs."""
    kids = children(example("mixed"))
    text = kids[("ConfigMap", "tiny-config")]["data"]["mixed.yaml"]
    path = tmp_path / "mixed.yaml"
    path.write_text(text)
    values = read_config_file(str(path), EngineConfig, ServerConfig)
    engine_names = {f for f in EngineConfig.__dataclass_fields__}
    engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_names})
    server = ServerConfig(**{k: v for k, v in values.items() if k not in engine_names})
    assert engine.model == "tiny" and engine.max_num_seqs == 32
    assert engine.kv_cache_memory == "256MiB"
    assert server.role == "mixed" and server.port == 8000


def test_disaggregated_children():
    kids = children(example("disaggregated"))
    names = {k for k in kids if k[0] == "Deployment"}
    assert names == {
        ("Deployment", "qwen-pd-prefill"),
        ("Deployment", "qwen-pd-decode"),
        ("Deployment", "qwen-pd-router"),
    }
    assert ("Service", "qwen-pd-router") in kids and ("Service", "qwen-pd-prefill-peers") in kids
    assert ("Deployment", "qwen-pd-mixed") not in kids
    config = kids[("ConfigMap", "qwen-pd-config")]["data"]
    assert set(config) == {"prefill.yaml", "decode.yaml", "router.yaml"}
    assert yaml.safe_load(config["prefill.yaml"])["role"] == "prefill"
    assert yaml.safe_load(config["router.yaml"])["policy"] == "prefix-hash"
    prefill = kids[("Deployment", "qwen-pd-prefill")]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in prefill["containers"]}
    assert set(containers) == {"engine", "cache-manager"}
    # the engine runs on CPUs today: no GPU resources, cpu/memory as the example asks
    assert containers["engine"]["resources"]["limits"] == {"cpu": "16", "memory": "48Gi"}
    mounts = {m["name"] for m in containers["cache-manager"]["volumeMounts"]}
    assert "dshm" in mounts  # the sidecar shares the engine's /dev/shm
    assert prefill["tolerations"][0]["key"] == "dedicated"
    # pvc:// mounts the claim read-only; the API key comes from the Secret as a file
    volumes = {v["name"]: v for v in prefill["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {
        "claimName": "model-store",
        "readOnly": True,
    }
    assert volumes["api-key"]["secret"]["secretName"] == "qwen-api-key"
    settings = yaml.safe_load(config["decode.yaml"])
    assert settings["model"] == "/models/Qwen2.5-7B-Instruct"
    assert settings["api_key_file"] == "/var/run/secrets/ketch/api-key"
    assert settings["tensor_parallel_size"] == 1


def test_disaggregated_pods_mount_the_peer_key_in_both_containers():
    kids = children(example("disaggregated"))
    config = kids[("ConfigMap", "qwen-pd-config")]["data"]
    for role in ("prefill", "decode"):
        pod = kids[("Deployment", f"qwen-pd-{role}")]["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["peer-key"]["secret"] == {
            "secretName": "qwen-peer-key",
            "items": [{"key": "peer-key", "path": "peer-key"}],
        }
        for container in pod["containers"]:  # the engine and its cache manager
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["peer-key"] == {
                "name": "peer-key",
                "mountPath": "/var/run/secrets/ketch-peer",
                "readOnly": True,
            }
        settings = yaml.safe_load(config[f"{role}.yaml"])
        assert settings["peer_key_file"] == "/var/run/secrets/ketch-peer/peer-key"
    router = kids[("Deployment", "qwen-pd-router")]["spec"]["template"]["spec"]
    assert "peer-key" not in {v["name"] for v in router.get("volumes", [])}
    mixed = children(example("mixed"))
    assert "peer_key_file" not in yaml.safe_load(
        mixed[("ConfigMap", "tiny-config")]["data"]["mixed.yaml"]
    )


def test_autoscaled_role_leaves_replicas_to_the_hpa():
    kids = children(example("autoscaled"))
    dep = kids[("Deployment", "llama-chat-mixed")]
    assert "replicas" not in dep["spec"]
    init = dep["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"] == ["ketch", "fetch-model"]
    assert init["args"] == ["hf://meta-llama/Llama-3.1-8B-Instruct", "/models"]


@pytest.mark.parametrize("name", ["mixed", "disaggregated", "autoscaled"])
def test_pods_meet_restricted_pod_security_standard(name):
    for child in children(example(name)).values():
        if child["kind"] != "Deployment":
            continue
        pod = child["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"] + pod.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
        assert not any("hostPath" in v for v in pod["volumes"])


def _every_container(body: dict):
    for child in children(body).values():
        if child["kind"] == "Deployment":
            pod = child["spec"]["template"]["spec"]
            for container in pod.get("initContainers", []) + pod["containers"]:
                yield container, {v["name"]: v for v in pod["volumes"]}


@pytest.mark.parametrize("name", ["mixed", "disaggregated", "autoscaled", "coordinated"])
def test_every_container_has_a_read_only_root_and_writable_emptydirs(name):
    """Engine, sidecar, router and model fetch: the root filesystem is read-only; /tmp (IPC
    sockets, tempfile) and HOME (library caches under ~) are an emptyDir, and so are the other
    paths a process writes (/dev/shm, the fetch destination)."""
    seen = set()
    for container, volumes in _every_container(example(name)):
        seen.add(container["name"])
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
        assert {"name": "HOME", "value": "/tmp"} in container["env"]
        writable = {path for path, m in mounts.items() if not m.get("readOnly")}
        for path in writable:
            assert "emptyDir" in volumes[mounts[path]["name"]], (container["name"], path)
        expected = {"engine": {"/tmp", "/dev/shm"}, "cache-manager": {"/tmp", "/dev/shm"}}
        expected |= {"router": {"/tmp"}, "model-fetch": {"/tmp", "/models"}}
        assert writable == expected[container["name"]]
    assert seen >= {"engine", "cache-manager"}
    assert {"disaggregated": "router", "autoscaled": "model-fetch"}.get(name, "engine") in seen


def _fetch_container(uri: str, **model: object) -> dict:
    body = example("mixed")
    body["spec"]["model"] = {"uri": uri, **model}
    body["spec"]["engine"]["env"] = [
        {"name": "HF_ENDPOINT", "value": "https://elsewhere.example"},
        {"name": "AWS_ENDPOINT_URL", "value": "https://elsewhere.example"},
        {"name": "DB", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}},
    ]
    kids = children(body)
    pod = kids[("Deployment", "tiny-mixed")]["spec"]["template"]["spec"]
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    assert {e["name"] for e in engine["env"]} == {"HOME", "HF_ENDPOINT", "AWS_ENDPOINT_URL", "DB"}
    [fetch] = pod["initContainers"]
    return fetch


def test_fetch_container_gets_no_engine_env():
    """engine.env is the engine's: an endpoint there must not redirect the fetch credentials,
    nor a Secret named there reach the fetcher."""
    fetch = _fetch_container("hf://org/model")
    assert fetch["env"] == [{"name": "HOME", "value": "/tmp"}]


@pytest.mark.parametrize(
    ("uri", "keys"),
    [
        ("hf://org/model", ["HF_TOKEN", "HF_ENDPOINT"]),
        ("s3://bucket/prefix", list(pod_layout.FETCH_CREDENTIAL_KEYS["s3"])),
    ],
)
def test_fetch_container_gets_its_credentials_from_the_named_secret_only(uri, keys):
    fetch = _fetch_container(uri, credentialsSecretRef={"name": "model-creds"})
    assert fetch["env"][0] == {"name": "HOME", "value": "/tmp"}
    assert [e["name"] for e in fetch["env"][1:]] == keys
    for var in fetch["env"][1:]:
        assert var["valueFrom"] == {
            "secretKeyRef": {"name": "model-creds", "key": var["name"], "optional": True}
        }


def test_network_policy_keeps_internal_ports_internal():
    kids = children(example("autoscaled"))
    policy = kids[("NetworkPolicy", "llama-chat")]["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    (public,) = policy["ingress"]  # mixed: no pod-to-pod port at all
    assert "from" not in public  # anyone reaches the API, metrics and sidecar HTTP ports
    assert {p["port"] for p in public["ports"]} == {8000, 9090, 8006}


def test_network_policy_opens_pd_comm_and_kv_transfer_to_own_pods_only():
    kids = children(example("disaggregated"))
    own, public = kids[("NetworkPolicy", "qwen-pd")]["spec"]["ingress"]
    assert own["from"] == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/instance": "qwen-pd",
                    "app.kubernetes.io/managed-by": "ketch-operator",
                }
            }
        }
    ]
    # decode -> prefill pd-comm, prefill sidecar -> decode sidecar kv-transfer; the engine-worker
    # and cache queues are Unix sockets inside the pod and get no rule
    assert {p["port"] for p in own["ports"]} == {8004, 8005}
    assert "from" not in public and {p["port"] for p in public["ports"]} == {8000, 8006}


def _pod(body: dict, deployment: str) -> dict:
    return children(body)[("Deployment", deployment)]["spec"]["template"]["spec"]


def test_cache_manager_sidecar_shape():
    pod = _pod(example("disaggregated"), "qwen-pd-decode")
    sidecar = next(c for c in pod["containers"] if c["name"] == "cache-manager")
    assert sidecar["command"] == ["ketch", "cache-manager"]
    assert sidecar["args"] == ["--config", "/etc/ketch/decode.yaml", "--swap-space", "16Gi"]
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]} == {
        "kv-transfer": 8005,
        "cm-http": 8006,
    }
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert sidecar[probe]["httpGet"] == {"path": "/health", "port": "cm-http"}
    assert sidecar["resources"]["limits"]["memory"] == "17Gi"  # hostSwapSpace + 1Gi
    names = [p["name"] for c in pod["containers"] for p in c["ports"]]
    assert len(names) == len(set(names)) and all(len(n) <= 15 for n in names)
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    assert {p["name"] for p in engine["ports"]} >= {"http", "pd-comm"}


def test_cache_manager_is_on_by_default_and_can_be_turned_off_when_mixed():
    pod = _pod(example("mixed"), "tiny-mixed")
    sidecar = next(c for c in pod["containers"] if c["name"] == "cache-manager")
    assert sidecar["args"][-2:] == ["--swap-space", "4Gi"]
    assert sidecar["resources"]["requests"]["memory"] == "5Gi"
    off = example("mixed")
    off["spec"]["cacheManager"] = {"enabled": False}
    assert [c["name"] for c in _pod(off, "tiny-mixed")["containers"]] == ["engine"]
    small = example("mixed")
    small["spec"]["cacheManager"] = {"hostSwapSpace": "512Mi"}
    memory = _pod(small, "tiny-mixed")["containers"][1]["resources"]["limits"]["memory"]
    assert memory == "1536Mi"


def test_peers_services_name_pd_comm_and_kv_transfer():
    kids = children(example("disaggregated"))
    for role in ("prefill", "decode"):
        peers = kids[("Service", f"qwen-pd-{role}-peers")]["spec"]
        assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True
        assert {p["name"]: p["port"] for p in peers["ports"]} == {
            "http": 8000,
            "pd-comm": 8004,
            "kv-transfer": 8005,
        }
        assert all(p["targetPort"] == p["name"] for p in peers["ports"])
    mixed = children(example("mixed"))[("Service", "tiny-mixed-peers")]["spec"]
    assert [p["name"] for p in mixed["ports"]] == ["http"]


def test_role_config_carries_the_sidecar_ports_and_timeouts():
    config = children(example("disaggregated"))[("ConfigMap", "qwen-pd-config")]["data"]
    settings = yaml.safe_load(config["prefill.yaml"])
    assert settings["role"] == "prefill"
    assert settings["cache_queue_port"] == 8003 and settings["kv_transfer_port"] == 8005
    assert settings["cache_manager_port"] == 8006 and settings["pd_comm_port"] == 8004
    assert settings["pd_block_timeout"] == 30.0 and settings["pd_peer_timeout"] == 10.0


def _cache_manager_parser():
    import argparse

    from ketch.engine.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get("cache-manager")
    return None


def test_sidecar_args_parse_with_ketch_cache_manager(tmp_path):
    """The rendered args and role file are what the real `ketch cache-manager` accepts, and give
    it the ports the sidecar container declares."""
    parser = _cache_manager_parser()
    if parser is None or "--swap-space" not in parser.format_help():
        pytest.skip("`ketch cache-manager`'s parser is still a placeholder (no --swap-space)")
    from ketch.engine.cache_manager.config import CacheManagerConfig
    from ketch.engine.cli_args import config_from_args

    body = example("disaggregated")
    body["spec"]["ports"] = {"kvTransfer": 9105, "cacheManager": 9106}
    kids = children(body)
    sidecar = next(
        c
        for c in kids[("Deployment", "qwen-pd-prefill")]["spec"]["template"]["spec"]["containers"]
        if c["name"] == "cache-manager"
    )
    role_file = tmp_path / "prefill.yaml"
    role_file.write_text(kids[("ConfigMap", "qwen-pd-config")]["data"]["prefill.yaml"])
    args = parser.parse_args(
        [role_file.as_posix() if a.endswith(".yaml") else a for a in sidecar["args"]]
    )
    values = read_config_file(args.config, EngineConfig, ServerConfig, CacheManagerConfig)
    config = config_from_args(CacheManagerConfig, args, values)
    declared = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert config.cache_queue_port == 8003 and "cache-queue" not in declared  # a Unix socket
    assert config.kv_transfer_port == declared["kv-transfer"] == 9105
    assert config.cache_manager_port == declared["cm-http"] == 9106
    assert config.swap_bytes == 16 * 1024**3


def test_config_change_changes_the_pod_template_hash_and_nothing_else_does():
    body = example("mixed")
    before = children(body)[("Deployment", "tiny-mixed")]
    changed = copy.deepcopy(body)
    changed["spec"]["engine"]["maxNumSeqs"] = 16
    after = children(changed)[("Deployment", "tiny-mixed")]
    key = ANNOTATION_CONFIG_HASH
    assert (
        before["spec"]["template"]["metadata"]["annotations"][key]
        != after["spec"]["template"]["metadata"]["annotations"][key]
    )
    scaled = copy.deepcopy(body)
    scaled["spec"]["roles"]["mixed"]["replicas"] = 5
    rescaled = children(scaled)[("Deployment", "tiny-mixed")]
    assert rescaled["spec"]["template"] == before["spec"]["template"]  # scaling rolls nothing


def test_render_is_deterministic(capsys):
    assert operator_main(["render", *map(str, EXAMPLES)]) == 0
    first = capsys.readouterr().out
    assert operator_main(["render", *map(str, EXAMPLES)]) == 0
    assert capsys.readouterr().out == first


def test_render_uses_uid_and_namespace_from_the_file_or_flags(capsys, tmp_path):
    body = example("mixed")
    body["metadata"].update(namespace="prod", uid=UID)
    path = tmp_path / "live.yaml"
    path.write_text(yaml.safe_dump(body))
    assert operator_main(["render", str(path)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {d["metadata"]["namespace"] for d in docs if d} == {"prod"}
    assert {d["metadata"]["ownerReferences"][0]["uid"] for d in docs if d} == {UID}
    assert operator_main(["render", "-n", "x", "--owner-uid", "u-1", str(EXAMPLES[0])]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert {d["metadata"]["namespace"] for d in docs} == {"x"}


def test_render_reports_invalid_files(capsys, tmp_path):
    bad = example("mixed")
    bad["spec"]["engine"]["blockSize"] = 48
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert operator_main(["render", str(path)]) == 1
    err = capsys.readouterr().err
    assert "spec.engine.blockSize" in err and "48" in err
    assert operator_main(["render", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert operator_main(["render", str(tmp_path / "cm.yaml")]) == 1
    assert "not an InferenceService" in capsys.readouterr().err


# Invalid specs, each with the field the message must name. The same list is applied through
# the API-server emulator and kubectl in test_e2e (schema + CEL there; the operator's own
# validation here).
INVALID: list[tuple[str, dict, str]] = [
    ("no model uri", {"model": {}}, "uri"),
    ("bad uri scheme", {"model": {"uri": "ftp://x/y"}}, "spec.model.uri"),
    ("block size", {"engine": {"blockSize": 48}}, "spec.engine.blockSize"),
    ("negative replicas", {"roles": {"mixed": {"replicas": -1}}}, "spec.roles.mixed.replicas"),
    ("mixed and prefill", {"roles": {"mixed": {}, "prefill": {}, "decode": {}}}, "spec.roles"),
    ("prefill alone", {"roles": {"prefill": {}}}, "spec.roles"),
    ("no roles", {"roles": {}}, "spec.roles"),
    (
        "min > max",
        {"roles": {"mixed": {"autoscaling": {"minReplicas": 4, "maxReplicas": 2}}}},
        "spec.roles.mixed.autoscaling.minReplicas",
    ),
    ("ports clash", {"ports": {"http": 8002}}, "spec.ports"),
    (
        "tp > gpus",
        {"engine": {"tensorParallelSize": 4}, "roles": {"mixed": {"resources": {"gpus": 2}}}},
        "spec.engine.tensorParallelSize",
    ),
    # a GPU pod holds one GPU per rank: no fewer ranks than GPUs either
    (
        "tp < gpus",
        {"engine": {"tensorParallelSize": 1}, "roles": {"mixed": {"resources": {"gpus": 2}}}},
        "spec.engine.tensorParallelSize",
    ),
    ("dtype", {"engine": {"dtype": "int3"}}, "spec.engine.dtype"),
    ("kv memory", {"engine": {"kvCacheMemory": "lots"}}, "spec.engine.kvCacheMemory"),
    ("extra args own flag", {"engine": {"extraArgs": ["--port=1"]}}, "spec.engine.extraArgs"),
    (
        "extra args abbreviation",
        {"engine": {"extraArgs": ["--pd-prefill-pe", "x"]}},
        "spec.engine.extraArgs",
    ),
    (
        "extra args negation",
        {"engine": {"extraArgs": ["--no-enable-prefix-caching"]}},
        "spec.engine.extraArgs",
    ),
    ("port range", {"ports": {"http": 70000}}, "spec.ports.http"),
    ("router policy", {"router": {"policy": "random"}}, "spec.router.policy"),
    (
        "min replicas 0",
        {"roles": {"mixed": {"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}}},
        "spec.roles.mixed.autoscaling.minReplicas",
    ),
    ("gpus", {"roles": {"mixed": {"resources": {"gpus": 99}}}}, "spec.roles.mixed.resources.gpus"),
    ("max num seqs", {"engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs"),
    ("type", {"engine": {"maxNumSeqs": "many"}}, "spec.engine.maxNumSeqs"),
    ("swap", {"cacheManager": {"hostSwapSpace": "much"}}, "spec.cacheManager.hostSwapSpace"),
    # a plain number is bytes to Kubernetes but GiB to `ketch cache-manager --swap-space`
    ("swap unit", {"cacheManager": {"hostSwapSpace": "8"}}, "spec.cacheManager.hostSwapSpace"),
    (
        "disaggregated without cache manager",
        {
            "roles": {"mixed": None, "prefill": {}, "decode": {}},
            "cacheManager": {"enabled": False},
        },
        "spec.cacheManager.enabled",
    ),
    (
        "disaggregated without a peer key",
        {"roles": {"mixed": None, "prefill": {}, "decode": {}}},
        "auth.peerKeySecretRef",
    ),
    (
        "speculative method",
        {"engine": {"speculativeConfig": {"method": "eagle", "numSpeculativeTokens": 2}}},
        "spec.engine.speculativeConfig.method",
    ),
    (
        "speculative k 0",
        {"engine": {"speculativeConfig": {"method": "ngram", "numSpeculativeTokens": 0}}},
        "spec.engine.speculativeConfig.numSpeculativeTokens",
    ),
    (
        "speculative k 17",
        {"engine": {"speculativeConfig": {"method": "ngram", "numSpeculativeTokens": 17}}},
        "spec.engine.speculativeConfig.numSpeculativeTokens",
    ),
    (
        "speculative unknown key",
        {"engine": {"speculativeConfig": {"method": "ngram", "numSpeculativeTokens": 2, "k": 3}}},
        "spec.engine.speculativeConfig",
    ),
    (
        "speculative model without draft",
        {
            "engine": {
                "speculativeConfig": {"method": "mtp", "numSpeculativeTokens": 1, "model": "/d"}
            }
        },
        "spec.engine.speculativeConfig.model",
    ),
]


def invalid_body(patch: dict) -> dict:
    body = example("mixed")

    def merge(dst: dict, src: dict) -> None:
        for k, v in src.items():
            if v is None:  # None deletes
                dst.pop(k, None)
            elif isinstance(v, dict) and v and isinstance(dst.get(k), dict):
                merge(dst[k], v)
            else:
                dst[k] = copy.deepcopy(v)

    merge(body["spec"], patch)
    return body


@pytest.mark.parametrize(("case", "patch", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_operator_rejects_invalid_specs_naming_the_field(case, patch, field):
    with pytest.raises(InvalidSpec) as info:
        parse(invalid_body(patch))
    assert field in str(info.value), info.value.problems


def test_name_too_long_for_children():
    body = example("mixed")
    body["metadata"]["name"] = "n" * (api_names.MAX_NAME_LENGTH + 1)
    with pytest.raises(InvalidSpec, match=r"metadata\.name"):
        parse(body)


def test_decode_pods_learn_their_kv_address_from_the_downward_api() -> None:
    from ketch.operator.cli import load_documents, render_object

    (isvc,) = load_documents(str(Path(__file__).parents[2] / "examples" / "disaggregated.yaml"))
    kids = render_object(isvc)
    for deployment in (k for k in kids if k["kind"] == "Deployment"):
        role = deployment["metadata"]["labels"].get("serving.ketch.dev/role")
        (engine,) = [
            c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"
        ] or [None]
        if engine is None:
            continue
        env = {e["name"]: e for e in engine.get("env", [])}
        if role == "decode":
            ref = env["KETCH_KV_TRANSFER_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert ref == "status.podIP"
        else:
            assert "KETCH_KV_TRANSFER_HOST" not in env


def test_mixed_pods_open_no_kv_transfer_port():
    """Review L4: a mixed pod's sidecar moves no KV between pods, so it declares no kv-transfer
    port (and reads ``role: mixed`` from its role file, so it binds none); prefill and decode
    sidecars keep theirs."""
    pod = _pod(example("mixed"), "tiny-mixed")
    sidecar = next(c for c in pod["containers"] if c["name"] == "cache-manager")
    assert [p["name"] for p in sidecar["ports"]] == ["cm-http"]
    config = children(example("mixed"))[("ConfigMap", "tiny-config")]["data"]["mixed.yaml"]
    assert yaml.safe_load(config)["role"] == "mixed"
    for role in ("prefill", "decode"):
        pod = _pod(example("disaggregated"), f"qwen-pd-{role}")
        sidecar = next(c for c in pod["containers"] if c["name"] == "cache-manager")
        assert {p["name"] for p in sidecar["ports"]} == {"kv-transfer", "cm-http"}


def test_a_disaggregated_spec_needs_a_peer_key_even_without_cel():
    """Review M11: the operator parses live objects with cel=False (the API server ran the CEL
    rules) — but an older CRD, or an API server without CEL, may not have. The peer-key rule is
    checked in Python too: no prefill/decode pod is ever rendered without a peer key."""
    body = invalid_body({"roles": {"mixed": None, "prefill": {}, "decode": {}}})
    for cel in (True, False):
        with pytest.raises(InvalidSpec) as info:
            parse(body, cel=cel)
        problems = [p for p in info.value.problems if "peerKeySecretRef" in p]
        assert problems == [
            "spec.auth: roles.prefill/decode (disaggregated serving) need auth.peerKeySecretRef: "
            "a Secret with the key their pd-comm and kv-transfer ports authenticate peers with"
        ], info.value.problems
    keyed = copy.deepcopy(body)
    keyed["spec"]["auth"] = {"peerKeySecretRef": {"name": "peer", "key": "key"}}
    assert parse(keyed, cel=False).disaggregated
