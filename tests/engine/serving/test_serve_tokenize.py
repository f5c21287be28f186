"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` on a real ``ketch serve``:
vLLM's shapes, round trips, agreement with what the completions endpoints count, and a clear
4xx for every bad body (never a 5xx). The API key rules are tested with the other endpoints'
(test_serve_errors.py).
"""

from __future__ import annotations

from importlib import metadata

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "Who was tired?"}]
TEXT = "Alice was beginning to get very tired"


def post(server, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    for word in words:
        assert word in error["message"] + str(error["param"]), error
    return error


def test_tokenize_a_prompt(server, reference_llm):
    tokenizer = reference_llm.tokenizer
    body = ok(post(server, "/tokenize", {"model": "tiny", "prompt": TEXT}))
    assert body == {
        "count": len(tokenizer.encode(TEXT)),
        "max_model_len": reference_llm.engine.max_model_len,
        "tokens": tokenizer.encode(TEXT),
    }
    strs = ok(post(server, "/tokenize", {"prompt": TEXT, "return_token_strs": True}))
    assert strs["token_strs"] == [tokenizer.id_to_token(t) for t in body["tokens"]]
    assert ok(post(server, "/tokenize", {"prompt": ""}))["tokens"] == []


def test_tokenize_counts_what_completions_count(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    text = ok(post(server, "/tokenize", {"prompt": TEXT}))
    out = client.completions.create(model="tiny", prompt=TEXT, max_tokens=1)
    assert out.usage.prompt_tokens == text["count"]
    chat = ok(post(server, "/tokenize", {"messages": MESSAGES}))
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert out.usage.prompt_tokens == chat["count"]


def test_tokenize_a_chat_with_and_without_the_generation_prompt(server, reference_llm):
    tokenizer = reference_llm.tokenizer
    for add in (True, False):
        body = ok(post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": add}))
        rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add)
        assert body["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    with_prompt = ok(post(server, "/tokenize", {"messages": MESSAGES}))["count"]
    assert with_prompt > body["count"]


def test_detokenize_round_trips(server):
    for request in ({"prompt": TEXT}, {"messages": MESSAGES}):
        tokens = ok(post(server, "/tokenize", request))["tokens"]
        text = ok(post(server, "/detokenize", {"model": "tiny", "tokens": tokens}))["prompt"]
        assert (
            ok(post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"]
            == tokens
        )
        if "prompt" in request:
            assert text == TEXT
    assert ok(post(server, "/detokenize", {"tokens": []})) == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/detokenize", {"tokens": [5, 1024]}, ["tokens", "1024", "outside"]),
        ("/detokenize", {"tokens": [-1]}, ["tokens", "outside"]),
        ("/detokenize", {"tokens": [2**64]}, ["tokens"]),
        ("/detokenize", {"tokens": ["5"]}, ["tokens[0]"]),
        ("/detokenize", {"tokens": [1.0]}, ["tokens[0]"]),
        ("/detokenize", {"tokens": [True]}, ["tokens[0]"]),
        ("/detokenize", {"tokens": 5}, ["tokens"]),
        ("/detokenize", {}, ["tokens"]),
        ("/detokenize", [1, 2], ["request body"]),
        ("/tokenize", {}, ["prompt", "messages"]),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, ["exactly one"]),
        ("/tokenize", {"prompt": 5}, ["prompt"]),
        ("/tokenize", {"prompt": ["a"]}, ["prompt"]),
        ("/tokenize", {"messages": []}, ["messages"]),
        ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, ["messages[0].content"]),
        ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": "yes"}, ["add_gen"]),
        ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, ["add_special_tokens"]),
    ],
)
def test_bad_bodies_are_400_naming_the_field(server, path: str, body: object, words: list[str]):
    error = refused(post(server, path, body), 400, *words)
    assert error["type"] == "invalid_request_error"


def test_wrong_model_is_404_and_bad_json_400(server):
    refused(post(server, "/tokenize", {"model": "gpt-9", "prompt": "a"}), 404, "gpt-9")
    refused(post(server, "/detokenize", {"model": "gpt-9", "tokens": [1]}), 404, "gpt-9")
    for path in ("/tokenize", "/detokenize"):
        response = httpx.post(
            f"{server.url}{path}", content=b'{"prompt": ', headers={"content-type": "x"}
        )
        refused(response, 400, "JSON")


def test_bodies_over_the_size_limit_are_413(server):
    big = {"prompt": "a" * (2 << 20)}
    refused(post(server, "/tokenize", big), 413, "larger than")
    refused(post(server, "/detokenize", {"tokens": [1] * (1 << 20)}), 413, "larger than")


def test_version(server):
    body = ok(httpx.get(f"{server.url}/version", timeout=10))
    assert body == {"version": metadata.version("ketch")}
