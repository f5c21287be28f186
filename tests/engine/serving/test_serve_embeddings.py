"""``POST /v1/embeddings`` on a real ``ketch serve``, with the official ``openai`` client: the
vectors equal Hugging Face's final hidden states pooled the same way (the tiny model), in both
encodings, for every input shape; every accepted parameter does what it says, every refused one
is a 400 naming it, hostile bodies leave the server serving, and the requests count in the
metrics as prompt-only requests.
"""

from __future__ import annotations

import base64
import subprocess

import httpx
import numpy as np
import openai
import pytest
import torch
from serve_harness import KETCH, assert_exact_and_idle, metric, running_server, scrape, wait_for

from hf_models import hf_model
from ketch.engine.models.loader import TINY_MODEL_DIR

TEXTS = ["Alice was beginning to get very tired", "The rabbit", "Down, down, down"]
HIDDEN = 128  # the tiny model's hidden size
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf():
    return hf_model(TINY_MODEL_DIR)


def want(hf, ids: list[int], pooling: str = "last", normalize: bool = True) -> np.ndarray:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].double()
    vector = (hidden[-1] if pooling == "last" else hidden.mean(0)).numpy()
    return vector / np.linalg.norm(vector) if normalize else vector


def assert_close(got, expected: np.ndarray) -> None:
    actual = np.asarray(got, dtype=np.float64)
    assert actual.shape == expected.shape
    rel = np.abs(actual - expected).max() / np.abs(expected).max()
    assert rel <= TOLERANCE, f"relative error {rel:.2e}"


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def post(server, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)


def test_embeddings_equal_transformers_for_every_input_shape(server, reference_llm, hf) -> None:
    client = client_for(server)
    tokenizer = reference_llm.tokenizer
    ids = [tokenizer.encode(t) for t in TEXTS]
    for given, prompts in (
        (TEXTS[0], ids[:1]),  # one string
        (TEXTS, ids),  # a list of strings
        (ids[1], ids[1:2]),  # one list of token ids
        (ids, ids),  # a list of lists of token ids
    ):
        # The client asks for base64 by default and decodes it (little-endian float32).
        out = client.embeddings.create(model="tiny", input=given)
        assert out.object == "list" and out.model == "tiny"
        assert [d.index for d in out.data] == list(range(len(prompts)))
        assert all(d.object == "embedding" and len(d.embedding) == HIDDEN for d in out.data)
        for datum, prompt in zip(out.data, prompts, strict=True):
            assert_close(datum.embedding, want(hf, prompt))
        tokens = sum(map(len, prompts))
        assert out.usage.prompt_tokens == out.usage.total_tokens == tokens
        floats = client.embeddings.create(model="tiny", input=given, encoding_format="float")
        for a, b in zip(floats.data, out.data, strict=True):
            np.testing.assert_allclose(a.embedding, b.embedding, rtol=1e-6, atol=1e-7)


def test_base64_is_little_endian_float32(server) -> None:
    floats = post(server, {"model": "tiny", "input": TEXTS[0], "encoding_format": "float"}).json()
    raw = post(server, {"model": "tiny", "input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    expected = np.asarray(floats["data"][0]["embedding"], dtype=np.float32)
    assert decoded.tolist() == expected.tolist()
    assert raw["usage"] == floats["usage"] and raw["id"].startswith("embd-")


def test_pooling_normalize_dimensions_and_user(server, reference_llm, hf) -> None:
    client = client_for(server)
    prompt = reference_llm.tokenizer.encode(TEXTS[0])
    for pooling in ("last", "mean"):
        for normalize in (True, False):
            out = client.embeddings.create(
                model="tiny", input=TEXTS[0], encoding_format="float",
                extra_body={"pooling": pooling, "normalize": normalize},
            )  # fmt: skip
            assert_close(out.data[0].embedding, want(hf, prompt, pooling, normalize))
            if not normalize:  # the raw hidden state is not a unit vector
                assert abs(np.linalg.norm(out.data[0].embedding) - 1) > 1e-3
    same = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=HIDDEN, user="u-1")
    assert_close(same.data[0].embedding, want(hf, prompt))


def test_the_server_default_pooling_comes_from_its_flag(reference_llm, hf) -> None:
    with running_server("--embedding-pooling", "mean", "--max-concurrency", "2") as srv:
        with pytest.raises(openai.BadRequestError, match="max-concurrency") as info:
            client_for(srv).embeddings.create(model="tiny", input=TEXTS)  # 3 inputs > 2
        assert info.value.body["param"] == "input"
        prompt = reference_llm.tokenizer.encode(TEXTS[1])
        out = client_for(srv).embeddings.create(model="tiny", input=TEXTS[1])
        assert_close(out.data[0].embedding, want(hf, prompt, "mean"))
        last = client_for(srv).embeddings.create(
            model="tiny", input=TEXTS[1], extra_body={"pooling": "last"}
        )
        assert_close(last.data[0].embedding, want(hf, prompt, "last"))


def test_serve_help_documents_the_flag() -> None:
    shown = subprocess.run(
        [KETCH, "serve", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "--embedding-pooling {last,mean}" in shown and "mean" in shown


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"dimensions": 64}, "dimensions", "128 dimensions"),
        ({"dimensions": "128"}, "dimensions", "integer"),
        ({"encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
        ({"pooling": "max"}, "pooling", "'last' or 'mean'"),
        ({"normalize": "yes"}, "normalize", "boolean"),
        ({"user": 5}, "user", "string"),
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [""]}, "input", "empty string"),
        ({"input": [[]]}, "input", "empty list"),
        ({"input": [[5, 10**6]]}, "input", "outside the vocabulary [0, 1024)"),
        ({"input": [[5, -1]]}, "input", "negative"),
        ({"input": [[1, [2]]]}, "input", "a string or a list of token ids"),
        ({"input": {"text": "a"}}, "input", "non-empty string"),
        ({"input": 5}, "input", "non-empty string"),
        ({"input": [1.5]}, "input", "a string or a list of token ids"),
        ({"input": [7] * 513}, "input", "max_model_len is 512"),
        ({"input": ["a"] * 129}, "input", "at most 128"),
        ({"model": None}, "model", "string"),
    ],
)
def test_refusals_are_400_naming_the_field(server, fields: dict, param: str, words: str) -> None:
    body = {"model": "tiny", "input": "hello", **fields}
    standard = {"model", "input", "dimensions", "encoding_format", "user"}
    extra = {k: body.pop(k) for k in list(body) if k not in standard}
    with pytest.raises(openai.BadRequestError) as info:
        client_for(server).embeddings.create(**body, extra_body=extra)
    error = info.value.body
    assert info.value.status_code == 400
    assert error["param"] == param or error["param"].startswith(param + "["), error
    assert words in error["message"], error


def test_an_unknown_model_is_404(server) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client_for(server).embeddings.create(model="nope", input="hello")


def test_hostile_bodies_leave_the_server_serving(server, reference_llm) -> None:
    for body in (
        {"model": "tiny", "input": list(range(1000)) * 200},  # 200k token ids: over 1 MiB
        {"model": "tiny", "input": [[1]] * 5000},
        {"model": "tiny", "input": [[[[[[1]]]]]]},
        {"model": "tiny", "input": "x" * 5000},  # tokenises past max_model_len
        {"model": "tiny", "input": [None]},
        {"model": "tiny", "input": ["ok", {"a": 1}]},
        {"model": "tiny", "input": "hi", "dimensions": 2**70},
        {"model": "tiny", "input": [2**70]},
        [],
        "input",
    ):
        response = post(server, body)
        assert response.status_code in (400, 413), (str(body)[:80], response.text)
        assert "error" in response.json()
    response = httpx.post(
        f"{server.url}/v1/embeddings", content=b"{not json", timeout=30,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert response.status_code == 400
    assert server.proc.poll() is None
    assert_exact_and_idle(server.url, reference_llm)


def test_embedding_requests_count_as_prompt_only_requests(server) -> None:
    def idle() -> dict | None:
        s = scrape(server.url)
        return (
            s
            if metric(s, "num_requests_running") + metric(s, "num_requests_waiting") == 0
            else None
        )

    before = wait_for(idle, 30, "no request running")
    out = client_for(server).embeddings.create(model="tiny", input=TEXTS)
    after = scrape(server.url)

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    n = len(TEXTS)
    assert grew("requests_number") == n
    assert grew("request_success_total", finish_reason="stop") == n
    assert grew("prompt_tokens_total") == out.usage.prompt_tokens
    assert grew("request_prompt_tokens_sum") == out.usage.prompt_tokens
    assert grew("generation_tokens_total") == 0
    assert grew("time_to_first_token_seconds_count") == 0  # no token, so no TTFT
    assert grew("e2e_request_latency_seconds_count") == n
    assert grew("http_requests_total", path="/v1/embeddings", status_code="200") == 1
