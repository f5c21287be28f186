"""The structured-output fields of a request, and the check that their grammar compiles.

Clients spell "constrain the output" several ways; all of them end as one grammar text in
``SamplingParams.grammar``:

- OpenAI's ``response_format``: ``{"type": "json_object"}``, or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (``{"type": "text"}`` changes nothing);
- vLLM's extras ``guided_json`` (a schema, or its JSON text), ``guided_regex``,
  ``guided_choice`` (a list of strings) and ``guided_grammar`` (Lark or GBNF);
- vLLM's newer ``structured_outputs`` object with one of ``json``, ``regex``, ``choice``,
  ``grammar`` or ``json_object: true``.

A request gives at most one of them. Every problem is a ``GuidedError`` naming the field.

What a request asks for is first a ``Recipe`` (cheap: which field, which kind, its value). The
API server then checks its size against ``grammars.Limits`` (``--max-grammar-bytes``,
``--max-schema-depth``, ``--max-schema-nodes``) and builds and compiles it with
``GrammarService``: off the event loop, in a worker process, within ``--grammar-timeout``
seconds, so a bad grammar is a 400 here and never reaches the engine. Grammars that compiled
and inputs that were refused are both remembered (by a hash of the input), so a resent one
costs no work either way. ``grammar_source`` builds one in the calling thread (offline use,
tests).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, PrivateAttr

from ketch.engine.serving.offload import JobFailed, JobTimeout, ProcessPool
from ketch.engine.structured import grammars
from ketch.engine.structured.grammars import DEFAULT_LIMITS, Limits

_KINDS = ("json", "regex", "choice", "grammar")
_NOUNS = {"json": "JSON schema", "regex": "regex", "choice": "list of choices",
          "grammar": "grammar"}  # fmt: skip
_IGNORED_KEYS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                 "whitespace_pattern", "backend", "structural_tag"}  # fmt: skip
JSON_OBJECT = {"type": "object"}
MAX_MESSAGE = 500
"""Longest refusal text kept from a builder or compiler (they may quote the input)."""


class GuidedError(ValueError):
    """A structured-output field that is wrong; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class GuidedFields(BaseModel):
    """The structured-output fields both generation endpoints accept."""

    model_config = ConfigDict(strict=True, extra="ignore")

    response_format: dict[str, Any] | None = None
    guided_json: Any = None  # a schema or its JSON text: checked by grammars.json_schema
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    _recipe: tuple[Recipe | None] | None = PrivateAttr(None)
    _source: tuple[tuple[str, str] | None] | None = PrivateAttr(None)

    def grammar_recipe(self) -> Recipe | None:
        """What the output is constrained with, not built yet (None: nothing); GuidedError
        naming the field if the request asks wrongly."""
        if self._recipe is None:
            self._recipe = (self._make_recipe(),)
        return self._recipe[0]

    def grammar_source(self) -> tuple[str, str] | None:
        """(the grammar text, the field it came from), or None; GuidedError if wrong. Built
        here, in the calling thread, unless ``use_grammar`` gave it (the API server's way)."""
        if self._source is None:
            recipe = self.grammar_recipe()
            self._source = (None if recipe is None else (recipe.build(), recipe.param),)
        return self._source[0]

    def use_grammar(self, grammar: str) -> None:
        """Sets the grammar built (elsewhere) from this request's recipe."""
        recipe = self.grammar_recipe()
        self._source = (None if recipe is None else (grammar, recipe.param),)

    def _make_recipe(self) -> Recipe | None:
        given = [
            (name, value)
            for name in ("response_format", "structured_outputs", *_GUIDED)
            if (value := getattr(self, name)) is not None
            and not (name == "response_format" and value.get("type") == "text")
        ]
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise GuidedError(given[1][0], f"give one way of constraining the output, not {names}")
        name, value = given[0]
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return _structured_outputs(value)
        return Recipe(name, name.removeprefix("guided_"), value)


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class Recipe:
    """How to build one request's grammar: the field (``param``, named in every refusal), the
    kind (json, regex, choice or grammar) and the value as the client sent it."""

    param: str
    kind: str
    value: Any
    strict: bool = False  # json: OpenAI's json_schema.strict

    def text(self, limits: Limits = DEFAULT_LIMITS) -> str:
        """The input as one text, within ``limits`` (GuidedError naming the field otherwise):
        a schema's compact JSON, the choices' JSON list, the regex or grammar as given. Cheap:
        linear in the input, which the limits bound."""
        try:
            if self.kind == "json":
                return grammars.schema_text(self.value, limits)
            if self.kind == "choice":
                grammars.choice_options(self.value)
                text = json.dumps(self.value, ensure_ascii=False)
                grammars.check_size(_NOUNS[self.kind], text, limits)
                return text
            if not isinstance(self.value, str) or not self.value.strip():
                raise ValueError(f"the {_NOUNS[self.kind]} must be a non-empty string")
            grammars.check_size(_NOUNS[self.kind], self.value, limits)
            return self.value
        except ValueError as exc:
            raise GuidedError(self.param, f"{self.param}: {exc}") from None

    def build(self, limits: Limits = DEFAULT_LIMITS) -> str:
        """The grammar, built in this thread (no compile check); GuidedError if it cannot be."""
        text = self.text(limits)
        try:
            return build(self.kind, text, self.strict, limits)
        except ValueError as exc:
            raise GuidedError(self.param, f"{self.param}: {exc}") from None


def build(kind: str, text: str, strict: bool = False, limits: Limits = DEFAULT_LIMITS) -> str:
    """The grammar for ``Recipe.text``'s output; ValueError saying why not. The costly part."""
    if kind == "json":
        return grammars.json_schema(text, strict, limits)
    if kind == "choice":
        return grammars.choice(json.loads(text), limits)
    if kind == "regex":
        return grammars.regex(text, limits)
    return grammars.grammar(text, limits)


def _response_format(value: dict[str, Any]) -> Recipe:
    kind = value.get("type")
    if kind == "json_object":
        return Recipe("response_format", "json", JSON_OBJECT)
    if kind != "json_schema":
        raise GuidedError(
            "response_format",
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise GuidedError(
            "response_format", "response_format.json_schema must be an object with a 'schema'"
        )
    strict = spec.get("strict")
    if not isinstance(strict, bool | None):
        raise GuidedError("response_format", "response_format.json_schema.strict must be a bool")
    return Recipe("response_format.json_schema.schema", "json", spec["schema"], bool(strict))


def _structured_outputs(value: dict[str, Any]) -> Recipe:
    kinds = [k for k in (*_KINDS, "json_object") if value.get(k) not in (None, False)]
    unknown = sorted(set(value) - set(_KINDS) - {"json_object"} - _IGNORED_KEYS)
    if unknown:
        raise GuidedError("structured_outputs", f"structured_outputs: unknown key {unknown[0]!r}")
    if len(kinds) != 1:
        raise GuidedError(
            "structured_outputs",
            "structured_outputs must give exactly one of json, regex, choice, grammar, "
            f"json_object (got {', '.join(kinds) or 'none'})",
        )
    kind = kinds[0]
    if kind == "json_object":
        if value[kind] is not True:
            raise GuidedError("structured_outputs", "structured_outputs.json_object must be true")
        return Recipe("structured_outputs.json_object", "json", JSON_OBJECT)
    return Recipe(f"structured_outputs.{kind}", kind, value[kind])


class GrammarService:
    """The API server's structured-output checks, off its event loop: limits first, then the
    caches, then a worker process (``ProcessPool``) that builds and compiles the grammar within
    ``timeout`` seconds. Refusals (invalid, over the budget, failed) are cached as answers
    too, keyed by a hash of the input, so a resend is refused at once."""

    def __init__(
        self,
        tokenizer_file: Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        limits: Limits = DEFAULT_LIMITS,
        timeout: float = 5.0,
        workers: int = 2,
        max_waiting: int = 16,
        cache_size: int = grammars.SCHEMA_CACHE_SIZE,
        refusal_cache_size: int = 1024,
    ) -> None:
        self.limits = limits
        self.timeout = timeout
        self.pool = ProcessPool(
            "grammar",
            workers,
            max_waiting,
            busy="checking structured-output grammars",
            init=worker_init,
            init_args=(str(tokenizer_file), vocab_size, list(eos_token_ids)),
        )
        self._built: OrderedDict[bytes, str] = OrderedDict()
        self._refused: OrderedDict[bytes, str] = OrderedDict()
        self._cache_size = cache_size
        self._refusal_cache_size = refusal_cache_size
        self._building: dict[bytes, asyncio.Future[tuple[str, str]]] = {}
        self.results = dict.fromkeys(RESULTS, 0)

    async def prepare(self, request: GuidedFields) -> None:
        """Builds and checks ``request``'s grammar, if it asks for one, and sets it on the
        request (``use_grammar``). GuidedError (400) naming the field; ``offload.Busy`` when
        too many grammars wait for a worker."""
        recipe = request.grammar_recipe()
        if recipe is not None:
            request.use_grammar(await self.grammar(recipe))

    async def grammar(self, recipe: Recipe) -> str:
        text = recipe.text(self.limits)  # sizes first: GuidedError before any work
        key = hashlib.sha256(
            f"{recipe.kind}\0{recipe.strict:d}\0".encode() + text.encode("utf-8", "surrogatepass")
        ).digest()
        if key in self._built:
            self._built.move_to_end(key)
            return self._count("cached", self._built[key])
        refused = self._refused.get(key)
        if refused is not None:
            self._refused.move_to_end(key)
            self._count("refused_cached")
            raise GuidedError(recipe.param, f"{recipe.param}: {refused}")
        job = self._building.get(key)  # the same input from several clients at once: one job
        joined = job is not None
        if job is None:
            job = asyncio.ensure_future(self._build(recipe.kind, text, recipe.strict, key))
            self._building[key] = job
            job.add_done_callback(lambda _: self._building.pop(key, None))
        kind, value = await asyncio.shield(job)
        if joined:
            self._count("cached" if kind == "ok" else "refused_cached")
        if kind == "ok":
            return value
        raise GuidedError(recipe.param, f"{recipe.param}: {value}")

    async def _build(self, kind: str, text: str, strict: bool, key: bytes) -> tuple[str, str]:
        """("ok", grammar) or ("refused", why), remembered either way; ``offload.Busy`` (not
        remembered) when the queue is full."""
        noun = _NOUNS[kind]
        try:
            outcome, value = await self.pool.run(
                worker_build, (kind, text, strict, self.limits), self.timeout
            )
        except JobTimeout:
            self._count("timed_out")
            outcome, value = (
                "refused",
                (
                    f"the {noun} could not be converted and compiled within {self.timeout:g} s "
                    "(--grammar-timeout); simplify it"
                ),
            )
        except JobFailed as exc:
            self._count("failed")
            outcome, value = "refused", f"the {noun} could not be built: {exc}"
        else:
            self._count("compiled" if outcome == "ok" else "refused")
        if outcome == "ok":
            self._remember(self._built, key, value, self._cache_size)
            return outcome, value
        value = value if len(value) <= MAX_MESSAGE else value[:MAX_MESSAGE] + "..."
        self._remember(self._refused, key, value, self._refusal_cache_size)
        return "refused", value

    def _count(self, result: str, value: Any = None) -> Any:
        self.results[result] += 1
        return value

    @staticmethod
    def _remember(cache: OrderedDict[bytes, str], key: bytes, value: str, size: int) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > size:
            cache.popitem(last=False)

    def collect(self) -> Iterator[Metric]:
        """The prometheus_client collector protocol (registered on the server's metrics)."""
        checks = CounterMetricFamily(
            "ketch:grammar_checks",
            "Structured-output grammars checked by the API server, by result: compiled, "
            "cached (compiled before), refused (invalid), refused_cached (refused before), "
            "timed_out (over --grammar-timeout; its worker was killed), failed.",
            labels=["result"],
        )
        for result, count in self.results.items():
            checks.add_metric([result], count)
        yield checks

    def close(self) -> None:
        self.pool.close()


RESULTS = ("compiled", "cached", "refused", "refused_cached", "timed_out", "failed")

# ---- in the worker process ----

_compiler: Any = None  # the worker's GrammarCompiler (``worker_init``)


def worker_init(tokenizer_file: str, vocab_size: int, eos_token_ids: list[int]) -> None:
    """A grammar worker's start: the model's llguidance tokenizer (a few hundred milliseconds
    for a large vocabulary) and the JSON Schema machinery, before any job's budget runs."""
    global _compiler
    from ketch.engine.structured.compiler import GrammarCompiler

    _compiler = GrammarCompiler(Path(tokenizer_file), vocab_size, eos_token_ids, cache_size=4)
    _compiler.check(grammars.json_object())


def worker_build(kind: str, text: str, strict: bool, limits: Limits) -> tuple[str, str]:
    """("ok", grammar) if ``text`` builds and compiles against the model, else ("refused",
    why). Runs in a grammar worker process, within the server's budget."""
    try:
        grammar = build(kind, text, strict, limits)
        if _compiler is not None:
            _compiler.check(grammar)
    except (ValueError, RecursionError) as exc:  # GrammarError is a ValueError
        why = str(exc) if not isinstance(exc, RecursionError) else "it nests too deeply"
        return "refused", why
    return "ok", grammar
