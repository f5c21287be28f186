"""OpenAI-compatible requests and errors, and the mapping from a request to SamplingParams.

No HTTP here. The API server parses a body with ``parse_request``, checks the model name with
``check_model`` and builds ``SamplingParams`` with ``to_sampling_params``. Every problem is a
``ProtocolError``; ``error_body`` renders it in OpenAI's JSON shape.

Requests are validated strictly (a string where a number belongs is an error, not coerced), but
fields we do not know are ignored: OpenAI clients send fields that change nothing here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from ketch.engine.sampling_params import SamplingParams
from ketch.engine.serving.guided import GuidedError, GuidedFields
from ketch.engine.serving.template_kwargs import TemplateKwargs
from ketch.engine.serving.tools import ToolFields

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class ProtocolError(Exception):
    """A request refused with an HTTP status and the fields of OpenAI's error body.

    ``type`` defaults from the status: 400 invalid_request_error, 401 authentication_error,
    404 not_found_error, 429 rate_limit_error, 5xx server_error.
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        type: str | None = None,  # OpenAI's field name
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.type = type or _default_type(status_code)
        self.code = code


def _default_type(status_code: int) -> str:
    if status_code >= 500:
        return "server_error"
    return _ERROR_TYPES.get(status_code, "invalid_request_error")


def error_body(error: ProtocolError) -> dict[str, Any]:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def validation_error(exc: ValidationError) -> ProtocolError:
    """A 400 naming each bad field and its problem in plain words (no pydantic URLs)."""
    problems: list[str] = []
    params: list[str] = []
    for err in exc.errors(include_url=False):
        path = _field_path(err["loc"])
        problems.append(f"{path or 'request body'}: {_plain_message(err)}")
        if path:
            params.append(path)
    message = "; ".join(dict.fromkeys(problems))
    return ProtocolError(400, message, param=params[0] if params else None)


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _plain_message(err: Any) -> str:
    message = str(err["msg"]).removeprefix("Value error, ")
    message = message[:1].lower() + message[1:]
    value = err.get("input")
    if err["type"] in ("missing", "value_error") or not isinstance(value, str | int | float):
        return message
    shown = repr(value)
    return f"{message}, got {shown}" if value != "" and len(shown) <= 40 else message


def check_model(requested: str, served: Sequence[str]) -> str:
    """Returns ``requested`` if this server serves it; a 404 naming the served models if not."""
    if requested in served:
        return requested
    raise ProtocolError(
        404,
        f"The model '{requested}' does not exist. Available models: {', '.join(served)}",
        param="model",
        code="model_not_found",
    )


# ---- field validators ----


def _stop_list(value: Any) -> Any:
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, str):
        return [value]
    raise ValueError("must be a string or a list of strings")


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompt_list(value: Any) -> list[str | list[int]]:
    if value == "":
        raise ValueError("must not be empty")
    if isinstance(value, str) or (value and _is_token_list(value)):
        value = [value]  # one prompt
    if not isinstance(value, list) or not value:
        raise ValueError(
            "must be a non-empty string, list of strings, list of token ids, "
            "or list of lists of token ids"
        )
    for i, prompt in enumerate(value):
        _check_one_prompt(prompt, i)
    return value


def _check_one_prompt(prompt: Any, index: int) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"item {index} is an empty string; a prompt must not be empty")
    elif _is_token_list(prompt):
        if not prompt:
            raise ValueError(f"item {index} is an empty list of token ids")
        if min(prompt) < 0:
            raise ValueError(f"item {index} has a negative token id")
    else:
        raise ValueError(f"item {index} must be a string or a list of token ids")


def _content(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        return value
    raise ValueError("must be a string or a list of {type: 'text', text} parts")


StopField = Annotated[list[str] | None, BeforeValidator(_stop_list)]
PromptField = Annotated[list[str | list[int]], BeforeValidator(_prompt_list)]


# ---- requests ----


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk carrying ``usage``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class _Request(GuidedFields):
    """Fields shared by completions and chat completions (OpenAI's plus common extensions,
    structured outputs among them)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: StopField = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored
    # Extensions that vLLM and FastDeploy also accept.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                shown = repr(key) if len(key) <= 20 else repr(key[:20]) + "..."
                raise ValueError(f"keys must be token ids (decimal integers), got {shown}")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ProtocolError(
                400, "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.prompt_logprobs is not None and self.stream:
            raise ProtocolError(
                400, "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )

    @property
    def grammar(self) -> str | None:
        """The structured-output grammar this request asks for (see ``guided``), or None."""
        try:
            source = self.grammar_source()
        except GuidedError as exc:
            raise ProtocolError(400, str(exc), exc.param) from None
        return source and source[0]

    def _common_params(self) -> dict[str, Any]:
        self._check_stream_options()
        given = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "prompt_logprobs": self.prompt_logprobs,
            "logit_bias": None if self.logit_bias is None else _bias_pairs(self.logit_bias),
            "grammar": self.grammar,
        }
        # None means "OpenAI's default", which is SamplingParams' default (temperature 1.0 ...).
        return {k: v for k, v in given.items() if v is not None}


class CompletionRequest(_Request):
    """``POST /v1/completions``. After validation ``prompt`` is always a non-empty list of
    prompts, each a string or a list of token ids (one choice group per prompt)."""

    prompt: PromptField
    # OpenAI's documented default is 16; an explicit null means "up to the context length".
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported by this server")
        return value

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """SamplingParams for each prompt; ``default_max_tokens`` applies to max_tokens=null."""
        _check_best_of(self.best_of, self.n or 1)
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        params = self._common_params()
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens get logprobs
            params.setdefault("prompt_logprobs", self.logprobs)
        return _sampling_params(**params, max_tokens=max_tokens, logprobs=self.logprobs)


class ChatMessage(BaseModel):
    """One chat message. Extra fields (``name``, ``tool_calls``...) reach the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Annotated[str, Field(min_length=1)]
    content: Annotated[Any, BeforeValidator(_content)] = None


class ChatCompletionRequest(ToolFields, _Request):
    """``POST /v1/chat/completions`` (tools: see ``tools``)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    echo: bool | None = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echo is supported on /v1/completions only")
        return value

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as plain dicts for ``Tokenizer.apply_chat_template``."""
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """SamplingParams; ``default_max_tokens`` applies when neither max_* field is set."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return _sampling_params(
                **self._common_params(), max_tokens=max_tokens, logprobs=logprobs
            )
        except ProtocolError as exc:
            if exc.param == "logprobs":  # the number the client sent is top_logprobs
                exc.param = "top_logprobs"
                exc.message = exc.message.replace("logprobs", "top_logprobs", 1)
            raise


def _bias_pairs(bias: dict[str, float]) -> list[tuple[int, float]]:
    return [(int(token), value) for token, value in bias.items()]


def _check_best_of(best_of: int | None, n: int) -> None:
    """vLLM's rule: best_of >= n; generating more than n to return the best is not done here."""
    if best_of is None or best_of == n:
        return
    if best_of < n:
        raise ProtocolError(400, f"best_of ({best_of}) must be >= n ({n})", "best_of")
    message = f"best_of > n is not supported (got best_of={best_of}, n={n}); leave it unset"
    raise ProtocolError(400, message, "best_of")


def _sampling_params(**kwargs: Any) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        first = message.split(" ", 1)[0]
        raise ProtocolError(400, message, first if first in _SAMPLING_FIELDS else None) from exc


Request = CompletionRequest | ChatCompletionRequest
RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)


def to_sampling_params(request: Request, default_max_tokens: int | None) -> SamplingParams:
    """The request's SamplingParams; any invalid value becomes a 400 ProtocolError."""
    return request.to_sampling_params(default_max_tokens)


def parse_request(cls: type[RequestT], body: bytes | str | dict[str, Any]) -> RequestT:
    """Validates a JSON body (raw or already decoded) as ``cls``; a 400 ProtocolError if bad."""
    try:
        if isinstance(body, dict):
            return cls.model_validate(body)
        return cls.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from exc
