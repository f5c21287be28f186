"""Below float32 on the CPU: bfloat16 weights and KV cache, int8 weights — accuracy, measured.

What is compared, and against what:

- perplexity of the built-in tiny model on Alice text it was never trained on
  (``tests/data/alice_held_back.txt``) in float32, bfloat16 (weights and KV cache) and int8
  (linear layers), within 1% (bfloat16) and 3% (int8) of float32;
- teacher-forced top-1 agreement with transformers in float32, on the trained tiny model (at
  least 99% for bfloat16, 97% for int8); on random checkpoints of several architectures, logits
  equal to transformers' computing in float32 on the weights Ketch multiplies by (the 99% target
  does not hold there for any bfloat16 computation: see
  ``test_random_checkpoints_against_transformers``);
- greedy decoding equal, token for token, to transformers computing the same way: float32
  arithmetic on the weights Ketch multiplies by (rounded to bfloat16, or int8 times the
  per-channel scale). transformers run in bfloat16 itself computes differently: it rounds every
  activation (each matmul's output, the residual stream) to bfloat16, where Ketch keeps
  activations and sums in float32 and only the weights (and the KV cache) are 16-bit, so its
  greedy tokens may part from Ketch's (on the tiny model's held-back text its top-1 agrees with
  float32 at 99.1%, Ketch's bfloat16 at 99.6%).

The engine's logits come from the native backend (the only one that runs below float32) in
batched two-chunk steps over the paged KV cache, as the other model tests compute them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import paddle
import pytest
import torch
from test_qwen3_moe import make_qwen3_moe_checkpoint
from tp_harness import BLOCK, chunked_logits, num_blocks_for

from hf_models import greedy_of, hf_model, make_small_checkpoint, shape_cache
from ketch.engine.llm import LLM
from ketch.engine.models.backend import build_model
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.loader import TINY_MODEL_DIR, load_weights
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.tokenizer import Tokenizer
from ketch.engine.worker.kv_cache import KVCache
from ketch.engine.worker.model_runner import configure_paddle
from ketch.kernels.packed_linear import dequantize_int8, quantize_int8, round_to_bfloat16

HELD_BACK = Path(__file__).parent.parent / "data" / "alice_held_back.txt"
CORPUS = TINY_MODEL_DIR / "corpus.txt"  # what the tiny model was trained on
WINDOW = 200  # tokens per perplexity window (the tiny model has 512 positions)

# (name, weights' dtype, quantization, KV cache dtype): what `ketch serve` runs with
# --dtype D --quantization Q (the KV cache follows --dtype).
PRECISIONS = {
    "float32": ("float32", "none", "float32"),
    "bfloat16": ("bfloat16", "none", "bfloat16"),
    "int8": ("float32", "int8", "float32"),
    "int8-bf16": ("bfloat16", "int8", "bfloat16"),
}


def engine_logits(
    path: Path, sequences: list[list[int]], precision: str, kv: str | None = None
) -> list[np.ndarray]:
    """float32 logits at every position of every sequence, on the native backend at
    ``precision`` (``kv`` overrides its KV cache dtype)."""
    dtype, quantization, kv_dtype = PRECISIONS[precision]
    threads = configure_paddle(None)
    config = ModelConfig.from_dir(path)
    weights = load_weights(path, config, dtype, small_dtype="float32")
    model = build_model(
        "native", config, weights, 1024, threads, dtype=dtype, quantization=quantization
    )
    cache = KVCache(
        config.num_hidden_layers,
        num_blocks_for(sequences),
        BLOCK,
        config.num_key_value_heads,
        config.head_dim,
        kv or kv_dtype,
    )
    splits = [max(1, len(s) // 3) for s in sequences]
    return chunked_logits(model, cache, sequences, splits)


def mean_nll(logits: list[np.ndarray], sequences: list[list[int]]) -> float:
    """Mean next-token negative log-likelihood over every position that has a next token."""
    total, count = 0.0, 0
    for scores, seq in zip(logits, sequences, strict=True):
        scores = scores[:-1].astype(np.float64)
        peak = scores.max(axis=-1, keepdims=True)
        log_z = peak[:, 0] + np.log(np.exp(scores - peak).sum(axis=-1))
        picked = scores[np.arange(len(seq) - 1), seq[1:]]
        total += float((log_z - picked).sum())
        count += len(seq) - 1
    return total / count


def windows(text: str) -> list[list[int]]:
    ids = Tokenizer(TINY_MODEL_DIR).encode(text)
    return [ids[i : i + WINDOW] for i in range(0, len(ids) - 1, WINDOW) if len(ids[i:]) > 1]


@pytest.fixture(scope="module")
def held_back() -> list[list[int]]:
    return windows(HELD_BACK.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def perplexity(held_back) -> Callable[[str], float]:
    made: dict[str, float] = {}

    def get(precision: str) -> float:
        if precision not in made:
            logits = engine_logits(TINY_MODEL_DIR, held_back, precision)
            made[precision] = math.exp(mean_nll(logits, held_back))
        return made[precision]

    return get


def test_the_held_back_text_is_unseen(held_back, perplexity):
    """The measurement means something: the tiny model has memorised its corpus (perplexity
    near 1) and has not seen the held-back text (perplexity far above it)."""
    seen = windows(CORPUS.read_text(encoding="utf-8")[:4000])
    trained = math.exp(mean_nll(engine_logits(TINY_MODEL_DIR, seen, "float32"), seen))
    assert trained < 1.5
    assert perplexity("float32") > 4 * trained
    assert sum(len(w) for w in held_back) > 500


@pytest.mark.parametrize(
    ("precision", "within"), [("bfloat16", 0.01), ("int8", 0.03), ("int8-bf16", 0.03)]
)
def test_perplexity_on_held_back_text(perplexity, precision, within):
    base, low = perplexity("float32"), perplexity(precision)
    assert abs(low / base - 1) <= within, f"{precision} {low:.4f} vs float32 {base:.4f}"
    assert low != base  # the weights really are below float32


# ------------------------------------------------------------------- random checkpoints


CHECKPOINTS: dict[str, Callable[[Path, int], Path]] = {
    "llama": lambda out, seed: make_small_checkpoint(
        out, "LlamaConfig", seed, num_key_value_heads=2, hidden_size=128, intermediate_size=256
    ),
    "qwen3": lambda out, seed: make_small_checkpoint(
        out, "Qwen3Config", seed, num_key_value_heads=2, head_dim=32
    ),
    "qwen3-moe": lambda out, seed: make_qwen3_moe_checkpoint(out, seed),
    "gemma3": lambda out, seed: make_small_checkpoint(
        out,
        "Gemma3TextConfig",
        seed,
        architectures=["Gemma3ForCausalLM"],
        pad_token_id=0,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=16,
    ),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    return shape_cache(tmp_path_factory, "lowp", lambda out, name: CHECKPOINTS[name](out, 1))


def random_sequences(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in (40, 97, 160)]


def hf_logits(model, sequences: list[list[int]]) -> list[np.ndarray]:
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].float().numpy() for s in sequences]


def agreement(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, theirs, strict=True))
    return same / sum(len(a) for a in ours)


def test_top1_agreement_with_transformers_in_float32(held_back):
    """The trained tiny model, teacher-forced over held-back and training text: the top-1
    token at bfloat16 (weights and KV cache) and int8 against transformers in float32."""
    seen = windows(CORPUS.read_text(encoding="utf-8")[:4000])
    sequences = held_back + seen
    theirs = hf_logits(hf_model(TINY_MODEL_DIR), sequences)
    assert agreement(engine_logits(TINY_MODEL_DIR, sequences, "float32"), theirs) == 1.0
    for precision, floor in (("bfloat16", 0.99), ("int8", 0.97), ("int8-bf16", 0.97)):
        agreed = agreement(engine_logits(TINY_MODEL_DIR, sequences, precision), theirs)
        assert agreed >= floor, f"{precision}: top-1 agrees at {agreed:.4f}"


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_random_checkpoints_against_transformers(checkpoint, name, precision):
    """On random checkpoints (matrices of std 0.15: a chaotic network whose top-1 margins are
    small) rounding the weights alone moves the top-1 token at a few percent of positions:
    float32 arithmetic on the bfloat16-rounded matrices agrees with float32 at 96.0% (llama),
    98.0% (qwen3), 97.6% (qwen3-moe), 100% (gemma3), transformers' own bfloat16 run at 95.6%,
    96.0%, 94.6%, 99.7% (docs/precision.md). So what is held here is that Ketch computes exactly
    the former (float32 arithmetic on the weights it multiplies by: logits within 1e-4, the same
    top-1 tokens), and that its agreement with float32 is no worse than transformers' own
    bfloat16 run (which also rounds every activation)."""
    path = checkpoint(name)
    sequences = random_sequences(ModelConfig.from_dir(path).vocab_size)
    ours = engine_logits(path, sequences, precision, kv="float32")
    same = hf_logits(_as_ketch_multiplies(hf_model(path), precision), sequences)
    for a, b in zip(ours, same, strict=True):
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    assert agreement(ours, same) >= 0.995
    fp32 = hf_logits(hf_model(path), sequences)
    assert agreement(engine_logits(path, sequences, "float32"), fp32) == 1.0
    if precision == "bfloat16":
        theirs = agreement(hf_logits(hf_model(path).to(torch.bfloat16), sequences), fp32)
        slack = 1 / sum(len(s) for s in sequences)  # one near-tie position, on another CPU
        assert agreement(ours, fp32) + slack >= theirs


# ------------------------------------------------------- transformers computing the same way


def _as_ketch_multiplies(model, precision: str):
    """``model`` (transformers, float32) with every weight replaced by what Ketch multiplies
    by at ``precision``: bfloat16-rounded (every matrix but a MoE router), or int8 times its
    per-output-channel scale (the linear layers; the embedding and lm_head stay float32)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 or name.endswith("mlp.gate.weight"):
                continue  # norms, biases and MoE routers stay float32 in Ketch
            if precision != "bfloat16" and ("embed" in name or "lm_head" in name):
                continue  # not quantized
            # A matrix, or a stack of experts' matrices ([E, out, in]), each as Ketch's [in, out]
            for matrix in param if param.dim() == 3 else [param]:
                w = paddle.to_tensor(matrix.detach().numpy().T.copy())
                if precision == "bfloat16":
                    new = round_to_bfloat16(w).astype("float32")
                else:
                    new = dequantize_int8(*quantize_int8(w))
                matrix.copy_(torch.from_numpy(new.numpy().T.copy()))
    return model


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(("precision", "dtype", "quantization"), [
    ("bfloat16", "bfloat16", "none"), ("int8", "float32", "int8"),
])  # fmt: skip
def test_greedy_equals_transformers_on_the_same_weights(precision, dtype, quantization):
    """The KV cache in float32 here: the weights alone are what differs from float32."""
    tokenizer = Tokenizer(TINY_MODEL_DIR)
    prompts = [
        tokenizer.encode("Alice was beginning to get very tired"),
        tokenizer.encode("“Why, Mary Ann, what are you doing out here?"),
        tokenizer.encode("The Rabbit"),
    ]
    reference = greedy_of(_as_ketch_multiplies(hf_model(TINY_MODEL_DIR), precision), prompts, 48)
    llm = LLM(
        "tiny",
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype="float32",
        kv_cache_memory="16MiB",
    )
    assert greedy(llm, prompts, 48) == reference
