"""Reasoning output against a real ``ketch serve`` on a Qwen3 checkpoint, with the openai client.

The checkpoint is a Qwen3 whose greedy output is known: its layers add nothing (``o_proj`` and
``down_proj`` are zero), so the last hidden state is the last token's embedding, and its
``lm_head`` maps each token of a chain to the next one. After the generation prompt's ``\\n``
it writes ``<think>xy</think>\\n\\nAB`` and ends; after ``</think>\\n\\n`` (thinking off) just
``AB``; after ``<think>`` (a template that opens it) ``xy</think>\\n\\nAB``. Its tokenizer has
``<think>`` and ``</think>`` as added tokens, not special (as Qwen3's), and a Qwen3-like chat
template: ``enable_thinking: false`` appends an empty think block to the generation prompt,
``open_think: true`` (this test's own variable) opens one.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from serve_harness import running_server

from ketch.engine.serving.reasoning import CLOSE, OPEN

TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif open_think is defined and open_think %}"
    "{{- '<think>' }}"
    "{%- endif %}"
    "{%- endif %}"
)
CORPUS = ["a\n\n", "assistant\nuser\n", "x y A B"]
# token -> the token the model writes after it
CHAIN = {"\n": OPEN, OPEN: "x", "x": "y", "y": CLOSE, CLOSE: "\n\n", "\n\n": "A", "A": "B"}
MESSAGES = [{"role": "user", "content": "Where is the Eiffel tower?"}]
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
OPENED = {"chat_template_kwargs": {"open_think": True}}


def make_tokenizer(out: Path) -> dict[str, int]:
    """A byte-level BPE tokenizer with Qwen3's markers; returns the chain's token ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (OPEN, CLOSE)])
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    ids = {}
    for text in {*CHAIN, *CHAIN.values(), "<|im_end|>"}:
        [ids[text]] = tok.encode(text).ids  # each is one token
    return ids


def make_checkpoint(out: Path) -> Path:
    """The chain-following Qwen3 described in the module's docstring."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    ids = make_tokenizer(out)
    eos = ids["<|im_end|>"]
    config = Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, eos_token_id=eos, bos_token_id=eos,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for dim, (token, after) in enumerate([*CHAIN.items(), ("B", "<|im_end|>")]):
            embed[ids[token]] = 0.0
            embed[ids[token], dim] = 1.0  # a direction of its own ...
            head[ids[after], dim] = 50.0  # ... that only the next token's logit reads
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = make_checkpoint(tmp_path_factory.mktemp("thinker"))
    with running_server("--model", str(model), "--served-model-name", "thinker") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, extra: dict | None = None, **fields):
    fields = {"model": "thinker", "messages": MESSAGES, "temperature": 0, **fields}
    return client.chat.completions.create(**fields, extra_body=extra)


def _reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def _streamed(client: openai.OpenAI, extra: dict | None = None, **fields) -> list[dict]:
    """Per choice: its reasoning, content and finish reason, added up from the stream."""
    out: dict[int, dict] = {}
    for chunk in _chat(client, extra, stream=True, **fields):
        for c in chunk.choices:
            got = out.setdefault(c.index, {"reasoning": None, "content": None, "finish": None})
            for key, piece in (("reasoning", _reasoning(c.delta)), ("content", c.delta.content)):
                if piece:
                    got[key] = (got[key] or "") + piece
            got["finish"] = c.finish_reason or got["finish"]
    return [out[i] for i in sorted(out)]


def test_the_startup_log_names_the_parser(server):
    assert "reasoning parser: think (auto: the chat template writes <think>)" in server.log()


@pytest.mark.parametrize(
    ("extra", "reasoning", "content"),
    [(None, "xy", "AB"), (OPENED, "xy", "AB"), (THINKING_OFF, None, "AB")],
    ids=["thinking", "template-opens-think", "thinking-off"],
)
def test_reasoning_is_split_off_streamed_and_not(client, extra, reasoning, content):
    out = _chat(client, extra)
    [choice] = out.choices
    assert (_reasoning(choice.message), choice.message.content) == (reasoning, content)
    assert choice.finish_reason == "stop"
    assert _streamed(client, extra) == [
        {"reasoning": reasoning, "content": content, "finish": "stop"}
    ]


def test_reasoning_cut_by_max_tokens_is_all_reasoning(client):
    [choice] = _chat(client, max_tokens=3).choices
    assert (_reasoning(choice.message), choice.message.content) == ("xy", None)
    assert choice.finish_reason == "length"
    streamed = {"reasoning": "xy", "content": None, "finish": "length"}
    assert _streamed(client, max_tokens=3) == [streamed]


def test_n_logprobs_and_stop_strings(client):
    out = _chat(client, n=2, logprobs=True, top_logprobs=2, stop=["B"])
    for choice in out.choices:
        assert (_reasoning(choice.message), choice.message.content) == ("xy", "A")
        tokens = [t.token for t in choice.logprobs.content]
        assert tokens == [OPEN, "x", "y", CLOSE, "\n\n", "A", "B"]  # every token, as before
    assert out.usage.completion_tokens == 2 * 7
    streamed = {"reasoning": "xy", "content": "A", "finish": "stop"}
    assert _streamed(client, n=2, logprobs=True, stop=["B"]) == [streamed, streamed]
    [choice] = _chat(client, stop=["y"]).choices  # a stop string inside the reasoning
    assert (_reasoning(choice.message), choice.message.content) == ("x", None)


def test_tools_and_structured_outputs(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    [choice] = _chat(client, tools=tools).choices  # auto: calls looked for in the content
    assert (_reasoning(choice.message), choice.message.content) == ("xy", "AB")
    assert not choice.message.tool_calls
    streamed = {"reasoning": "xy", "content": "AB", "finish": "stop"}
    assert _streamed(client, tools=tools) == [streamed]
    # A grammar constrains the whole output, which is then all content: nothing is looked for
    # in it (no reasoning_content at all). (A grammar holding a literal <think> breaks on the
    # added token: llguidance counts every added token as special.)
    [choice] = _chat(client, {"guided_choice": ["xyAB"]}).choices
    assert choice.message.content == "xyAB"
    assert "reasoning_content" not in (choice.message.model_extra or {})


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ('[{"enable_thinking": false}]', "input should be an object"),
        ('"enable_thinking"', "input should be an object"),
        ('{"messages": []}', "'messages'"),
        ('{"add_generation_prompt": false}', "'add_generation_prompt'"),
        ('{"tools": []}', "'tools'"),
        (json.dumps({f"k{i}": i for i in range(1000)}), "at most 256 values"),
        (json.dumps({"x": "y" * 100_000}), "at most 16384 characters"),
        ('{"x": ' + "[" * 50 + "]" * 50 + "}", "nest at most 8 deep"),
        ('{"x": ' + "[" * 5000 + "]" * 5000 + "}", "recursion limit"),  # past the JSON parser's
    ],
    ids=["list", "string", "messages", "generation", "tools", "many", "long", "deep", "deeper"],
)
def test_hostile_chat_template_kwargs_are_refused_for_that_request_only(
    server, client, kwargs: str, words: str
):
    body = json.dumps({"model": "thinker", "messages": MESSAGES})
    raw = body[:-1] + f', "chat_template_kwargs": {kwargs}}}'
    reply = httpx.post(f"{server.url}/v1/chat/completions", content=raw, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert words in error["message"], error
    assert error["param"] == "chat_template_kwargs" or words == "recursion limit", error
    assert _chat(client, THINKING_OFF).choices[0].message.content == "AB"


def test_tokenize_renders_with_chat_template_kwargs_too(server):
    def tokenize(**fields) -> httpx.Response:
        body = {"model": "thinker", "messages": MESSAGES, **fields}
        return httpx.post(f"{server.url}/tokenize", json=body, timeout=60)

    def text(reply: httpx.Response) -> str:
        tokens = reply.json()["tokens"]
        return httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=60).json()[
            "prompt"
        ]

    assert text(tokenize()).endswith("<|im_start|>assistant\n")
    off = tokenize(**THINKING_OFF)
    assert text(off).endswith(f"<|im_start|>assistant\n{OPEN}\n\n{CLOSE}\n\n")
    refused = tokenize(chat_template_kwargs={"eos_token": "x"})
    assert refused.status_code == 400 and "'eos_token'" in refused.json()["error"]["message"]
