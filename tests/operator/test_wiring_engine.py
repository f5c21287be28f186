"""``check_wiring`` reads each rendered ``ketch serve``'s engine configuration as the engine would
and reports what it would refuse at start-up, naming the InferenceService field.

The operator already refuses such specs before rendering (test_runnable); these cases edit a
rendered manifest, as a hand-made overlay or a builder bug would, so the check on what is
rendered stands on its own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from ketch.engine.capabilities import refusals
from ketch.engine.config import EngineConfig
from ketch.engine.models.architectures import SUPPORTED_ARCHITECTURES
from ketch.engine.serving.config import ServerConfig
from ketch.operator.cli import render_object
from ketch.operator.runnable import known_model
from ketch.operator.wiring import check_wiring
from ketch.operator.wiring.pods import read_pods

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
    engine(children, "qwen-pd-decode")["args"] += ["--dtype", "float16"]
    [problem] = check_wiring(children)
    assert problem.startswith(
        "deployment qwen-pd-decode, container engine: --dtype (container args): float16: "
        "float16 is not a CPU weight dtype: use auto, float32 or bfloat16"
    )


def test_bfloat16_and_int8_in_every_role_file_check_clean():
    children = render("disaggregated")
    for role in ("prefill", "decode"):
        edit_role_file(
            children,
            "qwen-pd-config",
            f"{role}.yaml",
            dtype="bfloat16",
            kv_cache_dtype="bfloat16",
            quantization="int8",
        )
    assert check_wiring(children) == []


def test_int8_on_a_backend_without_it_is_named_by_the_precision_field():
    """The spec cannot set the backend (the CPU's auto runs int8): a hand-set one is named
    where it came from, and the refusal by the field the spec sets."""
    children = render("disaggregated")
    for role in ("prefill", "decode"):
        edit_role_file(children, "qwen-pd-config", f"{role}.yaml", quantization="int8")
    engine(children, "qwen-pd-decode")["args"] += ["--backend", "eager"]
    [refusal] = refusals(EngineConfig(quantization="int8", backend="eager"))
    assert check_wiring(children) == [
        f"deployment qwen-pd-decode, container engine: spec.engine.quantization: int8: "
        f"{refusal.reason} (the backend, eager, is set by --backend (container args))"
    ]
    assert refusal.reason.startswith("quantization=int8 runs on the native backend only")
    children = render("disaggregated")
    edit_role_file(
        children, "qwen-pd-config", "prefill.yaml", backend="predictor", kv_cache_dtype="bfloat16"
    )
    found = check_wiring(children)
    assert found[0].startswith(
        "deployment qwen-pd-prefill, container engine: spec.engine.kvCacheDtype: bfloat16: "
        "kv_cache_dtype=bfloat16 runs on the native backend only"
    )
    assert found[0].endswith(
        "(the backend, predictor, is set by backend (ConfigMap qwen-pd-config key prefill.yaml))"
    )


PAIR = (
    "deployment qwen-pd-prefill, container engine and deployment qwen-pd-decode, container engine"
)


def test_prefill_and_decode_must_hold_one_kv_cache_dtype():
    """Prefill's KV blocks go to decode as they are: a rendered pair whose KV dtypes differ is
    reported, naming both dtypes and what set each."""
    children = render("disaggregated")
    engine(children, "qwen-pd-decode")["args"] += ["--kv-cache-dtype", "bfloat16"]
    [problem] = check_wiring(children)
    assert problem.startswith(
        f"{PAIR}: the KV caches of prefill and decode differ with a checkpoint saved in float32: "
        "float32 on prefill (spec.engine.kvCacheDtype (ConfigMap qwen-pd-config key "
        "prefill.yaml): auto, the weights' dtype: spec.engine.dtype (ConfigMap qwen-pd-config "
        "key prefill.yaml): auto), bfloat16 on decode (--kv-cache-dtype (container args): "
        "bfloat16): prefill sends its KV blocks to decode as they are"
    )
    assert "set spec.engine.kvCacheDtype (one value, which every role's file takes)" in problem
    # auto follows the weights: bfloat16 weights on decode alone split them too
    children = render("disaggregated")
    engine(children, "qwen-pd-decode")["args"] += ["--dtype", "bfloat16"]
    [problem] = check_wiring(children)
    assert "float32 on prefill" in problem and "bfloat16 on decode (" in problem
    assert "the weights' dtype: --dtype (container args): bfloat16)" in problem
    # the same dtype reached two ways is one dtype
    children = render("disaggregated")
    engine(children, "qwen-pd-decode")["args"] += ["--kv-cache-dtype", "bfloat16"]
    edit_role_file(children, "qwen-pd-config", "prefill.yaml", dtype="bfloat16")
    assert check_wiring(children) == []


def test_a_mixed_kv_pair_in_the_role_files_is_reported_for_the_tiny_model():
    children = render("disaggregated")
    for role in ("prefill", "decode"):
        edit_role_file(children, "qwen-pd-config", f"{role}.yaml", model="tiny", max_model_len=512)
    edit_role_file(children, "qwen-pd-config", "prefill.yaml", kv_cache_dtype="bfloat16")
    [problem] = check_wiring(children)
    assert problem.startswith(f"{PAIR}: the KV caches of prefill and decode differ: bfloat16 on")
    assert "float32 on decode" in problem


def test_auto_follows_the_checkpoint_so_an_unknown_one_is_checked_both_ways(tmp_path):
    """dtype auto is bfloat16 for a bfloat16 checkpoint on the native backend, float32 on eager:
    a prefill on eager and a decode on auto differ only for such a checkpoint."""
    children = render("disaggregated")
    edit_role_file(children, "qwen-pd-config", "prefill.yaml", backend="eager")
    [problem] = check_wiring(children)
    assert problem.startswith(
        f"{PAIR}: the KV caches of prefill and decode differ with a checkpoint saved in "
        "bfloat16: float32 on prefill"
    )
    assert "bfloat16 on decode" in problem
    assert check_wiring(children, _checkpoint_config(tmp_path, torch_dtype="float32")) == []
    found = check_wiring(children, _checkpoint_config(tmp_path, torch_dtype="bfloat16"))
    assert [p.split(": the KV caches")[0] for p in found] == [PAIR]
    assert "differ: float32 on prefill" in found[0]  # the checkpoint is known: no "with ..."


def test_both_roles_take_the_one_spec_engine():
    """Roles cannot override engine settings: the CRD's roles have no engine field, and both
    roles' rendered engines resolve the same dtype, KV dtype and quantization."""
    from ketch.operator.crd.document import crd_document

    schema = crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]
    for role in ("mixed", "prefill", "decode"):
        assert "engine" not in schema["properties"]["roles"]["properties"][role]["properties"]
    doc = yaml.safe_load((EXAMPLES / "disaggregated.yaml").read_text())
    doc["spec"]["engine"].update(dtype="bfloat16", kvCacheDtype="bfloat16", quantization="int8")
    children = render_object(doc)
    assert check_wiring(children) == []
    configs = serve_configs(children)
    assert sorted(configs) == ["decode", "prefill"]
    for config in configs.values():
        assert (config.dtype, config.kv_cache_dtype, config.quantization) == (
            "bfloat16",
            "bfloat16",
            "int8",
        )
    for role in ("prefill", "decode"):
        file = yaml.safe_load(get(children, "ConfigMap", "qwen-pd-config")["data"][f"{role}.yaml"])
        assert (file["dtype"], file["kv_cache_dtype"], file["quantization"]) == (
            "bfloat16",
            "bfloat16",
            "int8",
        )
        assert not {"--dtype", "--kv-cache-dtype", "--quantization"} & set(
            engine(children, f"qwen-pd-{role}")["args"]
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


def test_the_memory_limit_holds_the_checkpoints_weights_at_their_precision(tmp_path):
    """With --model-config the weights are known: 16 layers of hidden 1024 and MLP 4096, a
    32000 vocabulary. At float32 they, the KV cache and the headroom overflow a 2400Mi limit;
    bfloat16 with int8 linear layers fit it."""
    from ketch.engine import device as dev
    from ketch.engine.cpu_sizing import cpu_memory
    from ketch.engine.models.config import ModelConfig
    from ketch.engine.models.sharding import whole

    model_dir = _checkpoint_config(
        tmp_path,
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
    )
    model = ModelConfig.from_dir(model_dir)
    children = render("disaggregated")
    for role in ("prefill", "decode"):
        edit_role_file(children, "qwen-pd-config", f"{role}.yaml", kv_cache_memory="512MiB")
        engine(children, f"qwen-pd-{role}")["resources"]["limits"]["memory"] = "2400Mi"
    problems = check_wiring(children, model_dir)
    fp32 = dev.cpu_weight_bytes(model, whole(model), "float32")
    values = yaml.safe_load(get(children, "ConfigMap", "qwen-pd-config")["data"]["decode.yaml"])
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    plan = cpu_memory(EngineConfig(**{k: v for k, v in values.items() if k in names}), model)
    assert plan.weights == fp32 and plan.total > 2400 << 20
    assert problems == [
        f"deployment qwen-pd-{role}, container engine: spec.roles.{role}.resources.memory: "
        f"2400Mi: the engine container needs {plan}, more than its memory limit "
        f"({2400 << 20} bytes): it would be OOM-killed as it loads the weights or fills the KV "
        "cache (its /dev/shm segment counts against the limit); raise "
        f"spec.roles.{role}.resources.memory, or lower spec.engine.kvCacheMemory, or store the "
        "weights in bfloat16 (spec.engine.dtype), or quantize the linear layers to int8 "
        "(spec.engine.quantization)"
        for role in ("prefill", "decode")
    ]
    for role in ("prefill", "decode"):
        edit_role_file(
            children, "qwen-pd-config", f"{role}.yaml", dtype="bfloat16", quantization="int8"
        )
    assert check_wiring(children, model_dir) == []
    del engine(children, "qwen-pd-decode")["resources"]["limits"]["memory"]  # no limit, no check
    assert check_wiring(children, model_dir) == []


LLAMA_8B = {  # meta-llama/Llama-3.1-8B-Instruct's config.json, the fields the engine reads
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _docs_precision_example() -> dict:
    text = (EXAMPLES.parent / "docs" / "operator.md").read_text()
    section = text[text.index("### Precision on the CPU") :]
    snippet = section[section.index("```yaml\n") + 8 : section.index("```\n", 8)]
    spec = yaml.safe_load(snippet)["spec"]
    from ketch.operator import api_names

    return {
        "apiVersion": api_names.API_VERSION,
        "kind": api_names.KIND,
        "metadata": {"name": "llama-bf16", "namespace": "default"},
        "spec": spec,
    }


def test_the_docs_bf16_int8_example_fits_its_memory_and_float32_would_not(tmp_path, capsys):
    """docs/operator.md's bfloat16 + int8 CPU role, checked with the 8B model's config.json as
    ``check-wiring --model-config`` does; its float32 twin overflows the same 20Gi."""
    from ketch.operator.cli import main as operator_main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    doc = _docs_precision_example()
    assert doc["spec"]["roles"]["mixed"]["resources"]["memory"] == "20Gi"
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert operator_main(["check-wiring", str(path), "--model-config", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("wiring OK: 1 InferenceService(s)")
    for field in ("dtype", "quantization", "kvCacheDtype"):
        del doc["spec"]["engine"][field]
    doc["spec"]["engine"]["dtype"] = "float32"
    path.write_text(yaml.safe_dump(doc))
    assert operator_main(["check-wiring", str(path), "--model-config", str(tmp_path)]) == 1
    [problem] = capsys.readouterr().out.splitlines()
    assert "spec.roles.mixed.resources.memory: 20Gi: the engine container needs weights " in problem
    assert "bytes (float32) + KV cache 8589934592 bytes (float32) + headroom " in problem


def serve_configs(children: list[dict]) -> dict[str, EngineConfig]:
    """Each role's EngineConfig as its pod's ``ketch serve`` would read it (check-wiring's view
    of the rendered pods); no pod may fail to read."""
    found: list[str] = []
    configs = {
        proc.config(ServerConfig).role: proc.config(EngineConfig)
        for pod in read_pods(children, found)
        for proc in pod.processes
        if proc.command == "serve"
    }
    assert found == []
    return configs
