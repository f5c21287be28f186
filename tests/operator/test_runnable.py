"""The operator refuses what the engine would refuse at start-up, naming the spec field.

``spec.parse`` (and so ``render``, ``check-wiring`` and the reconciler's ``InvalidSpec``) goes
through ``ketch.operator.runnable``, which asks ``ketch.engine.capabilities``: the specs below
pass the CRD's schema and CEL rules but would render pods that crash-loop (or hold GPUs the
engine never uses). Every example and the CRD's own defaults must pass.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from ketch.engine.capabilities import MAX_GPUS, refusals
from ketch.engine.config import EngineConfig
from ketch.operator import api_names
from ketch.operator.cli import main as operator_main
from ketch.operator.cli import render_object
from ketch.operator.crd.document import crd_document
from ketch.operator.runnable import quantity_bytes
from ketch.operator.spec.engine_config import role_settings
from ketch.operator.spec.parse import InvalidSpec, parse
from ketch.operator.wiring import check_wiring

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
PEER_KEY = {"peerKeySecretRef": {"name": "peer-key"}}


def body(spec: dict, name: str = "svc") -> dict:
    return {
        "apiVersion": api_names.API_VERSION,
        "kind": api_names.KIND,
        "metadata": {"name": name, "namespace": "default"},
        "spec": copy.deepcopy(spec),
    }


def mixed(engine: dict | None = None, resources: dict | None = None, **spec: dict) -> dict:
    roles = {"mixed": {"resources": resources} if resources else {}}
    return body({"model": {"uri": "tiny"}, "engine": engine or {}, "roles": roles, **spec})


def problems(obj: dict) -> list[str]:
    with pytest.raises(InvalidSpec) as info:
        parse(obj)
    return info.value.problems


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_renders_pods_the_engine_runs(path):
    for doc in yaml.safe_load_all(path.read_text()):
        assert check_wiring(render_object(doc)) == []


def test_check_wiring_passes_every_example(capsys):
    assert operator_main(["check-wiring", *map(str, EXAMPLES)]) == 0
    assert capsys.readouterr().out.startswith(f"wiring OK: {len(EXAMPLES)} InferenceService(s)")


@pytest.mark.parametrize(
    "spec",
    [
        {"model": {"uri": "tiny"}, "roles": {"mixed": {}}},
        {"model": {"uri": "hf://org/m"}, "roles": {"prefill": {}, "decode": {}}, "auth": PEER_KEY},
    ],
    ids=["mixed", "disaggregated"],
)
def test_the_crds_defaults_run(spec):
    """Everything the spec leaves out comes from the CRD's defaults, which the engine runs."""
    children = render_object(body(spec))
    assert check_wiring(children) == []
    svc = parse(body(spec))
    for role in svc.roles:
        assert svc.role(role)["resources"]["gpus"] == MAX_GPUS == 0
    engine = svc.spec["engine"]
    assert engine["tensorParallelSize"] == 1 and engine["dtype"] == "auto"


def test_crd_describes_what_runs_and_what_has_not():
    schema = crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]
    resources = schema["properties"]["roles"]["properties"]["mixed"]["properties"]["resources"]
    gpus = resources["properties"]["gpus"]
    assert gpus["default"] == 0
    assert "must equal engine.tensorParallelSize" in gpus["description"]
    assert "GPU workers have not been run anywhere" in gpus["description"]
    assert "(whole CPUs - 1) / tensorParallelSize" in resources["properties"]["cpu"]["description"]
    engine = schema["properties"]["engine"]["properties"]
    tp = engine["tensorParallelSize"]["description"]
    assert "CPU worker processes is what has been run and tested" in tp
    assert "GPU workers have not been run anywhere" in tp
    assert "float16 is refused on the CPU" in engine["dtype"]["description"]
    assert engine["kvCacheDtype"]["enum"] == ["auto", "float32", "bfloat16"]
    assert engine["quantization"]["enum"] == ["none", "int8"]
    assert (
        "prefill and a decode instance must use the same" in engine["kvCacheDtype"]["description"]
    )


# Specs the schema and CEL rules accept but the engine would refuse: (id, spec, field, words).
REFUSED = [
    # the tiny model's 4 attention heads do not split 3 (or 8) ways
    ("tensor parallel 3", mixed({"tensorParallelSize": 3}), "spec.engine.tensorParallelSize: 3: "),
    ("tensor parallel 8", mixed({"tensorParallelSize": 8}), "spec.engine.tensorParallelSize: 8: "),
    (
        "fewer CPUs than ranks",
        mixed({"tensorParallelSize": 2}, {"cpu": "1500m"}),
        "spec.roles.mixed.resources.cpu: 1500m: 2 tensor-parallel ranks "
        "(spec.engine.tensorParallelSize) need at least 2 CPUs, one per worker process",
    ),
    ("gpus", mixed(resources={"gpus": 1}), "spec.roles.mixed.resources.gpus: 1: "),
    (
        "float16",
        mixed({"dtype": "float16"}),
        "spec.engine.dtype: float16: float16 is not a CPU weight dtype",
    ),
    (
        "float16 beside a bfloat16 KV cache and int8",
        mixed({"dtype": "float16", "kvCacheDtype": "bfloat16", "quantization": "int8"}),
        "spec.engine.dtype: float16: ",
    ),
    ("kv cache dtype float16", mixed({"kvCacheDtype": "float16"}), "spec.engine.kvCacheDtype: "),
    ("quantization int4", mixed({"quantization": "int4"}), "spec.engine.quantization: "),
    (
        "max model len past the tiny model's",
        mixed({"maxModelLen": 4096}),
        "spec.engine.maxModelLen: 4096: ",
    ),
    (
        "kv cache too small for one request",
        mixed({"kvCacheMemory": "64KiB"}),
        "spec.engine.kvCacheMemory: 64KiB: the KV cache (",
    ),
    (
        "kv blocks too few",
        mixed({"numKvBlocks": 3}),
        "spec.engine.numKvBlocks: 3: ",
    ),
    (
        "kv cache larger than /dev/shm",
        mixed({"kvCacheMemory": "4GiB", "shmSize": "2Gi"}),
        "spec.engine.kvCacheMemory: 4GiB: the KV cache (",
    ),
    (
        "kv blocks larger than /dev/shm",
        mixed({"numKvBlocks": 100000, "shmSize": "64Mi"}),
        "spec.engine.numKvBlocks: 100000: the KV cache (13107200000 bytes)",
    ),
]


@pytest.mark.parametrize(("case", "obj", "words"), REFUSED, ids=[c[0] for c in REFUSED])
def test_operator_refuses_what_the_engine_would_naming_the_field(case, obj, words):
    assert any(p.startswith(words) for p in problems(obj)), problems(obj)


def test_kv_cache_larger_than_shm_names_both_fields():
    [problem] = problems(mixed({"kvCacheMemory": "4GiB", "shmSize": "2Gi"}))
    assert "spec.engine.shmSize 2Gi" in problem and "/dev/shm" in problem
    parse(mixed({"kvCacheMemory": "4GiB", "shmSize": "5Gi"}))  # fits: accepted
    # a checkpoint's facts are unknown here: the KV cache is at most kvCacheMemory
    checkpoint = mixed({"kvCacheMemory": "3GiB"}, model={"uri": "hf://org/m"})
    assert "spec.engine.shmSize 2Gi" in problems(checkpoint)[0]


def test_tensor_parallel_ranks_need_their_collectives_segment_in_shm_too():
    """At tp > 1 the ranks' all-reduce segment (ShmGroup.nbytes) lives beside the KV cache."""
    from ketch.kernels.collective import ShmGroup

    exact = {"kvCacheMemory": "64MiB", "shmSize": "64Mi", "numThreads": 1}
    parse(mixed(exact))  # tp 1: the KV cache alone fits exactly
    [problem] = problems(mixed({**exact, "tensorParallelSize": 2}))
    assert f"the 2 ranks' collectives segment ({ShmGroup.nbytes(2)} bytes)" in problem
    room = 64 + -(-ShmGroup.nbytes(2) // 2**20)
    parse(mixed({**exact, "tensorParallelSize": 2, "shmSize": f"{room}Mi"}))


def test_the_message_is_the_engines_own():
    """Same words as ketch.engine.capabilities, which LLMEngine raises at start-up."""
    [problem] = problems(mixed({"dtype": "float16"}))
    [refusal] = refusals(EngineConfig(dtype="float16"))
    assert problem == f"spec.engine.dtype: float16: {refusal.reason}"


PRECISION = {"dtype": "bfloat16", "kvCacheDtype": "bfloat16", "quantization": "int8"}


@pytest.mark.parametrize(
    "engine",
    [{"dtype": "bfloat16"}, {"kvCacheDtype": "bfloat16"}, {"quantization": "int8"}, PRECISION],
    ids=["bf16 weights", "bf16 kv cache", "int8", "all three"],
)
def test_cpu_roles_run_bfloat16_and_int8(engine):
    """The native backend (the CPU's auto) runs bfloat16 weights, a bfloat16 KV cache and int8
    linear layers: accepted, rendered into the role file, and the rendered pods check clean."""
    obj = mixed(engine, {"cpu": "2", "memory": "2Gi"})
    svc = parse(obj)
    settings = role_settings(svc, "mixed")
    for field, key in (("dtype", "dtype"), ("kvCacheDtype", "kv_cache_dtype"),
                       ("quantization", "quantization")):  # fmt: skip
        assert settings[key] == engine.get(field, svc.spec["engine"][field])
    assert check_wiring(render_object(obj)) == []


def test_a_bfloat16_kv_cache_of_the_same_memory_has_twice_the_blocks_in_the_same_bytes():
    """/dev/shm holds the KV cache's bytes at its dtype: kvCacheMemory is bytes, so it fits
    (or not) the same at either dtype; a fixed numKvBlocks takes half the bytes at bfloat16."""
    too_big = {"kvCacheMemory": "4GiB", "shmSize": "2Gi"}
    found = [problems(mixed({**too_big, "kvCacheDtype": kv})) for kv in ("float32", "bfloat16")]
    assert found[0] == found[1]
    assert "the KV cache (4294967296 bytes)" in found[0][0]
    # the tiny model's block: 2 (K, V) x 4 layers x 64 tokens x 2 KV heads x 32 x 4 bytes
    block = 2 * 4 * 64 * 2 * 32 * 4
    blocks = {"numKvBlocks": 600, "shmSize": "64Mi"}  # 75 MiB at float32, 37.5 at bfloat16
    [problem] = problems(mixed(blocks))
    assert f"spec.engine.numKvBlocks: 600: the KV cache ({600 * block} bytes)" in problem
    parse(mixed({**blocks, "kvCacheDtype": "bfloat16"}))
    parse(mixed({**blocks, "dtype": "bfloat16"}))  # auto: the weights' dtype


def test_the_memory_limit_must_hold_weights_kv_cache_and_headroom():
    """With the model's facts known (tiny), resources.memory must hold the weights at their
    precision + the KV cache (in memory-backed /dev/shm) + the headroom: the problem names
    each number. 8000 blocks are 1000 MiB at float32, 500 MiB at bfloat16."""
    from ketch.engine.cpu_sizing import cpu_memory
    from ketch.operator.runnable import known_model

    engine = {"numKvBlocks": 8000, "shmSize": "1Gi"}
    [problem] = problems(mixed(engine, {"memory": "1500Mi"}))
    plan = cpu_memory(EngineConfig(num_kv_blocks=8000), known_model("tiny"))
    assert problem == (
        f"spec.roles.mixed.resources.memory: 1500Mi: the engine container needs {plan}, more "
        f"than its memory limit ({1500 << 20} bytes): it would be OOM-killed as it loads the "
        "weights or fills the KV cache (its /dev/shm segment counts against the limit); raise "
        "spec.roles.mixed.resources.memory, or lower spec.engine.numKvBlocks, or store the "
        "weights in bfloat16 (spec.engine.dtype), or quantize the linear layers to int8 "
        "(spec.engine.quantization), or hold the KV cache in bfloat16 (spec.engine.kvCacheDtype)"
    )
    assert f"KV cache {8000 * 131072} bytes (float32)" in problem
    assert "weights 4198912 bytes (float32)" in problem and plan.total > 1500 << 20
    parse(mixed({**engine, "kvCacheDtype": "bfloat16"}, {"memory": "1500Mi"}))
    parse(mixed(engine, {"memory": "2Gi"}))
    parse(mixed(engine))  # no memory limit: nothing to check
    # what the end-to-end tests run for real: the tiny model, a 256MiB KV cache, in 1Gi
    parse(mixed({"kvCacheMemory": "256MiB"}, {"cpu": "500m", "memory": "1Gi"}))
    # a checkpoint's facts are unknown to spec validation: its memory is not checked here
    parse(mixed(engine, {"memory": "1500Mi"}, model={"uri": "hf://org/m"}))


def test_the_memory_problem_counts_every_rank():
    from ketch.kernels.collective import ShmGroup

    engine = {"numKvBlocks": 8000, "shmSize": "1100Mi", "tensorParallelSize": 2}
    [problem] = problems(mixed(engine, {"cpu": "4", "memory": "1500Mi"}))
    assert "(4 processes at 192 MiB and one step's activations)" in problem
    assert f"+ the 2 ranks' collectives segment {ShmGroup.nbytes(2)} bytes = " in problem
    assert "weights 4727808 bytes (float32)" in problem  # embedding and norms on each rank


def test_disaggregated_names_each_roles_gpus_and_the_shared_field_once():
    spec = {
        "model": {"uri": "hf://org/m"},
        "engine": {"dtype": "float16"},
        "roles": {"prefill": {"resources": {"gpus": 1}}, "decode": {"resources": {"gpus": 1}}},
        "auth": PEER_KEY,
    }
    found = problems(body(spec))
    assert [p.split(":")[0] for p in found] == [
        "spec.engine.dtype",
        "spec.roles.prefill.resources.gpus",
        "spec.roles.decode.resources.gpus",
    ]


def test_render_and_check_wiring_refuse_such_a_file(tmp_path, capsys):
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(mixed({"tensorParallelSize": 3}, {"gpus": 3})))
    for command in ("render", "check-wiring"):
        assert operator_main([command, str(path)]) == 1
        err = capsys.readouterr().err
        assert "spec.engine.tensorParallelSize: 3: " in err
        assert "spec.roles.mixed.resources.gpus: 3" in err


@pytest.mark.parametrize(
    ("quantity", "size"),
    [("2Gi", 2 << 30), ("512Mi", 512 << 20), ("1.5Gi", 3 << 29), ("3G", 3 * 10**9), ("7", 7)],
)
def test_quantity_bytes(quantity, size):
    assert quantity_bytes(quantity) == size


def test_quantity_bytes_of_nonsense_is_none():
    assert quantity_bytes("lots") is None and quantity_bytes("2GiB") is None
