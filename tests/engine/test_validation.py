"""Bad input fails early with a ValueError that names what is wrong, and loses nothing.

Covers sampling parameters, engine arguments, prompts, and model directories that are missing,
incomplete, or describe a model the engine cannot run exactly.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ketch.engine import LLM, EngineConfig, ModelLoadError, SamplingParams

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def model_path(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def llm(model_path: Path) -> Iterator[LLM]:
    yield LLM(str(model_path), block_size=16, num_kv_blocks=32, max_model_len=MAX_MODEL_LEN)


# ---- sampling parameters ----


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", -2.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", 2.01),
        ("max_tokens", 0),
        ("max_tokens", -4),
        ("logprobs", 21),
        ("logprobs", -1),
        ("n", 0),
        ("seed", "seven"),
        ("seed", 1.5),
        ("min_tokens", -1),
    ],
)
def test_bad_sampling_params_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_names_both() -> None:
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


@pytest.mark.parametrize("stop", ["", [""], ["ok", ""], [3]])
def test_empty_or_non_string_stop_is_rejected(stop: Any) -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


def test_bad_stop_token_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])


def test_valid_edges_are_accepted() -> None:
    params = SamplingParams(
        temperature=0,
        top_p=1,
        top_k=-1,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2,
        max_tokens=1,
        min_tokens=1,
        logprobs=20,
        seed=-5,
        stop="x",
    )
    assert params.greedy and params.stop == ["x"] and isinstance(params.temperature, float)


# ---- engine arguments ----


def test_unknown_engine_argument_is_named(model_path: Path) -> None:
    with pytest.raises(ValueError, match="max_num_sequences"):
        LLM(str(model_path), max_num_sequences=4)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 17),
        ("kv_cache_memory", "lots"),
        ("kv_cache_memory", "12 parsecs"),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", -1),
        ("max_model_len", 0),
        ("num_kv_blocks", 1),
        ("dtype", "int4"),
    ],
)
def test_bad_engine_config_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_max_model_len_beyond_the_model_is_rejected(model_path: Path) -> None:
    with pytest.raises(ValueError, match=r"max_model_len.*max_position_embeddings"):
        LLM(str(model_path), max_model_len=4096)


def test_kv_cache_too_small_for_max_model_len(model_path: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len") as info:
        LLM(str(model_path), block_size=16, num_kv_blocks=4, max_model_len=256)
    assert "KV cache" in str(info.value)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(str(model_path), block_size=16, kv_cache_memory="4KiB", max_model_len=256)


# ---- prompts ----


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "empty"),
        ([[]], "empty"),
        ([], "non-empty"),
        ([1, 2, 5000], "vocabulary"),
        ([1, -3], "vocabulary"),
        ([1] * MAX_MODEL_LEN, "max_model_len"),
        ("x" * 2000, "max_model_len"),
        (3.5, "prompt"),
        ([["a", "b"]], "prompt"),
    ],
    ids=[
        "empty-text",
        "empty-ids",
        "no-prompts",
        "id-above-vocab",
        "negative-id",
        "too-long-ids",
        "too-long-text",
        "not-a-prompt",
        "mixed-list",
    ],
)
def test_bad_prompts_are_rejected(llm: LLM, prompt: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


GOOD = "The quick brown fox"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize(
    ("prompts", "params"),
    [
        ([GOOD, ""], GREEDY),
        ([GOOD, [1] * 1000], GREEDY),
        ([GOOD, GOOD], [GREEDY, {"max_tokens": 3}]),
        ([GOOD, GOOD], [GREEDY]),
    ],
    ids=["empty-second", "too-long-second", "bad-second-params", "params-count"],
)
def test_a_rejected_batch_loses_nothing(llm: LLM, prompts: list[Any], params: Any) -> None:
    before = llm.generate([GOOD], GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished_requests()
    after = llm.generate([GOOD], GREEDY)
    assert len(after) == 1 and after[0].outputs[0].token_ids == before
    assert llm.engine.kv_cache.pool.num_free_blocks == llm.engine.kv_cache.pool.num_usable_blocks


# ---- model directories ----


def copy_checkpoint(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def edit_config(path: Path, **changes: Any) -> None:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_file.write_text(json.dumps(config))


def load(path: Path | str) -> LLM:
    return LLM(str(path), block_size=16, num_kv_blocks=32, max_model_len=MAX_MODEL_LEN)


def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load(tmp_path / "nowhere")


def test_model_path_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        load(file)


def test_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=re.escape("config.json")):
        load(tmp_path)


def test_config_json_that_is_not_json(model_path: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(model_path, tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture GPT2LMHeadModel"),
        ({"architectures": None, "model_type": "gpt2"}, "unsupported architecture"),
        ({"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True, "sliding_window": 64}, "sliding"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
    ids=[
        "gpt2",
        "no-architectures",
        "yarn-rope-scaling",
        "yarn-rope-parameters",
        "gelu",
        "sliding-window",
        "kv-heads",
        "hidden-size",
    ],
)
def test_configs_the_engine_cannot_honour(
    model_path: Path, tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    path = copy_checkpoint(model_path, tmp_path / "m")
    edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load(path)


@pytest.mark.parametrize(
    ("changes", "tensor"),
    [
        ({"intermediate_size": 96}, "model.layers.0.mlp.gate_proj.weight"),
        ({"hidden_size": 128}, "model.layers.0.self_attn.q_proj.weight"),
        ({"vocab_size": 400}, "model.embed_tokens.weight"),
    ],
)
def test_weight_shape_mismatch_names_the_tensor(
    model_path: Path, tmp_path: Path, changes: dict[str, Any], tensor: str
) -> None:
    path = copy_checkpoint(model_path, tmp_path / "m")
    edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match="shape") as info:
        load(path)
    assert repr(tensor) in str(info.value)


def test_missing_safetensors(model_path: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(model_path, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"\*\.safetensors"):
        load(path)


def test_sharded_index_naming_a_missing_shard(model_path: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(model_path, tmp_path / "m")
    shard = "model-00002-of-00002.safetensors"
    (path / "model-00001-of-00002.safetensors").write_bytes(
        (path / "model.safetensors").read_bytes()
    )
    (path / "model.safetensors").unlink()
    index = {
        "metadata": {},
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": shard,
        },
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=re.escape(shard)):
        load(path)


@pytest.mark.parametrize(
    "index, words",
    [
        ("[]", "expected a JSON object"),
        ("{", "not valid JSON"),
        ("[" * 100_000, "not valid JSON"),
        ('{"weight_map": []}', "weight_map must map"),
        ('{"weight_map": {"a": ["x"]}}', "weight_map must map"),
        ('{"weight_map": {"a": "../../outside.safetensors"}}', "weight_map must map"),
        ('{"weight_map": {"a": "/etc/model.safetensors"}}', "weight_map must map"),
    ],
)
def test_a_hostile_safetensors_index_is_refused(
    model_path: Path, tmp_path: Path, index: str, words: str
) -> None:
    """Never a crash, and never a shard path out of the checkpoint's directory."""
    path = copy_checkpoint(model_path, tmp_path / "m")
    (path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ModelLoadError, match=words):
        load(path)


def test_corrupt_safetensors_names_the_file(model_path: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(model_path, tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=re.escape("model.safetensors")):
        load(path)


def test_missing_weight_is_named(model_path: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(model_path, tmp_path / "m")
    edit_config(path, num_hidden_layers=3)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.\S+ is missing"):
        load(path)


def test_missing_tokenizer_json(model_path: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(model_path, tmp_path / "m")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=re.escape("tokenizer.json")):
        load(path)
