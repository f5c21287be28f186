"""``ketch.engine.capabilities``: the settings this build refuses at start-up, in one place.

The operator calls ``refusals`` on what it renders; the engine calls ``check_runnable`` before it
loads anything. The last tests check that the engine really does (an ``LLM`` refuses with the
same words), so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses

import pytest

from ketch.engine.capabilities import (
    check_runnable,
    compute_dtype,
    kv_cache_bytes,
    kv_cache_dtype,
    max_model_len,
    num_kv_blocks,
    refusals,
)
from ketch.engine.config import EngineConfig
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.paths import TINY_MODEL_DIR

TINY = ModelConfig.from_dir(TINY_MODEL_DIR)  # 4 layers, 2 KV heads of 32, 512 positions


def settings(refused: list) -> dict:
    return {r.setting: r.value for r in refused}


def test_defaults_run():
    assert refusals(EngineConfig(), model=TINY, gpus=0) == []
    check_runnable(EngineConfig(), TINY)
    assert compute_dtype(EngineConfig()) == compute_dtype(EngineConfig(dtype="float32"))


@pytest.mark.parametrize(
    ("changes", "setting", "words"),
    [
        ({"dtype": "float16"}, "dtype", "no float16 arithmetic"),
        ({"dtype": "bfloat16", "backend": "eager"}, "backend", "dtype=bfloat16 runs on the native"),
        ({"kv_cache_dtype": "bfloat16", "backend": "predictor"}, "backend", "kv_cache_dtype=bf"),
        ({"quantization": "int8", "backend": "eager"}, "backend", "quantization=int8 runs on"),
        ({"quantization": "int8", "device": "gpu"}, "quantization", "CPU only"),
        ({"kv_cache_dtype": "float32", "device": "gpu"}, "kv_cache_dtype", "use auto"),
    ],
)
def test_what_the_cpu_engine_refuses(changes, setting, words):
    gpu = changes.get("device") == "gpu"
    found = refusals(EngineConfig(**changes), probe=fake_gpu if gpu else None)
    [refusal] = [r for r in found if r.setting == setting]
    assert refusal.value == changes[setting]
    assert words in refusal.reason
    assert str(refusal).startswith(f"{setting}={changes[setting]}: ")


def fake_gpu(indices):
    from ketch.engine.device import GpuInfo

    return tuple(GpuInfo(i, "H200", 100 << 30, 140 << 30, (9, 0)) for i in indices)


def test_below_float32_on_the_cpu():
    """bfloat16 weights and KV cache and int8 weights run on the CPU's native backend; auto
    follows a bfloat16 checkpoint there (not on eager, which computes from float32 tensors)."""
    below = ({"dtype": "bfloat16"}, {"quantization": "int8"}, {"kv_cache_dtype": "bfloat16"})
    for changes in below:
        for backend in ("auto", "native"):
            assert refusals(EngineConfig(backend=backend, **changes), model=TINY) == []
    bf16 = dataclasses.replace(TINY, torch_dtype="bfloat16")
    assert compute_dtype(EngineConfig(), model=bf16) == "bfloat16"
    assert compute_dtype(EngineConfig(), model=TINY) == "float32"
    assert compute_dtype(EngineConfig(backend="eager"), model=bf16) == "float32"
    assert compute_dtype(EngineConfig(dtype="float32"), model=bf16) == "float32"
    assert kv_cache_dtype(EngineConfig(), model=bf16) == "bfloat16"
    assert kv_cache_dtype(EngineConfig(kv_cache_dtype="float32"), model=bf16) == "float32"
    assert kv_cache_dtype(EngineConfig(quantization="int8"), model=TINY) == "float32"
    # The KV cache's bytes follow its dtype: twice the blocks in the same memory.
    wide = num_kv_blocks(EngineConfig(), TINY)
    assert num_kv_blocks(EngineConfig(kv_cache_dtype="bfloat16"), TINY) == 2 * wide
    assert kv_cache_bytes(EngineConfig(dtype="bfloat16"), bf16) <= EngineConfig().kv_cache_bytes


def test_tensor_parallel_sizes_the_model_can_be_split_into():
    """TINY has 4 query heads, 2 KV heads and an MLP of 384: 2 and 4 ranks split it (4 ranks
    replicate each KV head twice), 3 does not; more than 64 ranks is refused without a model."""
    for tp in (1, 2, 4):
        assert refusals(EngineConfig(tensor_parallel_size=tp), model=TINY) == []
    [odd] = refusals(EngineConfig(tensor_parallel_size=3), model=TINY)
    assert (odd.setting, odd.value) == ("tensor_parallel_size", 3)
    assert "num_attention_heads 4 is not divisible" in odd.reason
    assert "num_key_value_heads 2 and tensor_parallel_size 3" in odd.reason
    assert refusals(EngineConfig(tensor_parallel_size=3)) == []  # the model decides
    [huge] = refusals(EngineConfig(tensor_parallel_size=10**9))
    assert huge.setting == "tensor_parallel_size" and "at most 64" in huge.reason
    [huge] = refusals(EngineConfig(tensor_parallel_size=10**9), model=TINY)  # named once
    assert "at most 64" in huge.reason
    for backend in ("eager", "predictor"):
        [serial] = refusals(EngineConfig(tensor_parallel_size=2, backend=backend), model=TINY)
        assert (serial.setting, serial.value) == ("backend", backend)
        assert "native backend only" in serial.reason
    for backend in ("auto", "native"):
        assert refusals(EngineConfig(tensor_parallel_size=2, backend=backend), model=TINY) == []


def test_gpus_are_refused_only_when_the_caller_knows_them():
    assert refusals(EngineConfig()) == []  # the engine itself cannot see the pod's GPUs
    [refusal] = refusals(EngineConfig(), gpus=2)
    assert (refusal.setting, refusal.value) == ("gpus", 2)
    assert "CPU only" in refusal.reason and "use 0" in refusal.reason
    # why: the GPU path exists, but nobody has run it
    assert "--device gpu" in refusal.reason and "has never been run" in refusal.reason


def test_every_refusal_is_named_at_once():
    config = EngineConfig(tensor_parallel_size=3, dtype="float16")
    assert settings(refusals(config, model=TINY, gpus=4)) == {
        "tensor_parallel_size": 3,
        "dtype": "float16",
        "gpus": 4,
    }
    with pytest.raises(ValueError, match=r"dtype=float16: .*; tensor_parallel_size=3: "):
        check_runnable(config, TINY)


def test_checks_that_need_the_model():
    too_long = EngineConfig(max_model_len=4096)
    assert refusals(too_long) == []  # without the model's facts: not known
    [refusal] = refusals(too_long, model=TINY)
    assert refusal.setting == "max_model_len" and "max_position_embeddings=512" in refusal.reason
    [small] = refusals(EngineConfig(kv_cache_memory="64KiB", block_size=16), model=TINY)
    assert small.setting == "kv_cache_memory" and "cannot hold one request" in small.reason
    [blocks] = refusals(EngineConfig(num_kv_blocks=4, block_size=16), model=TINY)
    assert blocks.setting == "num_kv_blocks" and "it needs 33 blocks" in blocks.reason


def test_kv_cache_arithmetic():
    config = EngineConfig(kv_cache_memory="1MiB", block_size=16)
    block = 2 * TINY.num_hidden_layers * 16 * TINY.num_key_value_heads * TINY.head_dim * 4
    assert num_kv_blocks(config, TINY) == (1 << 20) // block
    assert kv_cache_bytes(config, TINY) == num_kv_blocks(config, TINY) * block
    assert num_kv_blocks(dataclasses.replace(config, num_kv_blocks=7), TINY) == 7
    assert max_model_len(config, TINY) == TINY.max_position_embeddings
    assert max_model_len(EngineConfig(max_model_len=100), TINY) == 100


@pytest.mark.parametrize(
    "changes",
    [{"tensor_parallel_size": 3}, {"dtype": "float16"}, {"max_model_len": 4096}],
    ids=["tp", "dtype", "max-model-len"],
)
def test_the_engine_refuses_with_the_same_words(changes):
    """LLMEngine calls check_runnable: the message is exactly what the operator reports."""
    from ketch.engine.llm import LLM

    expected = "; ".join(map(str, refusals(EngineConfig(**changes), model=TINY)))
    with pytest.raises(ValueError) as info:
        LLM("tiny", **changes)
    assert str(info.value) == expected
