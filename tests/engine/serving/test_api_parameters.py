"""Issue 16's request parameters in the protocol layer: how ``logit_bias``, ``echo``,
``prompt_logprobs``, ``best_of``, ``suffix`` and ``user`` map to SamplingParams or are refused,
and the response shapes of ``echo`` and ``prompt_logprobs`` (checked with openai's types).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ketch.engine.disagg.messages import MAX_PD_PROMPT_SCORES
from ketch.engine.models.loader import TINY_MODEL_DIR
from ketch.engine.outputs import CompletionOutput, RequestDelta, RequestOutput, TokenLogprob
from ketch.engine.sampling_params import MAX_LOGPROBS
from ketch.engine.serving.generation import make_choices
from ketch.engine.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    parse_request,
)
from ketch.engine.serving.responses import (
    Echo,
    ResponseMeta,
    chat_completion_response,
    completion_chunk,
    completion_response,
)
from ketch.engine.tokenizer import Tokenizer

openai_types = pytest.importorskip("openai.types")
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402


def completion(**fields: Any) -> CompletionRequest:
    return parse_request(CompletionRequest, {"model": "tiny", "prompt": "hello", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return parse_request(ChatCompletionRequest, {"model": "tiny", "messages": messages, **fields})


def refusal(make: Any, **fields: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        make(**fields).to_sampling_params(100)
    assert info.value.status_code == 400
    return info.value


# ---- requests -> SamplingParams ----


@pytest.mark.parametrize("make", [completion, chat])
def test_logit_bias_becomes_token_id_pairs(make: Any) -> None:
    params = make(logit_bias={"17": 100, "3": -2.5}).to_sampling_params(100)
    assert params.logit_bias == [(3, -2.5), (17, 100.0)]
    assert make().to_sampling_params(100).logit_bias == []


@pytest.mark.parametrize(
    ("bias", "word"),
    [({"5": 101}, "[-100, 100]"), ({"five": 1}, "token ids"), ({"5": "1"}, "number")],
)
def test_bad_logit_bias_is_400_naming_it(bias: dict, word: str) -> None:
    error = refusal(completion, logit_bias=bias)
    assert error.param is not None and error.param.startswith("logit_bias")
    assert word in error.message


def test_echo_with_logprobs_scores_the_prompt_as_vllm_does() -> None:
    assert completion(echo=True, logprobs=2).to_sampling_params(9).prompt_logprobs == 2
    assert completion(echo=True).to_sampling_params(9).prompt_logprobs is None
    assert completion(logprobs=2).to_sampling_params(9).prompt_logprobs is None
    explicit = completion(echo=True, logprobs=2, prompt_logprobs=5).to_sampling_params(9)
    assert explicit.prompt_logprobs == 5


@pytest.mark.parametrize("make", [completion, chat])
def test_prompt_logprobs_are_bounded_and_not_streamed(make: Any) -> None:
    assert make(prompt_logprobs=MAX_LOGPROBS).to_sampling_params(9).prompt_logprobs == 20
    error = refusal(make, prompt_logprobs=MAX_LOGPROBS + 1)
    assert error.param == "prompt_logprobs" and "20" in error.message
    error = refusal(make, prompt_logprobs=1, stream=True)
    assert error.param == "prompt_logprobs" and "stream" in error.message
    # echo with logprobs scores the prompt in a stream too: it is not the client's field.
    assert completion(echo=True, logprobs=1, stream=True).to_sampling_params(9).prompt_logprobs


def test_logprobs_above_the_documented_maximum_are_refused() -> None:
    assert completion(logprobs=MAX_LOGPROBS).to_sampling_params(9).logprobs == MAX_LOGPROBS
    assert refusal(completion, logprobs=MAX_LOGPROBS + 1).param == "logprobs"
    assert chat(logprobs=True, top_logprobs=20).to_sampling_params(9).logprobs == 20
    assert refusal(chat, logprobs=True, top_logprobs=21).param == "top_logprobs"


def test_best_of_equal_to_n_is_accepted_and_anything_else_refused() -> None:
    assert completion(n=3, best_of=3).to_sampling_params(9).n == 3
    more = refusal(completion, n=1, best_of=2)
    assert more.param == "best_of" and "not supported" in more.message
    fewer = refusal(completion, n=3, best_of=2)
    assert fewer.param == "best_of" and ">= n" in fewer.message


def test_suffix_is_refused_and_user_ignored() -> None:
    error = refusal(completion, suffix="tail")
    assert error.param == "suffix" and "not supported" in error.message
    assert completion(user="alice").to_sampling_params(9) == completion().to_sampling_params(9)
    assert chat(user="alice").to_sampling_params(9) == chat().to_sampling_params(9)


def test_a_decode_instance_refuses_prompt_scores_its_prefill_peer_could_not_send() -> None:
    params = completion(prompt_logprobs=20).to_sampling_params(9)
    long = [[5] * (MAX_PD_PROMPT_SCORES // 21 + 1)]
    with pytest.raises(ProtocolError) as info:
        make_choices(long, params, prefill_peer="10.0.0.1:8004")
    assert info.value.param == "prompt_logprobs" and "prefill/decode" in info.value.message
    assert len(make_choices(long, params)) == 1  # mixed: computed here
    assert make_choices([[5] * 100], params, prefill_peer="10.0.0.1:8004")


def test_chat_echo_is_refused() -> None:
    error = refusal(chat, echo=True)
    assert error.param == "echo" and "/v1/completions" in error.message


# ---- responses ----


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(TINY_MODEL_DIR)


def _scored(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[TokenLogprob]]:
    ids = tokenizer.encode(text)
    return ids, [TokenLogprob(t, -1.0 - i, [(t + 1, -0.5)]) for i, t in enumerate(ids[1:])]


def _finished(tokenizer: Tokenizer, prompt: str, text: str) -> RequestOutput:
    ids, scored = _scored(tokenizer, prompt)
    out_ids = tokenizer.encode(text)
    entries = [TokenLogprob(t, -0.25, []) for t in out_ids]
    output = CompletionOutput(0, text, out_ids, "length", logprobs=entries)
    return RequestOutput("r", prompt, ids, [output], True, prompt_logprobs=scored)


def test_echo_response_puts_the_prompt_and_its_logprobs_first(tokenizer: Tokenizer) -> None:
    prompt, text = "Alice was beginning", " very tired"
    done = _finished(tokenizer, prompt, text)
    meta = ResponseMeta.completion("tiny")
    body = json.loads(json.dumps(completion_response(meta, [done], tokenizer, [prompt])))
    # openai's types say float, but the first echoed token has none (null, as OpenAI sends):
    # the client builds its objects without validating, so check the JSON itself.
    choice = body["choices"][0]
    assert choice["text"] == prompt + text
    logprobs = choice["logprobs"]
    tokens = logprobs["tokens"]
    assert len(tokens) == len(tokenizer.encode(prompt)) + len(done.outputs[0].token_ids)
    assert "".join(tokens) == prompt + text
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    scored = len(done.prompt_token_ids) - 1
    assert logprobs["token_logprobs"][1:] == [-1.0 - i for i in range(scored)] + [-0.25] * (
        len(tokens) - scored - 1
    )
    assert logprobs["top_logprobs"][1] == {
        tokens[1]: -1.0,
        tokenizer.decode([done.prompt_token_ids[1] + 1], False): -0.5,
    }
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    Completion.model_construct(**body)


def test_prompt_logprobs_in_vllm_shape(tokenizer: Tokenizer) -> None:
    done = _finished(tokenizer, "Alice was here", "!")
    ids = done.prompt_token_ids
    body = completion_response(ResponseMeta.completion("tiny"), [done], tokenizer)
    assert body["choices"][0]["text"] == "!"  # no echo: the prompt is not in the text
    scored = body["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    second = scored[1]
    assert set(second) == {str(ids[1]), str(ids[1] + 1)}
    assert second[str(ids[1])] == {
        "logprob": -1.0,
        "rank": None,  # not among the top ones returned: unknown
        "decoded_token": tokenizer.decode([ids[1]], skip_special_tokens=False),
    }
    assert second[str(ids[1] + 1)]["rank"] == 1
    chat_body = chat_completion_response(ResponseMeta.chat("tiny"), done, tokenizer)
    ChatCompletion.model_validate(chat_body)
    assert chat_body["prompt_logprobs"] == scored
    done.prompt_logprobs = None
    plain = completion_response(ResponseMeta.completion("tiny"), [done], tokenizer)
    assert "prompt_logprobs" not in plain["choices"][0]
    assert "prompt_logprobs" not in chat_completion_response(
        ResponseMeta.chat("tiny"), done, tokenizer
    )


def test_echo_stream_starts_each_choice_with_its_prompt(tokenizer: Tokenizer) -> None:
    prompt = "Alice was"
    ids, scored = _scored(tokenizer, prompt)
    meta = ResponseMeta.completion("tiny")
    echo = Echo(prompt, ids[0], scored)
    first_ids, next_ids = tokenizer.encode(" very"), tokenizer.encode(" tired")
    scores = {t: TokenLogprob(t, -0.1) for t in first_ids + next_ids}
    first = RequestDelta("r", first_ids, " very", logprobs=[scores[t] for t in first_ids])
    chunk = completion_chunk(meta, 0, first, tokenizer, first=True, echo=echo)["choices"][0]
    assert chunk["text"] == prompt + " very"
    assert chunk["logprobs"]["token_logprobs"][0] is None
    assert len(chunk["logprobs"]["tokens"]) == len(ids) + len(first_ids)
    later = RequestDelta("r", next_ids, " tired", logprobs=[scores[t] for t in next_ids])
    chunk = completion_chunk(meta, 0, later, tokenizer, text_offset=5, echo=echo)["choices"][0]
    assert chunk["text"] == " tired"
    assert chunk["logprobs"]["text_offset"][0] == len(prompt + " very")
