"""Structured outputs against a real ``ketch serve``, with the official ``openai`` client.

``chat.completions.parse`` with a pydantic model returns the parsed object on the tiny model and
on random test checkpoints; every way of asking (``response_format``, vLLM's ``guided_*``
extras, its ``structured_outputs`` object) constrains completions and chat; the constrained
output equals the offline engine's; bad schemas, regexes and grammars are 400s naming the
field; and a property test over generated JSON schemas shows every output parses and validates
against its schema, streamed and not, greedy and sampled.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field
from serve_harness import running_server

from ketch.engine import SamplingParams
from ketch.engine.structured import grammars

PROMPT = "Alice was beginning to get very tired"
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]
MAX_TOKENS = 300  # generous: a tiny model's JSON ends long before (finish_reason must be stop)


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")  # its schema has additionalProperties: false

    street: str = Field(max_length=16)
    number: int = Field(ge=1, le=999)


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10_000_000)
    kind: Literal["town", "city", "village"]
    capital: bool
    # Bounded strings: a tiny model may never close an unbounded one within max_tokens.
    districts: list[Annotated[str, Field(max_length=10)]] = Field(max_length=3)
    address: Address


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def _parse(client: openai.OpenAI, model: str, **extra: Any) -> Any:
    return client.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=City, max_tokens=MAX_TOKENS, **extra
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_returns_the_pydantic_object(client, temperature: float):
    out = _parse(client, "tiny", temperature=temperature, seed=3)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_parse_on_random_checkpoints(checkpoint, name: str):
    with running_server("--model", str(checkpoint(name)), "--served-model-name", name) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        for temperature in (0.0, 1.0):
            out = _parse(client, name, temperature=temperature, seed=5, n=2)
            for choice in out.choices:
                assert choice.finish_reason == "stop"
                assert isinstance(choice.message.parsed, City)


def test_the_constrained_output_equals_the_offline_engine(client, reference_llm):
    schema = City.model_json_schema()
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, grammar=grammars.json_schema(schema)
    )
    want = reference_llm.generate(PROMPT, params)[0].outputs[0].text
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"guided_json": schema},
    )  # fmt: skip
    assert out.choices[0].text == want
    City.model_validate_json(want)


def _ways(kind: str) -> list[dict[str, Any]]:
    """The request fields that ask for ``kind`` of output, in every spelling accepted."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    schema["additionalProperties"] = False  # open objects let a tiny model ramble on
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    pattern, options = r"[a-z]{2,6}-[0-9]{3}", ["yes", "no", "maybe"]
    return {
        "schema": [
            {"guided_json": schema},
            {"guided_json": json.dumps(schema)},
            {"structured_outputs": {"json": schema}},
            {"response_format": rf},
        ],
        "object": [
            {"response_format": {"type": "json_object"}},
            {"structured_outputs": {"json_object": True}},
        ],
        "regex": [{"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}],
        "choice": [{"guided_choice": options}, {"structured_outputs": {"choice": options}}],
        "grammar": [
            {"guided_grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/\n'},
            {"guided_grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] [0-9]?\n'},
            {"structured_outputs": {"grammar": 'start: "(" NUM ")"\nNUM: /[0-9]{1,3}/\n'}},
        ],
    }[kind]  # fmt: skip


def _check(kind: str, text: str, reason: str) -> None:
    if kind == "object" and reason == "length":  # any object: a tiny model may ramble in a key
        assert text.startswith('{"'), text
        return
    assert reason == "stop", (kind, text)
    if kind == "schema":
        assert isinstance(json.loads(text)["ok"], bool), text
    elif kind == "object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(r"[a-z]{2,6}-[0-9]{3}", text), text
    elif kind == "choice":
        assert text in ("yes", "no", "maybe"), text
    else:
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text), text


@pytest.mark.parametrize("kind", ["schema", "object", "regex", "choice", "grammar"])
def test_every_spelling_constrains_completions_and_chat(client, kind: str):
    for fields in _ways(kind):
        for temperature in (0.0, 1.0):
            common = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": temperature}
            common["seed"] = 7
            if "response_format" not in fields:
                out = client.completions.create(prompt=PROMPT, extra_body=fields, **common)
                _check(kind, out.choices[0].text, out.choices[0].finish_reason)
            chat = client.chat.completions.create(messages=MESSAGES, extra_body=fields, **common)
            _check(kind, chat.choices[0].message.content, chat.choices[0].finish_reason)


def test_response_format_on_completions_too(client):
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert isinstance(json.loads(out.choices[0].text), dict)


def test_strict_closes_objects(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    for seed in range(3):
        chat = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
            response_format=rf,
        )  # fmt: skip
        assert list(json.loads(chat.choices[0].message.content)) == ["a"]


def test_text_response_format_changes_nothing(client):
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0
    )
    text = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
        response_format={"type": "text"},
    )  # fmt: skip
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"guided_json": {"type": "strin"}}, "guided_json", "invalid JSON schema"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_grammar": "start: nothing_defined"}, "guided_grammar", "unknown name"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown key 'jsn'"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one way"),
        ({"response_format": {"type": "xml"}}, "response_format", "'xml'"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'schema'"),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"schema": {"minimum": "x"}}}},
            "response_format.json_schema.schema",
            "invalid JSON schema",
        ),
    ],
)  # fmt: skip
def test_bad_structured_output_requests_are_400_naming_the_field(
    client, fields: dict, param: str, words: str
):
    for call in (
        lambda: client.completions.create(model="tiny", prompt=PROMPT, extra_body=fields),
        lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=fields),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        body = info.value.body
        assert body["param"] == param and words in body["message"], body


# ---- the property: every constrained output parses and validates ----

_NAMES = st.sampled_from(["a", "b", "id", "name", "value", "items", "x_y"])
_LEAVES = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000), st.integers(0, 5000),
    ),
    # A number's fractional digits are bounded only by multipleOf: without it a model may run
    # through near-tied digit tokens until max_tokens, and where that happens depends on the
    # last bits of the logits (so on the machine).
    st.builds(
        lambda lo, span, step: {"type": "number", "minimum": lo, "maximum": lo + span,
                                "multipleOf": step},
        st.integers(-100, 100), st.integers(1, 1000), st.sampled_from([0.5, 0.25, 0.01]),
    ),
    st.builds(
        lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
        st.integers(0, 3), st.integers(0, 12),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.one_of(st.text("abcxyz _", min_size=1, max_size=8), st.integers(-50, 50)),
             min_size=1, max_size=4, unique=True).map(lambda values: {"enum": values}),
)  # fmt: skip


def _object(props: dict[str, Any], required: list[bool]) -> dict[str, Any]:
    names = sorted(props)
    return {
        "type": "object",
        "properties": props,
        "required": [n for n, r in zip(names, required, strict=False) if r],
        "additionalProperties": False,
    }


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    arrays = st.builds(
        lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo,
                                 "maxItems": lo + extra},
        children, st.integers(0, 1), st.integers(0, 2),
    )  # fmt: skip
    objects = st.builds(
        _object,
        st.dictionaries(_NAMES, children, min_size=1, max_size=3),
        st.lists(st.booleans(), min_size=3, max_size=3),
    )
    return st.one_of(arrays, objects)


_VALUES = st.recursive(_LEAVES, _containers, max_leaves=5)
SCHEMAS = st.builds(
    _object,
    st.dictionaries(_NAMES, _VALUES, min_size=1, max_size=3),
    st.lists(st.booleans(), min_size=3, max_size=3),
)  # fmt: skip


def _generate(client: openai.OpenAI, schema: dict, chat: bool, stream: bool, seed: int | None):
    """The text and finish reason of one constrained request."""
    common: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "stream": stream}
    common.update(temperature=0.0 if seed is None else 1.0, seed=seed)
    if chat:
        rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
        out = client.chat.completions.create(messages=MESSAGES, response_format=rf, **common)
    else:
        out = client.completions.create(prompt=PROMPT, extra_body={"guided_json": schema}, **common)
    if not stream:
        c = out.choices[0]
        return (c.message.content if chat else c.text), c.finish_reason
    text, reason = "", None
    for chunk in out:
        for c in chunk.choices:
            text += (c.delta.content or "") if chat else c.text
            reason = c.finish_reason or reason
    return text, reason


@settings(
    max_examples=24, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
@given(
    schema=SCHEMAS,
    chat=st.booleans(),
    stream=st.booleans(),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
)
def test_every_constrained_output_validates(client, schema, chat, stream, seed):
    text, reason = _generate(client, schema, chat, stream, seed)
    assert reason == "stop", (schema, text)
    jsonschema.validate(json.loads(text), schema)
