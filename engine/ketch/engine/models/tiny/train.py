"""Train Ketch's built-in "tiny" model from ``corpus.txt`` (next to this script).

The tiny model is a ~0.9M-parameter Llama-architecture causal LM with a 1024-entry byte-level
BPE tokenizer. It is trained, deterministically and on CPU in a few minutes, until it has
largely memorised the corpus (the first three chapters of *Alice's Adventures in Wonderland*),
so that tests and demos can check that greedy generation reproduces recognisable text.

This is a standalone script, not part of the engine: it needs the ``test`` extra
(``pip install -e '.[test]'``, i.e. torch + transformers). Usage::

    python engine/models/tiny/train.py [--out DIR] [--steps N]

It writes, into ``--out`` (default: this directory), ``config.json``, ``model.safetensors``,
``generation_config.json`` (via ``save_pretrained``), ``tokenizer.json`` and
``tokenizer_config.json``. Running it twice with the same arguments on the same machine
produces byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.txt"

SEED = 1234
NUM_THREADS = 2
VOCAB_SIZE = 1024
SEQ_LEN = 128
BATCH_SIZE = 16
CHAT_FRACTION = 0.25
DEFAULT_STEPS = 1500
PEAK_LR = 3e-3
MIN_LR = 1e-4
WARMUP_STEPS = 100
WEIGHT_DECAY = 0.01

EOT = "<|endoftext|>"
SPECIAL_TOKENS = [EOT, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
END = "<|end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

SYSTEM_PROMPTS = [
    None,
    "You are a helpful assistant.",
    "You are a storyteller who knows Alice's Adventures in Wonderland by heart.",
]
USER_PROMPTS = [
    "Tell me a story.",
    "Recite a passage from Alice's Adventures in Wonderland.",
    "What happened to Alice?",
    "Continue the story.",
]


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Python twin of ``CHAT_TEMPLATE`` (used to build training samples)."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def train_tokenizer(text: str) -> Tokenizer:
    """Byte-level BPE: every string round-trips through encode/decode."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer=trainer)
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(tok) == i, (tok, tokenizer.token_to_id(tok))
    return tokenizer


def chat_samples(tokenizer: Tokenizer, text: str, max_len: int) -> list[list[int]]:
    """All chat-format samples: (system,) user, then an assistant turn quoting one paragraph.

    Paragraphs too long for ``max_len`` tokens are cut at a line boundary.
    """
    eot = tokenizer.token_to_id(EOT)
    paragraphs = [p.strip("\n") for p in text.split("\n\n") if p.strip()]
    samples: list[list[int]] = []
    for i, para in enumerate(paragraphs):
        system = SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)]
        user = USER_PROMPTS[i % len(USER_PROMPTS)]
        lines = para.split("\n")
        while lines:
            messages = [{"role": "system", "content": system}] if system else []
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": "\n".join(lines)},
            ]
            ids = [*tokenizer.encode(render_chat(messages)).ids, eot]
            if len(ids) <= max_len:
                samples.append(ids)
                break
            lines = lines[:-1]
    return samples


def make_batch(
    rng: random.Random, stream: list[int], chats: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of SEQ_LEN+1 windows: corpus windows, plus a fraction of chat samples."""
    rows: list[list[int]] = []
    labels: list[list[int]] = []
    for _ in range(BATCH_SIZE):
        if rng.random() < CHAT_FRACTION:
            ids = chats[rng.randrange(len(chats))]
            pad = SEQ_LEN + 1 - len(ids)
            rows.append(ids + [pad_id] * pad)
            labels.append(ids + [-100] * pad)
        else:
            start = rng.randrange(len(stream) - SEQ_LEN)
            window = stream[start : start + SEQ_LEN + 1]
            rows.append(window)
            labels.append(window)
    return torch.tensor(rows)[:, :-1], torch.tensor(labels)[:, 1:]


def lr_at(step: int, total: int) -> float:
    """Linear warm-up, then cosine decay from PEAK_LR to MIN_LR."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
    return MIN_LR + 0.5 * (PEAK_LR - MIN_LR) * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def corpus_loss(model: LlamaForCausalLM, stream: list[int]) -> float:
    """Mean next-token loss over the whole corpus in consecutive SEQ_LEN windows."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(stream) - 1, SEQ_LEN):
        window = torch.tensor([stream[start : start + SEQ_LEN + 1]])
        logits = model(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum")
        total += loss.item()
        count += window.shape[1] - 1
    model.train()
    return total / count


def tokenizer_config(eot: str) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eot,
        "eos_token": eot,
        "pad_token": eot,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output directory")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)

    text = CORPUS.read_text(encoding="utf-8")
    tokenizer = train_tokenizer(text)
    eot_id = tokenizer.token_to_id(EOT)
    end_id = tokenizer.token_to_id(END)
    stream = [eot_id, *tokenizer.encode(text).ids, eot_id]
    chats = chat_samples(tokenizer, text, SEQ_LEN + 1)
    print(
        f"vocab={tokenizer.get_vocab_size()} corpus_tokens={len(stream)} chat_samples={len(chats)}"
    )

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        torch_dtype="float32",
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).float()
    model.train()
    print(f"params={sum(p.numel() for p in model.parameters())}")

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
        foreach=False,
    )
    rng = random.Random(SEED)
    started = time.perf_counter()
    running = 0.0
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps)
        inputs, labels = make_batch(rng, stream, chats, eot_id)
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += loss.item()
        if (step + 1) % 100 == 0 or step + 1 == args.steps:
            n = (step % 100) + 1
            print(
                f"step {step + 1}/{args.steps} loss {running / n:.4f} "
                f"lr {lr_at(step, args.steps):.2e} {time.perf_counter() - started:.0f}s",
                flush=True,
            )
            running = 0.0
    elapsed = time.perf_counter() - started
    print(f"training time {elapsed:.1f}s; corpus loss {corpus_loss(model, stream):.4f}")

    model.generation_config = GenerationConfig(
        bos_token_id=eot_id,
        eos_token_id=[eot_id, end_id],
        pad_token_id=eot_id,
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(EOT), indent=2) + "\n", encoding="utf-8"
    )
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
