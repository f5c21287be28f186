"""The device layer (``ketch.engine.device``) and the GPU side of ``capabilities``, on the CPU.

No paddle GPU build can be installed where Ketch is tested, so the GPU path never runs here. What
is tested is everything around it that does not need a GPU: parsing ``--device``, which rank
uses which GPU, the dtype rules, the KV-cache memory arithmetic (with made-up GPUs passed as the
probe), the refusals, and that ``--device gpu`` on this CPU-only paddle fails at start-up with a
clear message (offline, and from the command line).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from ketch.engine import device as dev
from ketch.engine.capabilities import (
    check_runnable,
    compute_dtype,
    kv_cache_bytes,
    num_kv_blocks,
    refusals,
)
from ketch.engine.config import EngineConfig
from ketch.engine.device import CPU, Device, GpuInfo, parse_device, rank_device, resolve_dtype
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.paths import TINY_MODEL_DIR
from ketch.engine.models.sharding import Shard

TINY = ModelConfig.from_dir(TINY_MODEL_DIR)  # 4 layers, 4 heads, 2 KV heads of 32, 512 positions
GIB = 1 << 30
NO_CUDA = "built without CUDA"


# ------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [("cpu", CPU), ("gpu", Device("gpu")), ("gpu:0", Device("gpu")), ("gpu:7", Device("gpu", 7))],
)
def test_devices_parse(text, expected):
    assert parse_device(text) == expected
    assert str(parse_device(str(expected))) == str(expected)


@pytest.mark.parametrize(
    "text", ["", "GPU", "cuda", "cuda:0", "gpu:", "gpu:-1", "gpu:1.5", "gpu: 1", "gpu:0x1", " cpu",
             "cpu:0", "gpu:0,1", None, 0],
)  # fmt: skip
def test_bad_devices_are_refused_naming_the_forms(text):
    with pytest.raises(ValueError, match=r"'cpu', 'gpu' or 'gpu:N'"):
        parse_device(text)


def test_a_huge_gpu_index_is_refused():
    assert parse_device("gpu:255").index == 255
    with pytest.raises(ValueError, match="GPU index 256 is above 255"):
        parse_device("gpu:256")
    with pytest.raises(ValueError, match="above 255"):
        parse_device("gpu:" + "9" * 40)


def test_rank_r_runs_on_the_base_gpu_plus_r():
    assert [str(d) for d in dev.rank_devices(parse_device("gpu:2"), 3)] == [
        "gpu:2",
        "gpu:3",
        "gpu:4",
    ]
    assert dev.rank_devices(CPU, 4) == (CPU,) * 4  # CPU ranks share the CPUs
    with pytest.raises(ValueError, match="negative"):
        rank_device(CPU, -1)
    with pytest.raises(ValueError, match="above 255"):
        rank_device(parse_device("gpu:250"), 6)


def test_engine_config_validates_the_device_and_utilization():
    assert EngineConfig().device == "cpu" and EngineConfig().gpu_memory_utilization == 0.9
    assert EngineConfig(device="gpu:1", gpu_memory_utilization=1).device == "gpu:1"
    with pytest.raises(ValueError, match="'gpu:N'"):
        EngineConfig(device="cuda:0")
    for bad in (0, 0.0, -0.5, 1.01, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
            EngineConfig(gpu_memory_utilization=bad)
    for bad in ("0.5", True, None):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be a number"):
            EngineConfig(gpu_memory_utilization=bad)


def test_the_flags_say_the_gpu_path_has_never_run():
    help_of = {f.name: f.metadata["help"] for f in dataclasses.fields(EngineConfig)}
    assert "NEVER BEEN RUN" in help_of["device"]
    assert "never run" in help_of["gpu_memory_utilization"]
    assert "never run" in help_of["dtype"]


# --------------------------------------------------------------------------------------- dtype


def test_dtype_rules():
    assert resolve_dtype(CPU, "auto") == resolve_dtype(CPU, "float32") == "float32"
    assert resolve_dtype(CPU, "bfloat16") == "bfloat16"
    assert resolve_dtype(CPU, "auto", checkpoint_dtype="bfloat16") == "bfloat16"
    assert resolve_dtype(CPU, "auto", checkpoint_dtype="float16") == "float32"
    with pytest.raises(ValueError, match="no float16 arithmetic"):
        resolve_dtype(CPU, "float16")
    gpu = parse_device("gpu")
    assert resolve_dtype(gpu, "auto", (9, 0)) == "bfloat16"  # Hopper
    assert resolve_dtype(gpu, "auto", (8, 0)) == "bfloat16"  # Ampere
    assert resolve_dtype(gpu, "auto", (7, 5)) == "float16"  # Turing: no bfloat16
    assert resolve_dtype(gpu, "auto") == "bfloat16"  # capability unknown
    for dtype in dev.GPU_DTYPES:
        assert resolve_dtype(gpu, dtype, (9, 0)) == dtype
    assert resolve_dtype(gpu, "float16", (7, 0)) == "float16"
    with pytest.raises(ValueError, match=r"compute capability 8\.0 or newer; gpu:0 is 7\.5"):
        resolve_dtype(gpu, "bfloat16", (7, 5))
    assert dev.dtype_problem(gpu, "int8") is not None


# ------------------------------------------------------------------------------ memory budget


def test_kv_block_and_weight_arithmetic():
    whole = Shard.of(TINY, 0, 1)
    c, d = TINY, TINY.head_dim
    block = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * d * 2
    assert dev.kv_block_bytes(TINY, whole, 16, "bfloat16") == block
    assert dev.kv_block_bytes(TINY, Shard.of(TINY, 1, 2), 16, "bfloat16") == block // 2
    h, i = c.hidden_size, c.intermediate_size
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * d
    layer = h * qkv + c.num_attention_heads * d * h + 3 * h * i + 2 * h
    layer += qkv if c.qkv_bias else 0
    elements = c.num_hidden_layers * layer + 2 * c.vocab_size * h + h  # embed + lm_head + norm
    rope = 2 * 512 * d * 4
    assert dev.weight_bytes(TINY, whole, "float16", 512) == elements * 2 + rope
    # only rank 0 holds the lm_head; each rank half the heads and MLP columns
    rank1 = dev.weight_bytes(TINY, Shard.of(TINY, 1, 2), "float16", 512)
    rank0 = dev.weight_bytes(TINY, Shard.of(TINY, 0, 2), "float16", 512)
    assert rank0 - rank1 == c.vocab_size * h * 2


def test_gpu_kv_plan_with_made_up_free_memory():
    shard = Shard.of(TINY, 0, 1)
    info = GpuInfo(0, "fake", free=10 * GIB, total=16 * GIB, capability=(9, 0))
    plan = dev.gpu_kv_plan(
        info, 0.5, TINY, shard, dtype="bfloat16", block_size=16,
        max_num_batched_tokens=2048, max_len=512,
    )  # fmt: skip
    assert plan.budget == 5 * GIB
    assert plan.weights == dev.weight_bytes(TINY, shard, "bfloat16", 512)
    assert plan.reserve == dev.activation_reserve(TINY, shard, "bfloat16", 2048, 512)
    assert plan.reserve > dev.GPU_RUNTIME_BYTES
    expected = (5 * GIB - plan.weights - plan.reserve) // plan.block_bytes
    assert plan.num_blocks == expected > 0
    assert f"= {expected} blocks" in str(plan)
    starved = dataclasses.replace(info, free=GIB)  # less than the runtime allowance
    assert dev.gpu_kv_plan(
        starved, 0.9, TINY, shard, dtype="bfloat16", block_size=16,
        max_num_batched_tokens=2048, max_len=512,
    ).num_blocks == 0  # fmt: skip
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        dev.gpu_kv_plan(
            info, 1.5, TINY, shard, dtype="bfloat16", block_size=16,
            max_num_batched_tokens=2048, max_len=512,
        )  # fmt: skip


def test_the_reserve_grows_with_the_step():
    shard = Shard.of(TINY, 0, 1)
    small = dev.activation_reserve(TINY, shard, "bfloat16", 256, 512)
    assert dev.activation_reserve(TINY, shard, "bfloat16", 8192, 512) > small
    assert dev.activation_reserve(TINY, shard, "float32", 256, 512) > small
    assert dev.attention_window(256, 512) == 512 and dev.attention_window(8192, 512) == 8192


# ------------------------------------------------------------------ capabilities with a GPU


def fake_gpus(*free_gib: float, capability=(9, 0), count: int | None = None):
    """A probe reporting GPUs 0.. with ``free_gib`` free each (and ``count`` visible)."""
    visible = len(free_gib) if count is None else count

    def probe(indices):
        if max(indices) >= visible:
            raise dev.DeviceError(f"gpu:{max(indices)} does not exist: CUDA sees {visible}")
        return tuple(
            GpuInfo(i, "fake", int(free_gib[i] * GIB), 80 * GIB, capability) for i in indices
        )

    return probe


def test_a_gpu_config_runs_where_the_gpus_are_there():
    config = EngineConfig(device="gpu", tensor_parallel_size=2)
    probe = fake_gpus(40, 20)
    assert refusals(config, model=TINY, probe=probe) == []
    check_runnable(config, TINY, probe=probe)
    assert compute_dtype(config, probe) == "bfloat16"
    assert compute_dtype(config, fake_gpus(40, 20, capability=(7, 5))) == "float16"
    blocks = num_kv_blocks(config, TINY, probe)
    per_rank = [
        dev.gpu_kv_plan(
            GpuInfo(r, "fake", free * GIB, 80 * GIB, (9, 0)), 0.9, TINY, Shard.of(TINY, r, 2),
            dtype="bfloat16", block_size=64, max_num_batched_tokens=2048, max_len=512,
        ).num_blocks
        for r, free in enumerate((40, 20))
    ]  # fmt: skip
    assert blocks == min(per_rank) == per_rank[1]  # the fuller GPU decides
    block = dev.kv_block_bytes(TINY, Shard.of(TINY, 0, 2), 64, "bfloat16")
    assert kv_cache_bytes(config, TINY, probe) == blocks * block
    # an explicit block count still wins
    exact = dataclasses.replace(config, num_kv_blocks=9)
    assert num_kv_blocks(exact, TINY, probe) == 9


def test_what_a_gpu_config_is_refused_for():
    config = EngineConfig(device="gpu:1", tensor_parallel_size=2)
    [missing] = refusals(config, model=TINY, probe=fake_gpus(40, 40))
    assert (missing.setting, missing.value) == ("device", "gpu:1")
    assert "gpu:2 does not exist" in missing.reason
    bf16 = EngineConfig(device="gpu", dtype="bfloat16")
    [old] = refusals(bf16, model=TINY, probe=fake_gpus(40, capability=(7, 0)))
    assert old.setting == "dtype" and "use float16" in old.reason
    native = EngineConfig(device="gpu", backend="native")
    [backend] = refusals(native, model=TINY, probe=fake_gpus(40))
    assert backend.setting == "backend" and "CPU backend" in backend.reason
    [full] = refusals(EngineConfig(device="gpu"), model=TINY, probe=fake_gpus(1.0))
    assert full.setting == "gpu_memory_utilization"
    assert "cannot hold one request of max_model_len=512" in full.reason
    far = EngineConfig(device="gpu:250", tensor_parallel_size=8)
    found = refusals(far, model=TINY, probe=fake_gpus(40))
    assert any(r.setting == "device" and "gpu:257" in r.reason for r in found)


def test_the_operator_never_probes():
    """The operator's configs are CPU configs (device is not a CRD field): refusals asks no
    probe for them, so the operator never needs paddle or CUDA."""

    def probe(indices):
        raise AssertionError("probed")

    assert refusals(EngineConfig(), model=TINY, gpus=0, probe=probe) == []


# ------------------------------------------------------------- on this paddle: no CUDA at all


def test_this_paddle_has_no_cuda_and_says_so():
    import paddle

    assert not paddle.device.is_compiled_with_cuda()
    assert NO_CUDA in dev.cuda_problem()
    with pytest.raises(dev.DeviceError, match=NO_CUDA):
        dev.probe_gpus((0,))
    [refusal] = refusals(EngineConfig(device="gpu"), model=TINY)
    assert (refusal.setting, refusal.value) == ("device", "gpu")
    assert NO_CUDA in refusal.reason and "--device cpu" in refusal.reason
    assert "has never been run" in refusal.reason


def test_llm_with_device_gpu_fails_at_start_up_with_the_same_words():
    from ketch.engine.llm import LLM

    expected = "; ".join(map(str, refusals(EngineConfig(device="gpu"), model=TINY)))
    with pytest.raises(ValueError) as info:
        LLM("tiny", device="gpu")
    assert str(info.value) == expected and NO_CUDA in expected


def test_ketch_generate_with_device_gpu_is_a_one_line_error(tmp_path: Path):
    script = Path(sys.executable).parent / "ketch"
    result = subprocess.run(
        [str(script), "generate", "--device", "gpu:0", "hello"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    [error] = [line for line in result.stderr.splitlines() if line.startswith("ketch: error:")]
    assert "device=gpu:0" in error and NO_CUDA in error


# ----------------------------------------------------------------- the worker side, unrun


def test_nccl_environment_per_rank():
    from ketch.kernels.collective import tp_environment

    endpoints = ["127.0.0.1:1", "127.0.0.1:2"]
    cpu = tp_environment(1, endpoints)
    assert "FLAGS_selected_gpus" not in cpu and cpu["PADDLE_TRAINER_ID"] == "1"
    gpu = tp_environment(1, endpoints, gpu=5)
    assert gpu["PADDLE_DISTRI_BACKEND"] == "nccl" and gpu["FLAGS_selected_gpus"] == "5"
    assert {k: v for k, v in gpu.items() if k not in cpu or k == "PADDLE_DISTRI_BACKEND"} == {
        "PADDLE_DISTRI_BACKEND": "nccl",
        "FLAGS_selected_gpus": "5",
    }


def test_the_shared_memory_all_reduce_is_refused_on_a_gpu(monkeypatch):
    from ketch.engine.worker.remote_runner import RemoteRunner
    from ketch.engine.worker.runner_config import RunnerConfig
    from ketch.engine.worker.worker_process import COLLECTIVE_ENV

    monkeypatch.setenv(COLLECTIVE_ENV, "shm")
    config = RunnerConfig(TINY_MODEL_DIR, TINY, 128, 8, 16, device="gpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="shared-memory all-reduce is CPU only"):
        RemoteRunner(config, port=1)


def test_the_oldest_gpu_decides_the_dtype():
    def mixed(indices):
        caps = {0: (9, 0), 1: (7, 5)}
        return tuple(GpuInfo(i, "fake", 40 * GIB, 80 * GIB, caps[i]) for i in indices)

    config = EngineConfig(device="gpu", tensor_parallel_size=2)
    assert compute_dtype(config, mixed) == "float16"
    [refusal] = refusals(dataclasses.replace(config, dtype="bfloat16"), model=TINY, probe=mixed)
    assert refusal.setting == "dtype" and "is 7.5" in refusal.reason
