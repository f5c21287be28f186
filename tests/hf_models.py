"""Makes small random Hugging Face checkpoints (via transformers) for tests, and runs the oracle."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "To be, or not to be, that is the question.",
    "All that glitters is not gold; all who wander are not lost.",
    "0123456789 +-*/ = () [] {} <> !? ,.;:'\"",
]

_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tokenizer(out: Path, vocab_size: int = 300) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TEXT * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|endoftext|>",
                "bos_token": "<|endoftext|>",
                "chat_template": _CHAT_TEMPLATE,
            }
        )
    )


def make_checkpoint(
    out: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: str | None = None,
    **overrides: Any,
) -> Path:
    """Writes a randomly initialised Llama, Qwen2, Qwen3 or Qwen3-MoE checkpoint with GQA to
    ``out``; ``dtype`` (a torch dtype name, e.g. "bfloat16") casts the weights before saving
    (float32 otherwise)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    settings: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=0,
        bos_token_id=0,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    return _save_random(model_cls(config_cls(**settings)), out, max_shard_size, dtype)


SMALL: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    eos_token_id=0,
    bos_token_id=0,
)
"""The sizes every architecture's test checkpoints start from (each test's shapes override)."""


def make_random_checkpoint(out: Path, config: Any, seed: int = 0) -> Path:
    """A random checkpoint of ``config`` (a transformers config object naming its architecture),
    initialised as ``make_checkpoint``'s: matrices widened to std 0.15, every 1-D weight (norms,
    q_norm/k_norm, biases) given noise."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return _save_random(AutoModelForCausalLM.from_config(config), out)


def make_small_checkpoint(
    out: Path, config_class: str, seed: int = 0, architectures: list[str] | None = None, **overrides
) -> Path:
    """A random checkpoint of transformers' ``config_class`` (e.g. "Qwen3Config") with ``SMALL``
    sizes under ``overrides``; ``architectures`` names the model class where the config's
    default would not (Gemma 3's text config)."""
    import transformers

    config = getattr(transformers, config_class)(**{**SMALL, **overrides})
    if architectures is not None:
        config.architectures = architectures
    return make_random_checkpoint(out, config, seed)


def shape_cache(
    tmp_path_factory: Any, prefix: str, make: Callable[[Path, str], Path]
) -> Callable[[str], Path]:
    """get(shape) -> the checkpoint ``make(directory, shape)`` wrote, made once per cache (a
    module-scoped fixture returns one)."""
    made: dict[str, Path] = {}

    def get(shape: str) -> Path:
        if shape not in made:
            made[shape] = make(
                tmp_path_factory.mktemp(f"{prefix}_{shape.replace('-', '_')}"), shape
            )
        return made[shape]

    return get


def _save_random(
    model: Any, out: Path, max_shard_size: str | None = None, dtype: str | None = None
) -> Path:
    """Random init is near-degenerate (std 0.02): widened so logits have real structure; then
    cast to ``dtype`` where given and saved with a tokenizer."""
    import torch

    model.eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
            else:  # norm weights (ones) and biases (zeros) get noise too
                param.add_(torch.randn_like(param) * 0.1)
    if dtype is not None:
        model.to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    make_tokenizer(out)
    return out


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference greedy continuations from transformers' ``generate``, one prompt at a time
    (no padding, so nothing but the model itself decides the tokens); EOS is ignored."""
    return greedy_of(hf_model(path), prompts, max_new_tokens)


def greedy_of(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """``hf_greedy`` for a transformers model already loaded (and perhaps changed)."""
    import torch

    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            results.append(out[0, len(prompt) :].tolist())
    return results
