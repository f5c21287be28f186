"""Bad input, access control and overload against real servers (acceptance 3).

Every refusal is an OpenAI-shaped JSON error naming the problem, and the server keeps serving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import openai
import pytest
from serve_harness import running_server, sse_events, wait_for

from ketch.engine.request_checks import PromptLimits, RequestCheckError, check_prompt
from ketch.engine.sampling_params import SamplingParams

GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}


def _assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    for word in words:
        assert word in error["message"].lower(), error
    return error


def _assert_serving(url: str, headers: dict | None = None) -> None:
    response = httpx.post(f"{url}/v1/completions", json=GOOD, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


BAD_BODIES = {
    "max_tokens_wrong_type": ({**GOOD, "max_tokens": "ten"}, "max_tokens"),
    "empty_prompt": ({**GOOD, "prompt": ""}, "prompt"),
    "empty_prompt_list": ({**GOOD, "prompt": []}, "prompt"),
    "max_tokens_zero": ({**GOOD, "max_tokens": 0}, "max_tokens"),
    "max_tokens_negative": ({**GOOD, "max_tokens": -1}, "max_tokens"),
    "temperature_negative": ({**GOOD, "temperature": -1}, "temperature"),
    "top_p_above_one": ({**GOOD, "top_p": 2}, "top_p"),
    "prompt_missing": ({"model": "tiny"}, "prompt"),
    "stream_wrong_type": ({**GOOD, "stream": "yes"}, "stream"),
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_bad_field_is_400_naming_it(server, name):
    body, field = BAD_BODIES[name]
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    error = _assert_error(response, 400, field)
    assert error["type"] == "invalid_request_error"
    _assert_serving(server.url)


@pytest.mark.parametrize("stream", [False, True])
def test_bad_chat_field_is_400(server, stream):
    body = {"model": "tiny", "messages": [], "stream": stream}
    _assert_error(httpx.post(f"{server.url}/v1/chat/completions", json=body), 400, "messages")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 2}
    body["stream"] = stream
    _assert_error(httpx.post(f"{server.url}/v1/chat/completions", json=body), 400, "top_p")
    _assert_serving(server.url)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_json_is_400(server, path):
    response = httpx.post(
        f"{server.url}{path}",
        content=b'{"model": "tiny", "prompt": ',
        headers={"content-type": "application/json"},
    )
    _assert_error(response, 400, "json")
    _assert_serving(server.url)


def test_prompt_over_max_model_len_is_400(server):
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert models[0]["id"] == "tiny"
    prompt = " ".join(["rabbit"] * 1200)  # well over the tiny model's 512-token context
    response = httpx.post(f"{server.url}/v1/completions", json={**GOOD, "prompt": prompt})
    error = _assert_error(response, 400, "max_model_len")
    assert error["param"] == "prompt"
    stream = {**GOOD, "prompt": prompt, "stream": True}
    _assert_error(httpx.post(f"{server.url}/v1/completions", json=stream), 400, "max_model_len")
    _assert_serving(server.url)


def test_prompt_plus_max_tokens_over_max_model_len_is_clamped(server):
    # ketch clamps the output to the context (vLLM would answer 400): 500 + 600 > 512.
    body = {**GOOD, "prompt": [100] * 500, "max_tokens": 600, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == 500
    assert out["usage"]["total_tokens"] == 512


def test_token_id_prompt_errors(server):
    url = f"{server.url}/v1/completions"
    _assert_error(httpx.post(url, json={**GOOD, "prompt": [-1, 5]}), 400, "negative")
    _assert_error(httpx.post(url, json={**GOOD, "prompt": [10**9]}), 400, "outside")
    _assert_error(httpx.post(url, json={**GOOD, "prompt": [1] * 600}), 400, "max_model_len")
    _assert_serving(server.url)


@pytest.mark.parametrize(
    ("path", "fields", "ids", "params"),
    [
        ("/v1/completions", {"prompt": [5, 10**9]}, [5, 10**9], {}),
        ("/v1/completions", {"prompt": [1] * 600}, [1] * 600, {}),
        ("/v1/completions", {"prompt": [5], "stop_token_ids": [2000]}, [5],
         {"stop_token_ids": [2000]}),
        ("/v1/embeddings", {"input": [[7] * 513]}, [7] * 513, {"pooling": "last"}),
    ],
    ids=["outside-vocab", "too-long", "stop-ids", "embedding-too-long"],
)  # fmt: skip
def test_prompt_refusals_are_the_request_check_s_words(server, path, fields, ids, params):
    """The one request check (``request_checks``, which ``LLM`` and the engine use too): a 400
    naming the field, in its words; the server keeps serving."""
    field = "input" if path == "/v1/embeddings" else "prompt"
    with pytest.raises(RequestCheckError) as expected:
        check_prompt(PromptLimits(1024, 512), ids, SamplingParams(**params), field, 0)
    body = {"model": "tiny", **fields} if field == "input" else {**GOOD, **fields}
    error = _assert_error(httpx.post(f"{server.url}{path}", json=body), 400)
    assert (error["message"], error["param"]) == (str(expected.value), expected.value.param)
    _assert_serving(server.url)


def test_unknown_model_is_404(server):
    response = httpx.post(f"{server.url}/v1/completions", json={**GOOD, "model": "gpt-9"})
    error = _assert_error(response, 404, "gpt-9")
    assert error["code"] == "model_not_found"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="Hello", max_tokens=2)
    _assert_serving(server.url)


def test_10_mb_body_is_refused(server):
    body = b'{"model": "tiny", "prompt": "' + b"a" * (10 << 20) + b'"}'
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code in (400, 413), response.text
    _assert_error(response, response.status_code, "body")
    _assert_serving(server.url)


def test_10_mb_chunked_body_is_refused(server):
    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must hold while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}'

    response = httpx.post(
        f"{server.url}/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code in (400, 413), response.text
    _assert_serving(server.url)


# ---- access control and overload: one small dedicated server ----

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {
    "model": "tiny",
    "prompt": "Once upon a time",
    "max_tokens": 480,
    "ignore_eos": True,
    "temperature": 0,
    "n": 8,
    "stream": True,
}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    # Each of the test's two long streams asks for 8 sequences: together they fill the limit.
    with running_server("--api-key-file", str(key_file), "--max-concurrency", "16") as srv:
        yield srv


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"X-Api-Key": KEY}],
    ids=["missing", "wrong", "no-scheme", "other-header"],
)
def test_api_key_required_on_v1(guarded, headers):
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", GOOD),
        ("POST", "/v1/chat/completions", {"model": "tiny", "messages": []}),
        *KEYED_UTILITIES,
    ]:
        response = httpx.request(method, f"{guarded.url}{path}", json=body, headers=headers)
        error = _assert_error(response, 401, "key")
        assert error["type"] == "authentication_error"
    _assert_serving(guarded.url, AUTH)


KEYED_UTILITIES = [
    ("POST", "/tokenize", {"prompt": "Hello"}),
    ("POST", "/detokenize", {"tokens": [5]}),
    ("GET", "/version", None),
]


def test_tokenize_detokenize_and_version_answer_with_the_key(guarded):
    for method, path, body in KEYED_UTILITIES:
        response = httpx.request(method, f"{guarded.url}{path}", json=body, headers=AUTH)
        assert response.status_code == 200, (path, response.text)


def test_open_paths_need_no_key(guarded):
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{guarded.url}{path}").status_code == 200, path


def test_openai_client_with_key(guarded):
    good = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
    bad = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="Hi", max_tokens=2)


def test_over_max_concurrency_is_429_with_retry_after(guarded):
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60))
        streams = []  # kept referenced: a collected line iterator closes its response
        for _ in range(2):  # two long streams of n=8 in flight: the limit of 16 sequences
            response = stack.enter_context(client.stream("POST", "/v1/completions", json=LONG))
            assert response.status_code == 200
            streams.append(sse_events(response.iter_lines()))
            first = next(streams[-1])
            assert isinstance(first, dict) and first["choices"]
        extra = httpx.post(f"{guarded.url}/v1/completions", json=GOOD, headers=AUTH)
        error = _assert_error(extra, 429, "too many")
        assert error["type"] == "rate_limit_error"
        assert int(extra.headers["retry-after"]) >= 1
        client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2)

    # The streams are closed (aborted); once the server sees it, it admits again.
    def admitted() -> bool:
        r = httpx.post(f"{guarded.url}/v1/completions", json=GOOD, headers=AUTH, timeout=30)
        assert r.status_code in (200, 429), r.text
        return r.status_code == 200

    wait_for(admitted, 30, "the server to admit requests after the streams closed", 0.1)
