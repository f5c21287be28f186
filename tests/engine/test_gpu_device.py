"""The GPU path on a real GPU: skipped wherever paddle has no CUDA, which is everywhere Ketch has
been tested so far. These tests have NEVER RUN; they are the first checks to run on a machine
with a paddlepaddle-gpu build (docs/gpu.md).

What they check there: the probe reports the GPU, the fused op's causal alignment is one of the
two known conventions, the fused attention agrees with ``varlen_attention`` in bfloat16, and
``LLM(device="gpu")`` gives the CPU engine's greedy tokens in float32 (the plain-ops attention)
and in bfloat16 mostly (half precision may flip near-ties).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

pytestmark = pytest.mark.skipif(
    not paddle.device.is_compiled_with_cuda(), reason="paddle has no CUDA here (never run)"
)

PROMPTS = [[1, 5, 9, 13], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20], [3] * 40]


def test_the_probe_sees_gpu_0():
    from ketch.engine.device import probe_gpus

    [info] = probe_gpus((0,))
    assert 0 < info.free <= info.total and len(info.capability) == 2


def test_the_fused_op_has_a_known_causal_alignment():
    from ketch.kernels.gpu_attention import BOTTOM_RIGHT, TOP_LEFT, GpuAttention

    paddle.set_device("gpu:0")
    attention = GpuAttention.for_dtype(4, 2, 64, "bfloat16")
    assert attention.alignment in (BOTTOM_RIGHT, TOP_LEFT)


def test_fused_attention_agrees_with_the_plain_ops_in_bfloat16():
    from ketch.kernels.gpu_attention import GpuAttention, varlen_attention

    paddle.set_device("gpu:0")
    fused = GpuAttention.for_dtype(8, 2, 64, "bfloat16")
    plain = GpuAttention(8, 2, 64, varlen_attention, "bottom_right")
    rng = np.random.default_rng(0)
    lens = [(1, 70), (33, 33), (17, 90)]  # decode, fresh prefill, chunk after a prefix
    blocks = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(lens))]
    total = sum(q for q, _ in lens)
    q, k, v = (
        paddle.to_tensor(rng.standard_normal((total, h, 64), np.float32)).astype("bfloat16")
        for h in (8, 2, 2)
    )
    outputs = []
    for attention in (fused, plain):
        cache = tuple(paddle.zeros([25 * 16, 128], dtype="bfloat16") for _ in range(2))
        meta = attention.metadata([a for a, _ in lens], [c for _, c in lens], blocks, 16, 4096)
        outputs.append(attention(q, k, v, cache, meta).astype("float32").numpy())
    np.testing.assert_allclose(outputs[0], outputs[1], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llm_on_a_gpu_gives_the_cpu_engines_greedy_tokens(checkpoint, dtype):
    from ketch.engine import LLM, SamplingParams

    path = str(checkpoint("qwen2"))
    params = SamplingParams(max_tokens=16, temperature=0)
    small = {"block_size": 16, "max_model_len": 256}
    cpu = LLM(path, kv_cache_memory="64MiB", **small).generate(PROMPTS, params)
    gpu = LLM(path, device="gpu", dtype=dtype, **small).generate(PROMPTS, params)
    same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(cpu, gpu, strict=True)]
    assert all(same) if dtype == "float32" else sum(same) >= len(same) - 1
