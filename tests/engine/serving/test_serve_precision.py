"""``ketch serve --dtype bfloat16`` and ``--quantization int8`` (issue 30): a real server and the
openai client; /metrics and the startup log state the precision and the bytes of weights.

Each server's greedy completions equal the offline engine's at the same precision (the model
that computes them is the same code; what this checks is that the flags reach the worker and
the KV cache), and the weights' bytes shrink as the precision says: bfloat16 halves every
matrix, int8 quarters the linear layers (the tiny model's embedding and lm_head, 2 x 1024 x 128,
stay at --dtype)."""

from __future__ import annotations

import openai
import pytest
from serve_harness import KV_MEMORY, metric, running_server, scrape

from ketch.engine import LLM, SamplingParams

PROMPTS = ["Alice was beginning to get very tired", "“Why, Mary Ann,", "The Rabbit"]
TINY_PARAMS = 918_656  # engine/ketch/engine/models/tiny/README.md (lm_head tied)
EMBED = 1024 * 128


@pytest.mark.parametrize(
    ("args", "dtype", "quantization", "kv"),
    [
        (("--dtype", "bfloat16"), "bfloat16", "none", "bfloat16"),
        (("--quantization", "int8"), "float32", "int8", "float32"),
        (("--dtype", "bfloat16", "--quantization", "int8"), "bfloat16", "int8", "bfloat16"),
    ],
    ids=["bf16", "int8", "int8-bf16"],
)
def test_serves_below_float32(args, dtype, quantization, kv):
    offline = LLM("tiny", block_size=16, kv_cache_memory=KV_MEMORY, dtype=dtype,
                  quantization=quantization)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    with running_server(*args) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        got = [
            client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0)
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert got == expected
        labels = {"dtype": dtype, "quantization": quantization, "kv_cache_dtype": kv}
        weight_bytes = metric(scrape(server.url), "model_weight_bytes", **labels)
        log = server.log()
    # The tiny model's matrices (its embedding twice: the lm_head is packed as a copy), at the
    # precision asked; the norms stay float32 (9 x 128 floats); int8 adds a scale per column.
    matrices = TINY_PARAMS - 9 * 128 + EMBED
    linear = matrices - 2 * EMBED
    width = {"float32": 4, "bfloat16": 2}[dtype]
    int8 = quantization == "int8"
    expected_bytes = 2 * EMBED * width + linear if int8 else matrices * width
    # Packed panels are padded to the micro-kernel's width, scales add 4 bytes a column.
    assert expected_bytes <= weight_bytes <= 1.1 * expected_bytes
    assert f"{dtype} weights" in log and f"{kv} KV cache" in log
    if quantization == "int8":
        assert "int8 linear layers" in log


def test_float16_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="float16 is not a CPU weight dtype"):
        LLM("tiny", dtype="float16")
