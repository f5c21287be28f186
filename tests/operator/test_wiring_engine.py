"""``check_wiring`` reads each rendered ``ketch serve``'s engine configuration as the engine would
and reports what it would refuse at start-up, naming the InferenceService field.

The operator already refuses such specs before rendering (test_runnable); these cases edit a
rendered manifest, as a hand-made overlay or a builder bug would, so the check on what is
rendered stands on its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ketch.engine.capabilities import refusals
from ketch.engine.config import EngineConfig
from ketch.engine.models.architectures import SUPPORTED_ARCHITECTURES
from ketch.operator.cli import render_object
from ketch.operator.runnable import known_model
from ketch.operator.wiring import check_wiring

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def render(name: str) -> list[dict]:
    return render_object(yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()))


def get(children: list[dict], kind: str, name: str) -> dict:
    return next(o for o in children if o["kind"] == kind and o["metadata"]["name"] == name)


def pod(children: list[dict], deployment: str) -> dict:
    return get(children, "Deployment", deployment)["spec"]["template"]["spec"]


def engine(children: list[dict], deployment: str) -> dict:
    return next(c for c in pod(children, deployment)["containers"] if c["name"] == "engine")


def edit_role_file(children: list[dict], config_map: str, key: str, **values) -> None:
    data = get(children, "ConfigMap", config_map)["data"]
    data[key] = yaml.safe_dump({**yaml.safe_load(data[key]), **values})


def test_a_tensor_parallel_size_the_model_cannot_shard_names_the_crd_field():
    """The tiny model's 4 attention heads do not split 3 ways: the engine's own refusal (a
    checkpoint's shape is known to the engine only, at start-up)."""
    children = render("disaggregated")
    for role in ("prefill", "decode"):
        edit_role_file(
            children, "qwen-pd-config", f"{role}.yaml", model="tiny", tensor_parallel_size=3
        )
    tiny = known_model("tiny")
    [reason] = [r.reason for r in refusals(EngineConfig(tensor_parallel_size=3), model=tiny)]
    assert check_wiring(children) == [
        f"deployment qwen-pd-{role}, container engine: spec.engine.tensorParallelSize: 3: {reason}"
        for role in ("prefill", "decode")
    ]


def test_gpus_in_the_engine_container_name_the_roles_field():
    children = render("mixed")
    engine(children, "tiny-mixed")["resources"]["limits"]["nvidia.com/gpu"] = "1"
    [problem] = check_wiring(children)
    assert problem.startswith(
        "deployment tiny-mixed, container engine: spec.roles.mixed.resources.gpus: 1: the engine "
        "runs on the CPU only"
    )
    assert "GPU workers are planned, issue 17" in problem


def test_gpus_of_another_vendor_count_too():
    children = render("mixed")
    engine(children, "tiny-mixed")["resources"]["requests"]["amd.com/gpu"] = "2"
    found = check_wiring(children)
    assert any("spec.roles.mixed.resources.gpus: 2: " in p for p in found), found


def test_a_dtype_flag_in_the_args_is_named_as_the_flag():
    children = render("disaggregated")
    engine(children, "qwen-pd-decode")["args"] += ["--dtype", "bfloat16"]
    [problem] = check_wiring(children)
    assert problem.startswith(
        "deployment qwen-pd-decode, container engine: --dtype (container args): bfloat16: the "
        "engine computes in float32 on the CPU only"
    )


def test_tiny_model_facts_are_checked():
    children = render("mixed")
    edit_role_file(children, "tiny-config", "mixed.yaml", max_model_len=4096)
    [problem] = check_wiring(children)
    assert "spec.engine.maxModelLen: 4096: " in problem
    assert "max_position_embeddings=512" in problem
    children = render("mixed")
    edit_role_file(children, "tiny-config", "mixed.yaml", kv_cache_memory="64KiB")
    [problem] = check_wiring(children)
    assert "spec.engine.kvCacheMemory: 64KiB: the KV cache (0 blocks" in problem


def test_kv_cache_must_fit_the_shm_volume():
    children = render("autoscaled")  # kvCacheMemory 8GiB, shmSize 9Gi
    dshm = next(v for v in pod(children, "llama-chat-mixed")["volumes"] if v["name"] == "dshm")
    dshm["emptyDir"]["sizeLimit"] = "4Gi"
    [problem] = check_wiring(children)
    assert "spec.engine.kvCacheMemory: 8GiB: the KV cache (8589934592 bytes)" in problem
    assert "spec.engine.shmSize 4Gi (4294967296 bytes) cannot hold" in problem
    del dshm["emptyDir"]["sizeLimit"]  # tmpfs sized by the pod's memory: not checked here
    assert check_wiring(children) == []


def test_no_shm_volume_means_the_runtimes_64mi():
    children = render("mixed")  # kvCacheMemory 256MiB
    container = engine(children, "tiny-mixed")
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "dshm"]
    [problem] = check_wiring(children)
    assert "the runtime's default /dev/shm (no volume mounted there) 64Mi" in problem


def _checkpoint_config(tmp_path: Path, **fields) -> Path:
    """A checkpoint directory holding only config.json (all ``--model-config`` reads)."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 32768,
        **fields,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_checkpoint_config_is_checked_as_the_engine_loads_it(tmp_path):
    """``--model-config``: the architecture and every field the engine would refuse at load,
    named, for each engine of the InferenceService; a config the engine serves passes."""
    children = render("disaggregated")
    assert check_wiring(children, _checkpoint_config(tmp_path)) == []
    unknown = _checkpoint_config(tmp_path, architectures=["GPT2LMHeadModel"])
    problems = check_wiring(children, unknown)
    assert len(problems) == 2 and all("unsupported architecture GPT2LMHeadModel" in p
                                      for p in problems)  # fmt: skip
    assert all(", ".join(SUPPORTED_ARCHITECTURES) in p for p in problems)
    gelu = _checkpoint_config(tmp_path, hidden_act="gelu")
    assert all("hidden_act='gelu'" in p for p in check_wiring(children, gelu))
    short = _checkpoint_config(tmp_path, max_position_embeddings=4096)  # the example: 8192
    assert all("spec.engine.maxModelLen: 8192" in p for p in check_wiring(children, short))


def test_a_moe_checkpoint_on_a_backend_without_experts_is_refused(tmp_path):
    children = render("disaggregated")
    for role in ("prefill", "decode"):
        edit_role_file(children, "qwen-pd-config", f"{role}.yaml", backend="predictor")
    moe = _checkpoint_config(
        tmp_path,
        architectures=["Qwen3MoeForCausalLM"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    problems = check_wiring(children, moe)
    assert len(problems) == 2 and all("--backend predictor" in p for p in problems), problems
