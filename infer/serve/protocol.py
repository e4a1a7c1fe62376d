"""The OpenAI request bodies the server takes, checked, and the error body it answers with.

A body is read in three steps, all before any device work: its JSON (`load_json`: malformed,
nested deeper than MAX_DEPTH, an integer of more than MAX_INT_DIGITS digits, NaN / Infinity or a
lone surrogate: 400), its schema (`pydantic`: a wrong type or range: 422 naming the field), then
the values the schema cannot judge (`SamplingBody.refusals`: caps, fields that are not served:
400 naming the field). Fields the server does not know are accepted and named (`unknown_fields`;
`--strict`: 422). Values that need the prompt or the model (a prompt that does not fit the cache,
max_tokens beyond what is left, token ids outside the vocabulary) are checked in
`infer.serve.jobs`. Every error is `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from peagle_jax.engine.sampling import SEED_MAX

MAX_DEPTH = 32  # JSON nesting: a request body is a few levels deep
MAX_INT_DIGITS = 24  # the largest number a field takes is a seed (19 digits)
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings: how many, how long (a stream holds back that much text)
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_LOGPROBS = 20  # top tokens per position (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 1024  # entries


class ApiError(Exception):
    """An error answered to the client: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        if self.status == 404:
            return "not_found_error"
        if self.status == 401:
            return "authentication_error"
        if self.status == 503:
            return "server_overloaded"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- the JSON


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def load_json(raw: bytes) -> Any:
    """The body's JSON value; ApiError 400 for anything that is not plain, bounded JSON text."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_int=_bounded_int, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(
            400, f"the body is not valid JSON (nested deeper than {MAX_DEPTH})", code="invalid_json"
        ) from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, the hooks' refusals
        raise ApiError(400, f"the body is not valid JSON ({_one_line(err)})", code="invalid_json") from None
    _check_tree(data)
    return data


def _check_tree(data: Any) -> None:
    """Depth and text of every value, without recursion (a deep body must not exhaust the stack)."""
    todo = [(data, "", 1)]
    while todo:
        value, where, depth = todo.pop()
        if depth > MAX_DEPTH and isinstance(value, (dict, list)):
            raise ApiError(400, f"the body is not valid JSON (nested deeper than {MAX_DEPTH})", code="invalid_json")
        if isinstance(value, str):
            _check_text(value, where or "the body")
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"{where}.{key!r}" if where else repr(key))
                todo.append((item, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(value, list):
            todo.extend((item, f"{where}.{i}", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        where = where[:80]
        raise ApiError(400, f"{where}: a lone surrogate (\\ud800-\\udfff) is not text", where, "invalid_json") from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:200]


# ---------------------------------------------------------------- the schema


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


NonNegative = Annotated[float, Field(ge=0.0, le=1e30, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk


class ResponseFormat(_Body):
    type: str


class SamplingBody(_Body):
    """What both endpoints take besides the prompt: OpenAI's fields and vLLM's sampling
    extensions. None is "not set" wherever OpenAI's clients send null."""

    model: str
    max_tokens: int | None = None
    temperature: NonNegative | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # checked against the vocabulary (400)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and unused, as OpenAI's clients send it
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's sampling extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=1e30, allow_inf_nan=False)] | None = None
    ignore_eos: bool | None = False
    min_tokens: Count | None = 0
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def new_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """None: no logprobs; else how many top tokens beside each token's own."""
        return None

    def refusals(self):
        """(param, message) of each value the schema cannot judge, before any work."""
        stops = self.stops()
        if any(not s for s in stops):
            yield "stop", "every stop string must be non-empty"
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            yield "stop", f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters"
        if len(self.stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
            yield "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids"
        if self.n is not None and not 1 <= self.n <= MAX_N:
            yield "n", f"n must be in [1, {MAX_N}], got {self.n}"
        if len(self.logit_bias or {}) > MAX_LOGIT_BIAS:
            yield "logit_bias", f"at most {MAX_LOGIT_BIAS} entries"
        bad_key = next((k for k in self.logit_bias or {} if not re.fullmatch(r"[0-9]{1,10}", k)), None)
        if bad_key is not None:
            yield "logit_bias", f"keys are token ids (decimal strings), got {bad_key[:40]!r}"
        if self.response_format is not None and self.response_format.type != "text":
            yield "response_format", f'only {{"type": "text"}} is served, got {self.response_format.type[:40]!r}'
        tokens = self.new_tokens()
        if tokens is not None and tokens < 1:
            yield "max_tokens", f"max_tokens must be >= 1, got {tokens}"


class CompletionRequest(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: Literal[False] | Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or token ids (one prompt, or a list of them)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def logprob_count(self) -> int | None:
        return None if self.logprobs is False else self.logprobs

    def refusals(self):
        yield from super().refusals()
        if not self.prompt:
            yield "prompt", "the prompt is empty"
        elif len(self.prompts()) > MAX_PROMPTS:
            yield "prompt", f"at most {MAX_PROMPTS} prompts in one request"
        if self.suffix:
            yield "suffix", "a suffix (insertion) is not served"
        if self.best_of is not None and self.best_of != (self.n or 1):
            yield "best_of", "best_of is not served (each choice is an independent row: use n)"


class ContentPart(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        return "".join(p.text or "" for p in self.content)


class ChatRequest(SamplingBody):
    messages: list[Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def refusals(self):
        yield from super().refusals()
        if self.top_logprobs is not None and not self.logprobs:
            yield "top_logprobs", "top_logprobs needs logprobs: true"
        if self.tools or self.functions:
            yield ("tools" if self.tools else "functions"), "tool calling is not served"
        if self.tool_choice not in (None, "none", "auto") or self.function_call not in (None, "none", "auto"):
            yield "tool_choice", "tool calling is not served (tool_choice: none or auto only)"
        if not self.messages:
            yield "messages", "the conversation is empty; send at least one message"
        for i, m in enumerate(self.messages):
            if m.tool_calls:
                yield f"messages.{i}.tool_calls", "tool calls are not served"
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type != "text" or part.text is None:
                    yield f"messages.{i}.content.{j}", f"only text parts are served, got type {part.type[:40]!r}"

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


# ---------------------------------------------------------------- a body


_TYPE_PART = re.compile(r"[A-Z]\w*|\w+\[.*\]|str|int|float|bool|none|list|dict|literal.*|function-.*|constrained-.*")


def _param(loc) -> str | None:
    """The field a pydantic error names (the union member names it adds left out)."""
    parts = [str(p) for p in loc if isinstance(p, int) or not _TYPE_PART.fullmatch(str(p))]
    return ".".join(parts) or None


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The fields of a parsed body (nested ones too) that its schema does not name."""
    found = [prefix + str(k) for k in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                found += unknown_fields(item, f"{prefix}{name}." + ("" if i is None else f"{i}."))
    return found


def parse(raw: bytes, kind: type[SamplingBody], strict: bool = False) -> tuple[SamplingBody, list[str]]:
    """(body as `kind`, its unknown fields): ApiError 400 for malformed JSON or a refused value,
    422 for the schema (and, `strict`, for an unknown field)."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    try:
        body = kind.model_validate(data)
    except pydantic.ValidationError as err:
        first = err.errors(include_url=False, include_input=False)[0]
        param = _param(first["loc"])
        raise ApiError(422, f"{param}: {first['msg']}", param, code=first["type"]) from None
    unknown = unknown_fields(body)
    if strict and unknown:
        raise ApiError(422, f"{unknown[0]}: unknown field (--strict)", unknown[0], "extra_forbidden")
    for param, message in body.refusals():
        raise ApiError(400, f"{param}: {message}", param)
    return body, unknown
