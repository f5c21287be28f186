"""Train Ketch's built-in "tiny-copy" model: a small Llama that learned to copy by gradient descent.

n-gram (prompt-lookup) speculative decoding only pays off when the output repeats the prompt.
The built-in "tiny" model recites its memorised corpus instead, and a random checkpoint copies
nothing. This model is trained from the standard random initialisation to answer
``<|user|>\\nRepeat the following passage:\\n{passage}<|end|>\\n<|assistant|>\\n`` with the
passage, token for token, then ``<|end|>``, for passages it has never seen. The loss plateau
that precedes induction heads breaks after ~400 steps (README.md, "Training").

Training data (generated on the fly from a seed; the loss is on the answer only):

- chat-format copy samples whose passage is a sequence of random token ids (no meaning to
  memorise: the model must copy), of random tokens from a small per-sample alphabet (repeated
  tokens, so a one-token match is ambiguous and the model must match longer contexts), of
  runs of 1-3 consecutive corpus words drawn at random (natural token statistics, no
  memorisable text), or (first stage only) a span of ``../tiny/corpus.txt``;
- several copy samples are packed into each row (separated by ``<|endoftext|>``);
- stage 1 (42 % of the steps): rows of 192 tokens, passages of 4-48 tokens, batch 24;
  stage 2: rows of 448 tokens, passages of 4-200 tokens, batch 8;
- the instruction is one of a few phrasings (``INSTRUCTIONS``), the benchmark's among them.

Nothing of ``tests/data/alice_held_back.txt`` (chapter IV) is trained on; it is used only to
report the copy accuracy at the end.

Standalone, like ``../tiny/train.py`` (needs the ``test`` extra: torch + transformers). Usage::

    python engine/ketch/engine/models/tiny_copy/train.py [--out DIR] [--steps N] [--log FILE]

It writes, into ``--out`` (default: this directory), ``config.json``,
``model.safetensors``, ``generation_config.json``, ``tokenizer.json`` (the tiny model's) and
``tokenizer_config.json``, then prints the copy accuracy on held-back passages. Fixed seeds,
one thread and deterministic algorithms: two runs on the same machine give the same weights.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
TINY = HERE.parent / "tiny"
CORPUS = TINY / "corpus.txt"
TOKENIZER = TINY / "tokenizer.json"
# Text of the same book that is not in the corpus (used only to report the copy accuracy).
HELD_BACK = HERE.parents[4] / "tests" / "data" / "alice_held_back.txt"

SEED = 4321
NUM_THREADS = 1
HIDDEN = 128
LAYERS = 3
HEADS = 4
KV_HEADS = 4
HEAD_DIM = 32
INTERMEDIATE = 256
ROPE_THETA = 10000.0
MAX_POSITIONS = 1024

DEFAULT_STEPS = 1900
BATCH_SIZE = 8
ROW_LEN = 448  # tokens per packed row
MIN_PASSAGE = 4
MAX_PASSAGE = 200  # tokens; the benchmark's passages have ~120, the tests' ~200
PEAK_LR = 2e-3
MIN_LR = 1e-4
WARMUP_STEPS = 50
WEIGHT_DECAY = 0.01

EOT_ID, USER_ID, ASSISTANT_ID, END_ID = 0, 2, 3, 4
FIRST_ORDINARY_ID = 5
INSTRUCTIONS = [
    "Repeat the following passage:\n",
    "Repeat the following passage with one word changed:\n",
    "Copy this text:\n",
    "Please repeat:\n",
]
# Passage kinds and their share of the samples, per stage of training.
FIRST_KINDS = {"random": 0.35, "alphabet": 0.2, "words": 0.2, "corpus": 0.25}
KINDS = {"random": 0.15, "alphabet": 0.25, "words": 0.6}
FIRST_STAGE = 0.42  # fraction of the steps on short passages in short rows
FIRST_BATCH_SIZE = 24
FIRST_ROW_LEN = 192
FIRST_MAX_PASSAGE = 48


class CopyData:
    """Deterministic generator of packed rows of chat-format copy samples."""

    def __init__(self, tokenizer: Tokenizer, text: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = tokenizer.get_vocab_size()
        self.newline = tokenizer.token_to_id("Ċ")
        self.instructions = [tokenizer.encode(i).ids for i in INSTRUCTIONS]
        self.corpus = tokenizer.encode(text).ids
        self.kinds = FIRST_KINDS
        self.words = text.split()
        self.tokenizer = tokenizer

    def passage(self, length: int) -> list[int]:
        rng = self.rng
        kind = rng.choices(list(self.kinds), weights=list(self.kinds.values()))[0]
        if kind == "random":
            return [rng.randrange(FIRST_ORDINARY_ID, self.vocab) for _ in range(length)]
        if kind == "alphabet":
            letters = [
                rng.randrange(FIRST_ORDINARY_ID, self.vocab) for _ in range(rng.randint(8, 64))
            ]
            return [rng.choice(letters) for _ in range(length)]
        if kind == "words":
            ids: list[int] = []
            while len(ids) < length:
                start = rng.randrange(len(self.words) - 3)
                ids += self.tokenizer.encode(
                    " " + " ".join(self.words[start : start + rng.randint(1, 3)])
                ).ids
            return ids[:length]
        start = rng.randrange(len(self.corpus) - length)
        return self.corpus[start : start + length]

    def sample(self, length: int) -> tuple[list[int], list[int]]:
        """(token ids, labels): the chat prompt, then the passage and ``<|end|>`` (the labels)."""
        passage = self.passage(length)
        instruction = self.rng.choice(self.instructions)
        prompt = [USER_ID, self.newline, *instruction, *passage, END_ID, self.newline]
        prompt += [ASSISTANT_ID, self.newline]
        answer = [*passage, END_ID]
        return [*prompt, *answer], [-100] * (len(prompt) - 1) + answer + [-100]

    def row(self, row_len: int, max_passage: int) -> tuple[list[int], list[int]]:
        ids: list[int] = [EOT_ID]
        labels: list[int] = [-100]
        while len(ids) < row_len + 1:
            length = self.rng.randint(MIN_PASSAGE, max_passage)
            sample, sample_labels = self.sample(length)
            ids += [*sample, EOT_ID]
            labels += [*sample_labels, -100]
        # labels[i] is the target at ids position i (the next token), so it lines up with ids[:-1].
        return ids[:row_len], labels[:row_len]

    def batch(self, batch_size: int, row_len: int, max_passage: int) -> tuple[torch.Tensor, ...]:
        rows = [self.row(row_len, max_passage) for _ in range(batch_size)]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


def lr_at(step: int, total: int) -> float:
    """Linear warm-up, then cosine decay from PEAK_LR to MIN_LR."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
    return MIN_LR + 0.5 * (PEAK_LR - MIN_LR) * (1.0 + math.cos(math.pi * progress))


def build_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=ROPE_THETA,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
        torch_dtype="float32",
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).float()


def copy_prompt(passage: str) -> str:
    return f"<|user|>\n{INSTRUCTIONS[0]}{passage}<|end|>\n<|assistant|>\n"


@torch.no_grad()
def greedy_copy(model: LlamaForCausalLM, tokenizer: Tokenizer, passage: str) -> list[int]:
    """The greedy answer (up to ``<|end|>``, excluded) to the copy prompt for ``passage``."""
    prompt = torch.tensor([tokenizer.encode(copy_prompt(passage)).ids])
    want = len(tokenizer.encode(passage).ids)
    out = model.generate(
        prompt, max_new_tokens=want + 16, do_sample=False, eos_token_id=END_ID, pad_token_id=0
    )
    return [t for t in out[0, prompt.shape[1] :].tolist() if t != END_ID]


def held_back_passages(count: int = 20, words: int = 110) -> list[str]:
    """``count`` windows of ``words`` words of the held-back text (never trained on)."""
    text = HELD_BACK.read_text(encoding="utf-8").split()
    stride = max(1, (len(text) - words) // max(1, count - 1))
    return [" ".join(text[i * stride : i * stride + words]) for i in range(count)]


def report_copy(model: LlamaForCausalLM, tokenizer: Tokenizer, passages: list[str]) -> float:
    """Print, per passage, its tokens copied in place (output token i is passage token i), the
    length of the exactly copied start, and the SequenceMatcher ratio; return the in-place
    fraction over all passages."""
    model.eval()
    right = total = exact = 0
    for passage in passages:
        want = tokenizer.encode(passage).ids
        got = greedy_copy(model, tokenizer, passage)
        same = [a == b for a, b in zip(got, want, strict=False)]
        start = same.index(False) if False in same else len(same)
        ratio = difflib.SequenceMatcher(a=got, b=want, autojunk=False).ratio()
        exact += got == want
        right += sum(same)
        total += len(want)
        print(
            f"  {len(want)} tokens: {sum(same)} in place, first {start} exact, "
            f"{len(got)} output, ratio {ratio:.3f}"
        )
    model.train()
    print(f"copied {right}/{total} tokens in place ({right / total:.1%}); {exact} exact passages")
    return right / total


def tokenizer_config() -> dict[str, Any]:
    config = json.loads((TINY / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["model_max_length"] = MAX_POSITIONS
    return config


def train(model: LlamaForCausalLM, data: CopyData, steps: int) -> None:
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
    started = time.perf_counter()
    running, count = 0.0, 0
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps)
        if step < FIRST_STAGE * steps:
            inputs, labels = data.batch(FIRST_BATCH_SIZE, FIRST_ROW_LEN, FIRST_MAX_PASSAGE)
        else:
            data.kinds = KINDS
            inputs, labels = data.batch(BATCH_SIZE, ROW_LEN, MAX_PASSAGE)
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += loss.item()
        count += 1
        if (step + 1) % 20 == 0 or step + 1 == steps:
            print(
                f"step {step + 1}/{steps} loss {running / count:.4f} "
                f"lr {lr_at(step, steps):.2e} {time.perf_counter() - started:.0f}s",
                flush=True,
            )
            running, count = 0.0, 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output directory")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    parser.add_argument("--log", type=Path, help="also write the progress to this file")
    args = parser.parse_args()
    if args.log:
        sys.stdout = open(args.log, "w", buffering=1, encoding="utf-8")  # noqa: SIM115
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    data = CopyData(tokenizer, CORPUS.read_text(encoding="utf-8"), SEED)
    model = build_model()
    model.train()
    print(f"params={sum(p.numel() for p in model.parameters())}", flush=True)
    started = time.perf_counter()
    train(model, data, args.steps)
    print(f"training time {time.perf_counter() - started:.1f}s", flush=True)

    model.generation_config = GenerationConfig(
        bos_token_id=EOT_ID, eos_token_id=[EOT_ID, END_ID], pad_token_id=EOT_ID, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)
    shutil.copyfile(TOKENIZER, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8"
    )
    print(f"saved to {out}")
    report_copy(model, tokenizer, held_back_passages())


if __name__ == "__main__":
    main()
