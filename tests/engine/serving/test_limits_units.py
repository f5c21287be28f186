"""Limits and failure modes of the structured-output, tool-call and chat-template code, in
process (security review H1, L8, M6; issue 28): each bad input is a ValueError (the API
server's 400) or plain content, never a RecursionError, TypeError or a minute of work.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from ketch.engine.models.paths import resolve_model_path
from ketch.engine.serving.config import ServerConfig
from ketch.engine.serving.guided import GuidedError
from ketch.engine.serving.responses import ResponseMeta, usage
from ketch.engine.serving.tool_parsers import hermes, llama3_json, mistral
from ketch.engine.serving.tools import ToolPlan
from ketch.engine.structured import grammars
from ketch.engine.tokenizer import Tokenizer

# What this module checks is new (issue 28); the names it needs are imported in each test, so
# that against the code before it each test fails on its own.

TINY = resolve_model_path("tiny")
DEEP = 5000


def deep_json(depth: int = DEEP) -> str:
    return '{"a":' * depth + "1" + "}" * depth


# ---- sizes, depth and node counts, before any work ----


@pytest.mark.parametrize(
    "build, value, words",
    [
        (grammars.json_schema, deep_json(), "--max-schema-depth"),  # RecursionError before
        (grammars.json_schema, json.loads(deep_json(150)), "--max-schema-depth"),
        (grammars.json_schema, {"enum": list(range(30_000))}, "--max-schema-nodes"),
        (grammars.json_schema, {"description": "x" * 70_000}, "--max-grammar-bytes"),
        (grammars.grammar, 'root ::= "a"\n' * 6000, "--max-grammar-bytes"),
        (grammars.regex, "a" * 70_000, "--max-grammar-bytes"),
        (grammars.choice, [f"{i:04}" + "x" * 100 for i in range(1000)], "--max-grammar-bytes"),
    ],
    ids=["text-deep", "object-deep", "nodes", "schema-bytes", "gbnf-bytes", "regex", "choice"],
)
def test_inputs_over_the_limits_are_refused_at_once(build, value, words: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ValueError, match=words):
        build(value)
    assert time.perf_counter() - start < 0.5


def test_the_limits_come_from_the_server_config() -> None:
    from ketch.engine.structured.grammars import Limits

    config = ServerConfig(max_grammar_bytes=100, max_schema_depth=3, max_schema_nodes=50)
    limits = config.grammar_limits()
    assert limits == Limits(100, 3, 50)
    grammars.check_shape({"a": {"b": 1}}, limits)
    with pytest.raises(ValueError, match=r"accepts at most 3 \(--max-schema-depth\)"):
        grammars.check_shape({"a": {"b": {"c": 1}}}, limits)
    with pytest.raises(ValueError, match=r"at most 100 \(--max-grammar-bytes\)"):
        grammars.regex("a" * 101, limits)
    defaults = ServerConfig()
    assert defaults.max_grammar_bytes == 65536 and defaults.grammar_timeout == 5.0
    assert not defaults.enable_prompt_tokens_details
    for bad in ({"grammar_timeout": 0}, {"max_grammar_bytes": 0}, {"max_grammar_queue": -1}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)
    # extreme values: nan passes every comparison, inf never times out, and huge counts would
    # cost the server itself (processes, queued inputs, recursion)
    for bad, words in (
        ({"grammar_timeout": float("nan")}, "finite"),
        ({"grammar_timeout": float("inf")}, "finite"),
        ({"drain_timeout": float("nan")}, "finite"),
        ({"grammar_workers": 10**6}, "at most 64"),
        ({"max_grammar_queue": 10**30}, "at most 65536"),
        ({"max_schema_depth": 10**4}, "at most 256"),
        ({"grammar_workers": True}, "positive integer"),
        ({"grammar_timeout": "5"}, ">= 0.001 seconds"),
    ):
        with pytest.raises(ValueError, match=words):
            ServerConfig(**bad)


def test_a_deeply_nested_guided_json_is_a_guided_error_naming_the_field() -> None:
    from ketch.engine.serving.guided import Recipe

    with pytest.raises(GuidedError, match=r"guided_json: .*nests 5000 levels deep") as refused:
        Recipe("guided_json", "json", deep_json()).build()
    assert refused.value.param == "guided_json"


# ---- the grammar service: worker process, budget, caches ----


def gbnf(rules: int) -> str:
    lines = ["root ::= r0", *(f'r{i} ::= "a{i}" | "b{i}" r{i + 1}' for i in range(rules))]
    return "\n".join([*lines, f'r{rules} ::= "z"']) + "\n"


def test_the_grammar_service_kills_a_job_over_budget_and_remembers_refusals() -> None:
    from ketch.engine.serving import offload
    from ketch.engine.serving.guided import GrammarService, Recipe
    from ketch.engine.structured.grammars import Limits

    async def scenario() -> None:
        tokenizer = Tokenizer(TINY)
        service = GrammarService(
            TINY / "tokenizer.json", tokenizer.vocab_size, [tokenizer.eos_token_id or 0],
            limits=Limits(max_bytes=200_000), timeout=0.5, workers=1, max_waiting=1,
        )  # fmt: skip
        ticks: list[float] = []

        async def tick() -> None:  # the event loop stays free all along
            while True:
                start = time.monotonic()
                await asyncio.sleep(0.005)
                ticks.append(time.monotonic() - start)

        ticker = asyncio.create_task(tick())
        try:
            good = await service.grammar(Recipe("guided_choice", "choice", ["yes", "no"]))
            assert "yes" in good and service.results["compiled"] == 1
            assert await service.grammar(Recipe("structured_outputs.choice", "choice",
                                                ["yes", "no"])) == good  # fmt: skip
            assert service.results["cached"] == 1
            (worker,) = service.pool.pids
            # The same new input from two clients at once is built once.
            same = [Recipe(f"f{i}", "regex", "[0-9]{2,3}") for i in range(2)]
            first, second = await asyncio.gather(*(service.grammar(r) for r in same))
            assert first == second
            assert service.results["compiled"] == 2 and service.results["cached"] == 2
            slow = Recipe("guided_grammar", "grammar", gbnf(3000))
            with pytest.raises(GuidedError, match=r"within 0\.5 s \(--grammar-timeout\)"):
                await service.grammar(slow)
            assert service.pool.killed == 1 and service.pool.pids == []
            assert not Path(f"/proc/{worker}").exists()
            start = time.monotonic()
            with pytest.raises(GuidedError, match="--grammar-timeout"):
                await service.grammar(slow)
            assert time.monotonic() - start < 0.05 and service.results["refused_cached"] == 1
            with pytest.raises(GuidedError, match="unknown name"):  # does not compile
                await service.grammar(Recipe("guided_grammar", "grammar", "start: foo"))
            # One runs, one waits, the rest are refused at once (503).
            jobs = [service.grammar(Recipe("g", "grammar", gbnf(2000 + i))) for i in range(4)]
            outcomes = await asyncio.gather(*jobs, return_exceptions=True)
            assert sum(isinstance(o, offload.Busy) for o in outcomes) == 2, outcomes
            # The loop never waited for the conversions (seconds each); the bound leaves room
            # for this test process's own collector (the server's probes have theirs: 100 ms,
            # test_offloop_serving.py).
            assert max(ticks) < 0.25, max(ticks)
        finally:
            ticker.cancel()
            service.close()

    asyncio.run(scenario())


# ---- L8: model output never raises ----


@pytest.mark.parametrize(
    "parser, text",
    [
        (hermes, f"<tool_call>{deep_json()}</tool_call>"),
        (hermes, '<tool_call>{"name": "f", "arguments": ' + deep_json() + "}</tool_call>"),
        (llama3_json, deep_json()),
        (mistral, f"[TOOL_CALLS][{deep_json()}]"),
        (mistral, "[TOOL_CALLS]" + "[" * DEEP + "]" * DEEP),
    ],
)
def test_deeply_nested_model_output_is_content_not_an_error(parser, text: str) -> None:
    content, calls = parser(text)
    assert calls == [] and content is not None


def test_hermes_parsing_is_linear_in_unclosed_tags() -> None:
    text = "<tool_call>" * 5_000 + "x" * 20_000
    start = time.perf_counter()
    assert hermes(text) == (text, [])
    assert time.perf_counter() - start < 0.5
    good = 'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b <tool_call>no'
    assert hermes(good) == ("a  b <tool_call>no", [("f", '{"x": 1}')])


def test_a_required_call_with_the_wrong_shapes_is_content() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    plan = ToolPlan([tool], "required")
    for text in ('{"name": "f"}', '[{"name": "f"}]', "[1, 2]", deep_json()):
        assert plan.calls(text) == (text, [])
    assert plan.calls('[{"name": "f", "parameters": {}}]') == (None, [("f", "{}")])


# ---- L8: chat templates that raise other than TemplateError ----


def tokenizer_with_template(directory: Path, template: str) -> Tokenizer:
    shutil.copy(TINY / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(directory)


@pytest.mark.parametrize(
    "template, extra, error",
    [
        ("{{ messages[0].role + messages[0].weight }}", {"weight": 1}, "TypeError"),
        ("{{ 1 // messages[0].ratio }}", {"ratio": 0}, "ZeroDivisionError"),
        ("{{ messages[0].tools | length }}", {"tools": 5}, "TypeError"),
    ],
)
def test_template_errors_of_any_type_are_value_errors(
    tmp_path: Path, template: str, extra: dict, error: str
) -> None:
    """Messages' extra fields reach the template, which may meet a shape it does not expect:
    a ValueError (the API server's 400 naming ``messages``), not a 500 with a traceback."""
    tokenizer = tokenizer_with_template(tmp_path, template)
    with pytest.raises(ValueError, match=f"cannot render these messages: {error}"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi", **extra}])


# ---- M6: cached tokens only when the server reports them ----


def test_usage_reports_cached_tokens_only_when_asked() -> None:
    assert usage(5, 2) == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert ResponseMeta.chat("m").usage(5, 2, 64) == usage(5, 2)
    shown = ResponseMeta.chat("m", prompt_tokens_details=True).usage(5, 2, 64)
    assert shown["prompt_tokens_details"] == {"cached_tokens": 64}


# ---- tokenising long texts lets other threads run ----


def test_long_texts_tokenise_with_the_gil_released() -> None:
    """``Tokenizer.encode`` used to hold the GIL (about a second per MiB): a thread doing it
    stalled the event loop's thread as badly as doing it on the loop."""
    tokenizer = Tokenizer(TINY)
    text = ("Alice was beginning to get very tired of sitting by her sister. " * 17_000)[: 1 << 20]
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        ids = tokenizer.encode(text)
        back = tokenizer.decode(ids)
    finally:
        done.set()
        ticker.join()
    assert max(gaps) < 0.1, max(gaps)  # converting 300 k ids to and from Python: ~20 ms
    assert ids == tokenizer._tok.encode(text).ids and back == text
