"""The OpenAI protocol layer: request validation, SamplingParams mapping, errors, responses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ketch.engine.models.loader import TINY_MODEL_DIR
from ketch.engine.outputs import CompletionOutput, RequestDelta, RequestOutput, TokenLogprob
from ketch.engine.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    check_model,
    error_body,
    parse_request,
    to_sampling_params,
)
from ketch.engine.serving.responses import (
    SSE_DONE,
    ResponseMeta,
    chat_chunk,
    chat_completion_response,
    chat_role_chunk,
    chat_usage_chunk,
    completion_chunk,
    completion_response,
    completion_usage_chunk,
    models_response,
    sse,
    usage,
)
from ketch.engine.tokenizer import Tokenizer

openai_types = pytest.importorskip("openai.types")
from openai.types import Completion, Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return parse_request(CompletionRequest, {"model": "tiny", "prompt": "hello", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, **fields})


def refused(make: Any, **fields: Any) -> ProtocolError:
    """The 400 ProtocolError that parsing or mapping these fields gives."""
    with pytest.raises(ProtocolError) as info:
        make(**fields).to_sampling_params(100)
    assert info.value.status_code == 400
    assert "errors.pydantic.dev" not in info.value.message
    return info.value


# ---- field validation ----

# field, accepted values, refused values (wrong type or out of range)
COMMON_FIELDS: list[tuple[str, list[Any], list[Any]]] = [
    ("n", [1, 3, None], [0, 129, "2", 1.5, True]),
    ("temperature", [0, 0.7, 1, 2.0, None], [-0.1, "1", float("inf"), True]),
    ("top_p", [0.1, 1.0, None], [0, 1.5, "x"]),
    ("top_k", [0, -1, 5, None], [-2, 2.5]),
    ("min_p", [0.0, 0.5, None], [-0.1, 1.1]),
    ("repetition_penalty", [1.0, 1.3, None], [0, -1.0]),
    ("presence_penalty", [-2, 0.5, 2, None], [2.1, -3, "0"]),
    ("frequency_penalty", [-2, 0.5, 2, None], [2.5, []]),
    ("seed", [0, 42, -1, None], [1.5, "42"]),
    ("min_tokens", [0, 3, None], [-1, 1.5]),
    ("ignore_eos", [True, False, None], [1, "yes"]),
    ("stop", ["\n", ["a", "b"], [], None], [5, [5], [""], {"a": 1}]),
    ("stop_token_ids", [[1, 2], [], None], [[-1], ["a"], 3]),
    ("skip_special_tokens", [True, False], [0, "no"]),
    ("stream", [True, False, None], ["true", 1]),
    ("user", ["alice", None], [5]),
    ("model", ["tiny"], [5, None]),
    (
        "logit_bias",
        [{}, None, {"5": 1.0}, {"0": -100, "7": 100}],
        [
            [1],
            {"5": 100.5},
            {"5": -101},
            {"x": 1.0},
            {"-1": 1.0},
            {"5": "1"},
            {"5": True},
            {"1" * 5000: 1.0},
            {"\u0665": 1.0},
        ],
    ),
    ("prompt_logprobs", [0, 5, 20, None], [21, -1, True, "1"]),
    (
        "response_format",
        [
            None,
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": True}},
        ],
        [
            "json",
            {"type": "xml"},
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": {"schema": {"type": 5}}},
            {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
        ],
    ),
    (
        "guided_json",
        [None, {"type": "object"}, '{"type": "integer"}', True],
        [{"type": "strin"}, "{x", 5, [1]],
    ),
    ("guided_regex", [None, "a+", "[0-9]{3}"], ["", 5]),
    ("guided_choice", [None, ["a", "b c"]], [[], [""], "a", [1]]),
    ("guided_grammar", [None, 'start: "a"', 'root ::= "a"'], ["", " ", 5]),
    (
        "structured_outputs",
        [None, {"json": {}}, {"choice": ["x"]}, {"json_object": True}],
        [{}, {"jsn": 1}, {"regex": "a", "choice": ["b"]}, {"json_object": False}, 5],
    ),
]
COMPLETION_FIELDS = [
    *COMMON_FIELDS,
    ("max_tokens", [1, 50, None], [0, -5, "10", 2.0]),
    ("logprobs", [0, 5, 20, None], [21, -1, True, "1"]),
    ("echo", [False, None, True], ["no", 1]),
    ("suffix", [None, ""], ["tail"]),
    ("best_of", [None, 1], [2, 0, "1"]),
]
CHAT_FIELDS = [
    *COMMON_FIELDS,
    ("max_tokens", [1, 50, None], [0, "10"]),
    ("max_completion_tokens", [1, 50, None], [0, -1, 1.5]),
    ("logprobs", [True, False, None], [1, "true"]),
    ("add_generation_prompt", [True, False], [None, 1]),
    ("tools", [None, []], [[{"type": "function"}]]),
    ("echo", [False, None], [True]),
]


def _cases(fields: list[tuple[str, list[Any], list[Any]]], good: bool) -> list[Any]:
    return [
        pytest.param(name, value, id=f"{name}={value!r}")
        for name, goods, bads in fields
        for value in (goods if good else bads)
    ]


@pytest.mark.parametrize(("name", "value"), _cases(COMPLETION_FIELDS, good=True))
def test_completion_field_accepted(name: str, value: Any) -> None:
    completion(**{name: value}).to_sampling_params(100)


@pytest.mark.parametrize(("name", "value"), _cases(COMPLETION_FIELDS, good=False))
def test_completion_field_refused_naming_it(name: str, value: Any) -> None:
    error = refused(completion, **{name: value})
    assert error.param is not None and error.param.startswith(name), error.message
    assert name in error.message


@pytest.mark.parametrize(("name", "value"), _cases(CHAT_FIELDS, good=True))
def test_chat_field_accepted(name: str, value: Any) -> None:
    chat(**{name: value}).to_sampling_params(100)


@pytest.mark.parametrize(("name", "value"), _cases(CHAT_FIELDS, good=False))
def test_chat_field_refused_naming_it(name: str, value: Any) -> None:
    error = refused(chat, **{name: value})
    assert error.param is not None and error.param.startswith(name), error.message
    assert name in error.message


@pytest.mark.parametrize("value", [0, 20, None])
def test_chat_top_logprobs_accepted(value: int | None) -> None:
    assert chat(logprobs=True, top_logprobs=value).to_sampling_params(9).logprobs == (value or 0)


@pytest.mark.parametrize("value", [21, -1, "3"])
def test_chat_top_logprobs_refused(value: Any) -> None:
    error = refused(chat, logprobs=True, top_logprobs=value)
    assert error.param == "top_logprobs" and "top_logprobs" in error.message


def test_top_logprobs_needs_logprobs() -> None:
    error = refused(chat, top_logprobs=2)
    assert error.param == "top_logprobs" and "logprobs" in error.message


def test_stream_options() -> None:
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True, stream_options={"include_usage": False}).include_usage
    assert not chat(stream=True).include_usage
    assert refused(chat, stream_options={"include_usage": "yes"}).param == (
        "stream_options.include_usage"
    )
    error = refused(chat, stream=False, stream_options={"include_usage": True})
    assert error.param == "stream_options" and "stream" in error.message


def test_unknown_fields_ignored() -> None:
    extra = {"frobnicate": {"x": [1, 2]}, "metadata": None, "parallel_tool_calls": True}
    assert completion(**extra).prompt == ["hello"]
    assert chat(**extra).messages[0].role == "user"


def test_wrong_type_message_is_plain() -> None:
    error = refused(completion, max_tokens="10")
    assert error.message == "max_tokens: input should be a valid integer, got '10'"


def test_several_problems_all_named() -> None:
    error = refused(completion, max_tokens="10", temperature="hot")
    assert "max_tokens" in error.message and "temperature" in error.message


# ---- prompts and messages ----


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_forms(prompt: Any, prompts: list[Any]) -> None:
    assert completion(prompt=prompt).prompt == prompts


@pytest.mark.parametrize(
    "prompt", ["", [], [""], [[]], [[1, -2]], 5, None, [1.5], [{"text": "a"}], [True], [[True]]]
)
def test_bad_prompts_refused(prompt: Any) -> None:
    assert refused(completion, prompt=prompt).param == "prompt"


def test_missing_prompt_and_messages() -> None:
    with pytest.raises(ProtocolError, match="prompt: field required"):
        parse_request(CompletionRequest, {"model": "tiny"})
    with pytest.raises(ProtocolError, match="messages: field required"):
        parse_request(ChatCompletionRequest, {"model": "tiny"})


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "", "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ],
)
def test_bad_messages_refused(messages: Any, param: str) -> None:
    assert refused(chat, messages=messages).param == param


def test_conversation_keeps_text_parts_and_extra_fields() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "bob"},
        {"role": "assistant", "content": None},
    ]
    conversation = chat(messages=messages).conversation()
    assert conversation == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "bob"},
        {"role": "assistant"},
    ]
    tokenizer = Tokenizer(TINY_MODEL_DIR)
    assert "hi" in tokenizer.apply_chat_template(conversation)


def test_parse_raw_json() -> None:
    assert parse_request(CompletionRequest, b'{"model": "m", "prompt": "x"}').model == "m"
    with pytest.raises(ProtocolError, match="request body: invalid JSON") as info:
        parse_request(CompletionRequest, b'{"model": ')
    assert info.value.status_code == 400 and info.value.param is None
    with pytest.raises(ProtocolError, match="request body"):
        parse_request(ChatCompletionRequest, "[1, 2]")


# ---- model name ----


def test_check_model() -> None:
    assert check_model("tiny", ["tiny", "other"]) == "tiny"
    with pytest.raises(ProtocolError) as info:
        check_model("gpt-4", ["tiny", "other"])
    error = info.value
    assert error.status_code == 404 and error.type == "not_found_error"
    assert error.param == "model" and "gpt-4" in error.message
    assert "tiny" in error.message and "other" in error.message


# ---- SamplingParams mapping ----


def test_completion_defaults() -> None:
    params = to_sampling_params(completion(), default_max_tokens=500)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.n == 1
    assert params.max_tokens == 16  # OpenAI's documented completions default
    assert params.logprobs is None and params.stop == [] and params.seed is None
    assert to_sampling_params(completion(max_tokens=None), 500).max_tokens == 500
    assert to_sampling_params(completion(max_tokens=None), None).max_tokens is None


def test_chat_defaults_and_max_tokens() -> None:
    params = to_sampling_params(chat(), default_max_tokens=500)
    assert params.temperature == 1.0 and params.max_tokens == 500 and params.logprobs is None
    assert to_sampling_params(chat(max_tokens=7), 500).max_tokens == 7
    assert to_sampling_params(chat(max_tokens=7, max_completion_tokens=9), 500).max_tokens == 9


def test_every_field_mapped() -> None:
    request = completion(
        n=2,
        temperature=0,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=7,
        max_tokens=30,
        min_tokens=2,
        stop="END",
        stop_token_ids=[3],
        ignore_eos=True,
        logprobs=3,
        skip_special_tokens=False,
    )
    params = request.to_sampling_params(100)
    assert params.greedy and params.n == 2 and params.top_p == 0.9 and params.top_k == 5
    assert params.min_p == 0.1 and params.repetition_penalty == 1.2
    assert params.presence_penalty == 0.5 and params.frequency_penalty == -0.5
    assert params.seed == 7 and params.max_tokens == 30 and params.min_tokens == 2
    assert params.stop == ["END"] and params.stop_token_ids == [3] and params.ignore_eos
    assert params.logprobs == 3 and not params.skip_special_tokens


def test_min_tokens_over_max_tokens_refused() -> None:
    error = refused(chat, min_tokens=10, max_completion_tokens=5)
    assert error.param == "min_tokens"


# ---- errors ----


@pytest.mark.parametrize(
    ("status", "type_"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (503, "server_error"),
    ],
)
def test_error_body(status: int, type_: str) -> None:
    body = error_body(ProtocolError(status, "nope", param="x"))
    assert body == {"error": {"message": "nope", "type": type_, "param": "x", "code": None}}
    json.dumps(body)


def test_error_body_explicit_type_and_code() -> None:
    error = ProtocolError(401, "bad key", type="authentication_error", code="invalid_api_key")
    assert error_body(error)["error"]["code"] == "invalid_api_key"
    assert str(error) == "bad key"


# ---- responses ----


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(TINY_MODEL_DIR)


def _output(
    tokenizer: Tokenizer, text: str, index: int = 0, logprobs: bool = False
) -> CompletionOutput:
    ids = tokenizer.encode(text, add_special_tokens=False)
    entries = None
    if logprobs:
        entries = [TokenLogprob(t, -0.5, [(t, -0.5), (t + 1, -1.5)]) for t in ids]
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=ids,
        finish_reason="length",
        logprobs=entries,
    )


def _request_output(tokenizer: Tokenizer, *outputs: CompletionOutput) -> RequestOutput:
    return RequestOutput(
        request_id="r0",
        prompt="hello",
        prompt_token_ids=tokenizer.encode("hello"),
        outputs=list(outputs),
        finished=True,
        num_cached_tokens=1,
    )


def test_completion_response(tokenizer: Tokenizer) -> None:
    first = _request_output(tokenizer, _output(tokenizer, " world", logprobs=True))
    second = _request_output(
        tokenizer, _output(tokenizer, " a", logprobs=True), _output(tokenizer, " b", 1, True)
    )
    meta = ResponseMeta.completion("tiny")
    body = completion_response(meta, [first, second], tokenizer)
    parsed = Completion.model_validate(json.loads(json.dumps(body)))
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    assert parsed.model == "tiny" and abs(parsed.created - meta.created) < 2
    assert [c.index for c in parsed.choices] == [0, 1, 2]
    assert [c.text for c in parsed.choices] == [" world", " a", " b"]
    assert parsed.choices[0].finish_reason == "length"
    logprobs = parsed.choices[0].logprobs
    assert logprobs is not None
    ids = tokenizer.encode(" world", add_special_tokens=False)
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert logprobs.tokens == tokens and "".join(tokens) == " world"
    assert logprobs.token_logprobs == [-0.5] * len(ids)
    assert logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(ids))]
    assert logprobs.top_logprobs is not None
    assert logprobs.top_logprobs[0][tokens[0]] == -0.5
    assert len(logprobs.top_logprobs[0]) == 2
    prompt_tokens = 2 * len(tokenizer.encode("hello"))
    completion_tokens = sum(len(c.token_ids) for r in (first, second) for c in r.outputs)
    assert parsed.usage is not None and parsed.usage.prompt_tokens == prompt_tokens
    assert parsed.usage.completion_tokens == completion_tokens
    assert parsed.usage.total_tokens == prompt_tokens + completion_tokens
    # Prefix-cache hits are not reported by default (review M6: a cross-tenant oracle) ...
    assert "prompt_tokens_details" not in body["usage"]
    # ... only by a server run with --enable-prompt-tokens-details.
    shown = ResponseMeta.completion("tiny", prompt_tokens_details=True)
    body = completion_response(shown, [first, second], tokenizer)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_completion_response_without_logprobs(tokenizer: Tokenizer) -> None:
    output = _request_output(tokenizer, _output(tokenizer, "hi"))
    body = completion_response(ResponseMeta.completion("tiny"), [output], tokenizer)
    assert Completion.model_validate(body).choices[0].logprobs is None


def test_chat_completion_response(tokenizer: Tokenizer) -> None:
    output = _request_output(
        tokenizer, _output(tokenizer, "hé there", logprobs=True), _output(tokenizer, "yo", 1)
    )
    output.outputs[0].finish_reason = "stop"
    body = chat_completion_response(ResponseMeta.chat("tiny"), output, tokenizer)
    parsed = ChatCompletion.model_validate(json.loads(json.dumps(body)))
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert [c.index for c in parsed.choices] == [0, 1]
    first = parsed.choices[0]
    assert first.message.role == "assistant" and first.message.content == "hé there"
    assert first.finish_reason == "stop" and parsed.choices[1].logprobs is None
    assert first.logprobs is not None and first.logprobs.content is not None
    ids = output.outputs[0].token_ids
    assert len(first.logprobs.content) == len(ids)
    for entry, token_id in zip(first.logprobs.content, ids, strict=True):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        assert entry.token == text and entry.bytes == list(text.encode("utf-8"))
        assert entry.logprob == -0.5 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[1].token == tokenizer.decode([token_id + 1], False)
    assert parsed.usage is not None and parsed.usage.total_tokens == len(
        tokenizer.encode("hello")
    ) + len(ids) + len(output.outputs[1].token_ids)


def _streamed(tokenizer: Tokenizer, text: str, logprobs: bool) -> list[RequestDelta]:
    """The deltas an engine emits for ``text``, one token at a time."""
    full = _output(tokenizer, text, logprobs=logprobs)
    steps = []
    for i in range(1, len(full.token_ids) + 1):
        ids = full.token_ids[:i]
        done = tokenizer.decode(ids)
        before = tokenizer.decode(ids[:-1])
        steps.append(
            RequestDelta(
                "r0",
                ids[-1:],
                done[len(before) :],
                finish_reason="stop" if i == len(full.token_ids) else None,
                logprobs=None if full.logprobs is None else full.logprobs[i - 1 : i],
            )
        )
    return steps


def _finished(chunk: dict[str, Any]) -> dict[str, Any]:
    """The chunk as openai's ``Completion`` type accepts it.

    The client reuses ``Completion`` for streamed chunks (without validating them) and its
    ``finish_reason`` is not optional, though OpenAI sends null until a choice ends.
    """
    choices = [{**c, "finish_reason": c["finish_reason"] or "length"} for c in chunk["choices"]]
    return {**chunk, "choices": choices}


def test_completion_chunks(tokenizer: Tokenizer) -> None:
    meta = ResponseMeta.completion("tiny", include_usage=True)
    steps = _streamed(tokenizer, "hello world", logprobs=True)
    offsets = [0]
    for step in steps:
        offsets.append(offsets[-1] + len(step.new_text))
    chunks = [
        completion_chunk(meta, 3, step, tokenizer, text_offset=offset)
        for step, offset in zip(steps, offsets, strict=False)
    ]
    texts = []
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "stop"]
    for chunk in chunks:
        parsed = Completion.model_validate(_finished(chunk))
        assert parsed.id == meta.id and chunk["usage"] is None
        (choice,) = parsed.choices
        assert choice.index == 3 and choice.logprobs is not None
        assert choice.logprobs.text_offset == [len("".join(texts))]
        texts.append(choice.text)
    assert "".join(texts) == "hello world"
    last = completion_usage_chunk(meta, usage(3, len(steps)))
    parsed = Completion.model_validate(last)
    assert parsed.choices == [] and parsed.usage is not None
    assert parsed.usage.total_tokens == 3 + len(steps)


def test_chat_chunks(tokenizer: Tokenizer) -> None:
    meta = ResponseMeta.chat("tiny")
    steps = _streamed(tokenizer, "hi there", logprobs=True)
    role = ChatCompletionChunk.model_validate(chat_role_chunk(meta, 0))
    assert role.choices[0].delta.role == "assistant" and "usage" not in chat_role_chunk(meta, 0)
    chunks = [
        ChatCompletionChunk.model_validate(chat_chunk(meta, 0, step, tokenizer, first=i == 0))
        for i, step in enumerate(steps)
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert all(c.object == "chat.completion.chunk" and c.id == meta.id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "hi there"
    assert [c.choices[0].finish_reason for c in chunks][-2:] == [None, "stop"]
    for chunk, step in zip(chunks, steps, strict=True):
        logprobs = chunk.choices[0].logprobs
        assert logprobs is not None and logprobs.content is not None
        assert [e.token for e in logprobs.content] == [
            tokenizer.decode(step.new_token_ids, skip_special_tokens=False)
        ]
    last = ChatCompletionChunk.model_validate(chat_usage_chunk(meta, usage(4, 2, 1)))
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 2


def test_sse() -> None:
    event = sse({"a": "é", "b": [1]})
    assert event.startswith("data: ") and event.endswith("\n\n") and "\n" not in event[:-2]
    assert json.loads(event.removeprefix("data: ")) == {"a": "é", "b": [1]}
    assert sse("[DONE]") == SSE_DONE == "data: [DONE]\n\n"


def test_models_response() -> None:
    body = models_response(["tiny", "other"], created=123)
    assert body["object"] == "list"
    models = [Model.model_validate(m) for m in body["data"]]
    assert [m.id for m in models] == ["tiny", "other"]
    assert all(m.object == "model" and m.created == 123 for m in models)
