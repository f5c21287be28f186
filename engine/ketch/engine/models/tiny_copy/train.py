"""Build Ketch's built-in "tiny-copy" model: a small Llama whose weights implement copying.

n-gram (prompt-lookup) speculative decoding only pays off when the output repeats the prompt.
The built-in "tiny" model recites its memorised corpus instead, and a random checkpoint copies
nothing. This model continues text by copying from its context: after
``<|user|>\\nRepeat the following passage:\\n{passage}<|end|>\\n<|assistant|>\\n`` its greedy output
is the passage, token for token, until the passage repeats a run of 4 tokens (then it may jump
or loop: see README.md), and then ``<|end|>``.

Despite the file's name (kept parallel to ``../tiny/train.py``) nothing here is learned by
gradient descent: a first trial (1500-2500 AdamW steps of 1-2K tokens) stayed on the loss
plateau that precedes induction heads; ``train_gd.py`` gets past it, but its model copies long
natural-text passages less reliably than these weights (README.md, "Training by gradient
descent"). The weights are instead set by hand, deterministically from a seed:

- Residual stream (hidden 256): dimension 0 holds a constant; five blocks of 50 dimensions hold
  the identity vector of the current token and, after layer 0, of the 1st-4th previous tokens.
  Each token's 50-dim identity vector is random (seeded), made of 4 groups of 12 coordinates
  of equal norm (2 spare coordinates are 0).
- Layer 0: 4 purely positional attention heads read the constant dimension; their query/key
  rotary pairs of the highest frequencies are set so that, after RoPE, head h attends to the
  token h positions back (sharply: rope_theta 1e14 leaves enough high-frequency pairs). Each
  copies that token's identity into its block.
- Layer 1: 2 induction heads. Their query is (current, prev1, prev2, prev3) identities, their key
  (prev1, prev2, prev3, prev4): the score peaks at the earlier position whose 4 predecessors are
  the last 4 tokens; they copy that position's identity, amplified, into the current-token block.
  Only the RoPE pairs of the lowest frequencies (almost unrotated over 600 positions) carry it.
- The output embedding is tied to the input one, so the logits favour the copied token.
- Layers 2-3, the MLPs and the remaining heads are zero (residual pass-through).
- To start the copy, ``<|assistant|>`` shares the identity groups that the key's "prev1" term
  reads with ``:`` (the token before the passage's ``\\n`` in the instruction).

This is a standalone script, not part of the engine: it needs the ``test`` extra
(``pip install -e '.[test]'``, i.e. torch + transformers). Usage::

    python engine/ketch/engine/models/tiny_copy/train.py [--out DIR]

It writes, into ``--out`` (default: this directory), ``config.json``, ``model.safetensors``,
``generation_config.json`` (via ``save_pretrained``), ``tokenizer.json`` (the tiny model's) and
``tokenizer_config.json``, then prints the copy accuracy on held-out passages. Running it twice
produces byte-identical files.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import random
import shutil
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
HELD_OUT = HERE.parents[4] / "tests" / "data" / "alice_held_back.txt"

SEED = 4321
HIDDEN = 256
HEAD_DIM = 64
ROPE_THETA = 1e14
MAX_POSITIONS = 1024
ID_DIM = 50  # dimensions of a token's identity vector
GROUP = 12  # coordinates per group; a match compares one group per term
TERMS = 4  # the n of the n-gram match: current token + 3 previous ones
POSITIONAL_PAIRS = 6  # highest-frequency rotary pairs used by the positional heads
POSITIONAL_SCALE = 300.0  # their query-key product per pair (sharpness of attention)
MATCH_GAIN = 25.0  # query and key scale of the induction heads
COPY_GAIN = 10.0  # how much the copied identity outweighs the current token's own
STATIC_ANGLE = 0.25  # a rotary pair is "static" if it turns less than this over 600 positions
# For each induction head (one per KV head): which identity group each match term compares.
GROUP_ORDER = [[0, 1, 2, 3], [2, 3, 0, 1]]

EOT = "<|endoftext|>"
END = "<|end|>"
SPECIAL_TOKENS = [EOT, "<|system|>", "<|user|>", "<|assistant|>", END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
INSTRUCTION = "Repeat the following passage:\n"


def copy_prompt(passage: str) -> str:
    """The chat prompt asking for ``passage`` back (Python twin of the chat template)."""
    return f"<|user|>\n{INSTRUCTION}{passage}<|end|>\n<|assistant|>\n"


def identity_vectors(tokenizer: Tokenizer) -> torch.Tensor:
    """A (vocab, ID_DIM) matrix: per token, TERMS groups of GROUP random coordinates, each group
    of norm 1/sqrt(TERMS), so a full n-gram match scores exactly 1."""
    vocab = tokenizer.get_vocab_size()
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.zeros(vocab, ID_DIM, dtype=torch.float64)
    for g in range(TERMS):
        block = torch.randn(vocab, GROUP, generator=generator, dtype=torch.float64)
        ids[:, g * GROUP : (g + 1) * GROUP] = block / block.norm(dim=1, keepdim=True)
    ids /= math.sqrt(TERMS)
    colon, assistant = tokenizer.token_to_id(":"), tokenizer.token_to_id("<|assistant|>")
    for order in GROUP_ORDER:
        group = slice(order[1] * GROUP, (order[1] + 1) * GROUP)
        ids[assistant, group] = ids[colon, group]
    return ids


def build_model(tokenizer: Tokenizer) -> LlamaForCausalLM:
    eot_id = tokenizer.token_to_id(EOT)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=ROPE_THETA,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        torch_dtype="float32",
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).float()
    half = HEAD_DIM // 2
    theta = [ROPE_THETA ** (-2 * i / HEAD_DIM) for i in range(half)]
    block = [1 + ID_DIM * k for k in range(TERMS + 1)]  # current, prev1 .. prev4
    const = 1.0
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        embed[:, 0] = const
        embed[:, block[0] : block[0] + ID_DIM] = identity_vectors(tokenizer).float()

        # Layer 0: head h attends h+1 positions back (kv head 0 keys are turned by one
        # position, kv head 1 by two; heads 1 and 3 turn their queries back two more).
        rms0 = math.sqrt((const**2 + 1.0) / HIDDEN)  # every embedding has the same norm
        normed_const = const / rms0
        attn = model.model.layers[0].self_attn
        heads = ((0, 1, 0, 0, block[1]), (0, 1, 1, 2, block[3]))
        heads += ((1, 2, 2, 0, block[2]), (1, 2, 3, 2, block[4]))
        for kv, key_shift, head, query_shift, out in heads:
            amp = math.sqrt(POSITIONAL_SCALE) / normed_const
            for i in range(POSITIONAL_PAIRS):
                attn.q_proj.weight[head * HEAD_DIM + i, 0] = amp * math.cos(query_shift * theta[i])
                attn.q_proj.weight[head * HEAD_DIM + i + half, 0] = -amp * math.sin(
                    query_shift * theta[i]
                )
                attn.k_proj.weight[kv * HEAD_DIM + i, 0] = amp * math.cos(key_shift * theta[i])
                attn.k_proj.weight[kv * HEAD_DIM + i + half, 0] = amp * math.sin(
                    key_shift * theta[i]
                )
            for r in range(ID_DIM):
                attn.v_proj.weight[kv * HEAD_DIM + r, block[0] + r] = rms0
                attn.o_proj.weight[out + r, head * HEAD_DIM + r] = 1.0

        # Layer 1: induction heads 0 and 2 (one per kv head), on the static rotary pairs.
        rms1 = math.sqrt((const**2 + TERMS + 1.0) / HIDDEN)
        attn = model.model.layers[1].self_attn
        static = [i for i in range(half) if theta[i] * 600 < STATIC_ANGLE]
        dims = static + [i + half for i in static]
        assert len(dims) >= TERMS * GROUP, len(dims)
        for kv, head in ((0, 0), (1, 2)):
            slot = 0
            for term in range(TERMS):
                group = GROUP_ORDER[kv][term]
                for j in range(group * GROUP, (group + 1) * GROUP):
                    d = dims[slot]
                    slot += 1
                    attn.q_proj.weight[head * HEAD_DIM + d, block[term] + j] = MATCH_GAIN * rms1
                    attn.k_proj.weight[kv * HEAD_DIM + d, block[term + 1] + j] = MATCH_GAIN * rms1
            for r in range(ID_DIM):
                attn.v_proj.weight[kv * HEAD_DIM + r, block[0] + r] = rms1
                attn.o_proj.weight[block[0] + r, head * HEAD_DIM + r] = COPY_GAIN / 2
    return model


@torch.no_grad()
def copy_accuracy(model: LlamaForCausalLM, tokenizer: Tokenizer, passage: str) -> dict[str, float]:
    """Greedy output for the chat copy prompt of ``passage``, compared with the passage."""
    want = tokenizer.encode(passage).ids
    prompt = tokenizer.encode(copy_prompt(passage)).ids
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=len(want) + 8,
        do_sample=False,
        eos_token_id=[tokenizer.token_to_id(EOT), tokenizer.token_to_id(END)],
        pad_token_id=tokenizer.token_to_id(EOT),
    )[0, len(prompt) :].tolist()
    if out and out[-1] == tokenizer.token_to_id(END):
        out = out[:-1]
    prefix = next(
        (i for i, (a, b) in enumerate(zip(out, want, strict=False)) if a != b),
        min(len(out), len(want)),
    )
    matcher = difflib.SequenceMatcher(a=out, b=want, autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks())
    return {
        "passage_tokens": len(want),
        "output_tokens": len(out),
        "exact_prefix_tokens": prefix,
        "matched_fraction": round(matched / len(want), 3),
        "ratio": round(matcher.ratio(), 3),
    }


def eval_passages() -> dict[str, str]:
    """Passages the model has never seen: held-out Alice text (when the repository's test data
    is there) and a shuffle of corpus words."""
    found: dict[str, str] = {}
    if HELD_OUT.exists():
        words = HELD_OUT.read_text(encoding="utf-8").split()
        for start in (0, 110):
            found[f"held-out Alice, words {start}-{start + 110}"] = " ".join(
                words[start : start + 110]
            )
    corpus_words = CORPUS.read_text(encoding="utf-8").split()
    rng = random.Random(SEED)
    found["120 shuffled corpus words"] = " ".join(rng.choice(corpus_words) for _ in range(120))
    return found


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output directory")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(tok) == i, (tok, tokenizer.token_to_id(tok))
    eot_id, end_id = tokenizer.token_to_id(EOT), tokenizer.token_to_id(END)
    model = build_model(tokenizer).eval()
    print(f"params={sum(p.numel() for p in model.parameters())}")
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id,
        eos_token_id=[eot_id, end_id],
        pad_token_id=eot_id,
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    if out.resolve() != TINY.resolve():
        shutil.copyfile(TOKENIZER, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8"
    )
    print(f"saved to {out}")
    for name, passage in eval_passages().items():
        print(f"copy accuracy, {name}: {copy_accuracy(model, tokenizer, passage)}")


if __name__ == "__main__":
    main()
