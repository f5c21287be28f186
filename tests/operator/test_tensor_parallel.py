"""Tensor parallelism in an InferenceService (issue 17).

The CRD's CEL rules (a GPU role holds one GPU per rank; a CPU role's ranks are worker processes),
what a CPU role's engine container is given (the size in its role file, the threads of each rank
from ``resources.cpu``), and what ``check-wiring`` says about a size the engine cannot run. The
CEL rules are evaluated twice: by the operator's own interpreter (``spec.admission``) and by the
session's real kube-apiserver (tests/kubecluster.py), with server-side dry-run creates of the
objects.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

import procs
from ketch.engine.capabilities import refusals
from ketch.engine.config import EngineConfig
from ketch.operator import api_names, runnable
from ketch.operator.cli import main as operator_main
from ketch.operator.cli import render_object
from ketch.operator.spec import admission
from ketch.operator.spec.defaults import apply_defaults
from ketch.operator.spec.parse import InvalidSpec, parse
from ketch.operator.wiring import check_wiring
from ketch.operator.wiring.pods import read_pods
from kubecluster import kubectl, wait_established

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / f"{api_names.CRD_NAME}.yaml"
PEER_KEY = {"peerKeySecretRef": {"name": "peer-key"}}
RULE = (
    "engine.tensorParallelSize must equal roles.{role}.resources.gpus when that is above 0 (one "
    "GPU per tensor-parallel rank); with gpus 0 the ranks are worker processes on the CPU"
)
TINY = runnable.known_model("tiny")
# The tiny model (4 attention heads, 2 KV heads, intermediate 384) shards 2 ways: once the
# engine runs tensor parallelism on the CPU, it refuses nothing here.
ENGINE_RUNS_TP_2 = not refusals(EngineConfig(tensor_parallel_size=2), model=TINY)
landed = pytest.mark.skipif(
    not ENGINE_RUNS_TP_2, reason="the engine side of issue 17 (tp > 1 on the CPU) has not landed"
)


def body(spec_: dict) -> dict:
    return {
        "apiVersion": api_names.API_VERSION,
        "kind": api_names.KIND,
        "metadata": {"name": "svc", "namespace": "default"},
        "spec": copy.deepcopy(spec_),
    }


def mixed(engine: dict, resources: dict) -> dict:
    return body(
        {"model": {"uri": "tiny"}, "engine": engine, "roles": {"mixed": {"resources": resources}}}
    )


def disaggregated(tp: int, prefill: dict, decode: dict) -> dict:
    roles = {"prefill": {"resources": prefill}, "decode": {"resources": decode}}
    spec_ = {"model": {"uri": "tiny"}, "engine": {"tensorParallelSize": tp}, "roles": roles}
    return body({**spec_, "auth": PEER_KEY})


@pytest.fixture
def engine_runs_tp(monkeypatch):
    """An engine build that runs any tensor-parallel size and GPU workers (issue 17; GPU workers
    are not this build's): only the rendering is under test. Its other refusals stay."""

    def without(config, **kwargs):
        found = refusals(config, **kwargs)
        return [r for r in found if r.setting not in ("tensor_parallel_size", "gpus")]

    monkeypatch.setattr(runnable, "refusals", without)


# --------------------------------------------------------------------------- CEL rules

ACCEPTED = [
    ("cpu role tp 2", mixed({"tensorParallelSize": 2}, {})),
    ("cpu role tp 4 with cpus", mixed({"tensorParallelSize": 4}, {"cpu": "8"})),
    ("gpu role gpus 2 tp 2", mixed({"tensorParallelSize": 2}, {"gpus": 2})),
    ("disaggregated gpus 2 and cpu", disaggregated(2, {"gpus": 2}, {"gpus": 0})),
]
REFUSED = [
    ("gpus 2 tp 1", mixed({"tensorParallelSize": 1}, {"gpus": 2}), "mixed"),
    ("gpus 1 tp 2", mixed({"tensorParallelSize": 2}, {"gpus": 1}), "mixed"),
    ("gpus 2 tp default", mixed({}, {"gpus": 2}), "mixed"),
    ("decode gpus 4 tp 2", disaggregated(2, {"gpus": 2}, {"gpus": 4}), "decode"),
]


def operator_cel(obj: dict) -> list[str]:
    schema = admission.openapi_schema()["properties"]["spec"]
    return admission.cel_problems(schema, apply_defaults(schema, obj["spec"]), "spec")


@pytest.fixture(scope="module")
def apiserver(kube) -> Callable[[dict], dict[str, Any]]:
    """The committed CRD, installed on the API server; returns a function that creates an object
    with ``dryRun=All`` (defaulted, validated and admitted as a create, never stored) and returns
    the server's answer: the object as it would be stored, or the Status of the refusal."""
    args = ("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    result = kubectl(kube, *args)
    assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    wait_established(kube, f"crd/{api_names.CRD_NAME}")
    collection = f"/apis/{api_names.API_VERSION}/namespaces/default/{api_names.PLURAL}"
    procs.wait_for(  # a new CRD's storage answers 429 "storage is (re)initializing" at first
        lambda: kube.get(collection).status != 429, 30, "the CRD's storage", interval=0.2
    )

    def create(obj: dict) -> dict[str, Any]:
        ns = obj["metadata"]["namespace"]
        path = f"/apis/{api_names.API_VERSION}/namespaces/{ns}/{api_names.PLURAL}"
        answer = kube.post(path, obj, params={"dryRun": "All"})
        assert answer.status in (200, 201, 422), answer.body
        return answer.body

    return create


@pytest.mark.parametrize(("case", "obj"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_cel_accepts(case, obj, apiserver):
    assert operator_cel(obj) == []
    created = apiserver(obj)
    assert created["kind"] == api_names.KIND, created
    # both ran the rules on the same object: the operator defaults the spec as the server does
    schema = admission.openapi_schema()["properties"]["spec"]
    assert created["spec"] == apply_defaults(schema, obj["spec"])


@pytest.mark.parametrize(("case", "obj", "role"), REFUSED, ids=[c[0] for c in REFUSED])
def test_cel_refuses_naming_both_fields(case, obj, role, apiserver):
    message = RULE.format(role=role)
    assert operator_cel(obj) == [f"spec.engine.tensorParallelSize: {message}"]
    refused = apiserver(obj)
    assert (refused["code"], refused["reason"]) == (422, "Invalid")
    assert refused["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "field": "spec.engine.tensorParallelSize",
            "message": f"Invalid value: {message}",
        }
    ]
    assert refused["message"] == (
        f'{api_names.KIND}.{api_names.GROUP} "svc" is invalid: spec.engine.tensorParallelSize: '
        f"Invalid value: {message}"
    )
    with pytest.raises(InvalidSpec, match="must equal roles"):
        parse(obj)


def test_an_older_crd_without_the_rule_still_gets_the_operators_refusal():
    """The reconciler skips CEL (the API server ran it): the same rule is in ``runnable``."""
    with pytest.raises(InvalidSpec) as info:
        parse(mixed({"tensorParallelSize": 1}, {"gpus": 2}), cel=False)
    assert (
        "spec.engine.tensorParallelSize: 1: must equal spec.roles.mixed.resources.gpus (2) when "
        "that is above 0: one GPU per tensor-parallel rank"
    ) in info.value.problems


# --------------------------------------------------------------------------- rendering


def role_file(children: list[dict], role: str = "mixed") -> dict:
    [config] = [
        c for c in children if c["kind"] == "ConfigMap" and c["metadata"]["name"] == "svc-config"
    ]
    return yaml.safe_load(config["data"][f"{role}.yaml"])


def engine_container(children: list[dict], role: str = "mixed") -> dict:
    [deployment] = [
        c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == f"svc-{role}"
    ]
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "engine")


def test_a_cpu_role_with_tp_2_runs_two_ranks_sharing_its_cpus(engine_runs_tp):
    children = render_object(mixed({"tensorParallelSize": 2}, {"cpu": "8", "memory": "8Gi"}))
    settings = role_file(children)
    assert settings["tensor_parallel_size"] == 2
    assert settings["num_threads"] == 3  # (8 - 1) // 2: one CPU for the API server and engine
    container = engine_container(children)
    assert container["args"] == ["--config", "/etc/ketch/mixed.yaml"]
    resources = {"cpu": "8", "memory": "8Gi"}  # the container's, shared by its processes
    assert container["resources"] == {"limits": resources, "requests": resources}
    # the process reads what `ketch serve --tensor-parallel-size 2 --num-threads 3` sets
    [pod] = read_pods(children, [])
    [proc] = [p for p in pod.processes if p.command == "serve"]
    config = proc.config(EngineConfig)
    assert (config.tensor_parallel_size, config.num_threads) == (2, 3)
    assert check_wiring(children) == []


@pytest.mark.parametrize(
    ("cpu", "tp", "threads"),
    [
        ("2", 1, 1),
        ("16", 1, 15),
        ("500m", 1, 1),
        ("1500m", 1, 1),
        ("2", 2, 1),
        ("3", 2, 1),
        ("8", 2, 3),
        ("9", 2, 4),
        ("17", 4, 4),
        ("4", 4, 1),
    ],
)
def test_threads_per_rank(cpu, tp, threads, engine_runs_tp):
    assert runnable.threads_per_rank(cpu, tp) == threads
    children = render_object(mixed({"tensorParallelSize": tp}, {"cpu": cpu}))
    assert role_file(children)["num_threads"] == threads


def test_threads_follow_each_roles_cpus(engine_runs_tp):
    children = render_object(disaggregated(2, {"cpu": "16"}, {"cpu": "4"}))
    assert role_file(children, "prefill")["num_threads"] == 7
    assert role_file(children, "decode")["num_threads"] == 1


def test_num_threads_set_in_the_spec_wins(engine_runs_tp):
    children = render_object(mixed({"tensorParallelSize": 2, "numThreads": 2}, {"cpu": "16"}))
    assert role_file(children)["num_threads"] == 2


def test_no_cpus_no_threads_and_gpu_roles_leave_threads_alone(engine_runs_tp):
    """Without a CPU limit the engine picks its threads from the cores it sees; a GPU role's
    model runs on its GPUs."""
    children = render_object(mixed({"tensorParallelSize": 2}, {}))
    assert "num_threads" not in role_file(children)
    children = render_object(mixed({"tensorParallelSize": 2}, {"gpus": 2, "cpu": "8"}))
    assert "num_threads" not in role_file(children)
    limits = engine_container(children)["resources"]["limits"]
    assert limits == {"cpu": "8", "nvidia.com/gpu": "2"}


def test_fewer_cpus_than_ranks_is_refused(engine_runs_tp):
    with pytest.raises(InvalidSpec) as info:
        parse(mixed({"tensorParallelSize": 4}, {"cpu": "3"}))
    assert info.value.problems == [
        "spec.roles.mixed.resources.cpu: 3: 4 tensor-parallel ranks "
        "(spec.engine.tensorParallelSize) need at least 4 CPUs, one per worker process: the "
        "ranks meet in an all_reduce in every layer, so one waiting for CPU time stalls them all"
    ]
    parse(mixed({"tensorParallelSize": 4}, {"cpu": "4"}))
    parse(mixed({"tensorParallelSize": 1}, {"cpu": "500m"}))  # one process may share a core


# --------------------------------------------------------------------------- check-wiring


def edit_role_file(children: list[dict], **values) -> None:
    [config] = [c for c in children if c["kind"] == "ConfigMap"]
    config["data"]["mixed.yaml"] = yaml.safe_dump({**role_file(children), **values})


def test_check_wiring_names_a_size_flag_in_the_args():
    children = render_object(mixed({}, {"cpu": "4"}))
    engine_container(children)["args"] += ["--tensor-parallel-size", "3"]
    [reason] = [r.reason for r in refusals(EngineConfig(tensor_parallel_size=3), model=TINY)]
    assert check_wiring(children) == [
        "deployment svc-mixed, container engine: --tensor-parallel-size (container args): 3: "
        f"{reason}"
    ]


def test_check_wiring_counts_the_containers_cpus():
    children = render_object(mixed({}, {"cpu": "2"}))
    edit_role_file(children, tensor_parallel_size=4)  # the tiny model shards 4 ways too
    found = check_wiring(children)
    assert (
        "deployment svc-mixed, container engine: spec.roles.mixed.resources.cpu: 2: 4 "
        "tensor-parallel ranks (spec.engine.tensorParallelSize) need at least 4 CPUs"
    ) in "\n".join(found)
    engines = [f"{r.setting}" for r in refusals(EngineConfig(tensor_parallel_size=4), model=TINY)]
    assert len(found) == len(engines) + 1


def test_check_wiring_wants_one_gpu_per_rank():
    children = render_object(mixed({}, {}))
    engine_container(children)["resources"] = {"limits": {"nvidia.com/gpu": "2"}}
    found = check_wiring(children)
    assert (
        "deployment svc-mixed, container engine: spec.engine.tensorParallelSize: 1: must equal "
        "spec.roles.mixed.resources.gpus (2) when that is above 0: one GPU per tensor-parallel rank"
    ) in found


@landed
def test_the_engine_runs_tp_2_on_the_cpu_and_check_wiring_agrees(tmp_path, capsys):
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump(mixed({"tensorParallelSize": 2}, {"cpu": "2"})))
    assert operator_main(["check-wiring", str(path)]) == 0
    assert capsys.readouterr().out.startswith("wiring OK: 1 InferenceService(s)")
    assert role_file(render_object(yaml.safe_load(path.read_text())))["num_threads"] == 1


@landed
@pytest.mark.parametrize("tp", [3, 8])
def test_a_size_the_model_cannot_shard_is_refused_with_the_engines_reason(tp, tmp_path, capsys):
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(mixed({"tensorParallelSize": tp}, {})))
    assert operator_main(["check-wiring", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"spec.engine.tensorParallelSize: {tp}: " in err
    assert "num_attention_heads" in err  # 4 heads do not split 3 or 8 ways
