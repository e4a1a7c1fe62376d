"""The OpenAI request bodies the server takes, checked, and the error body it answers with.

A body is parsed in two steps: its JSON (malformed: 400), then its schema (`pydantic`, unknown
fields refused: 422, naming the field). Values the schema cannot judge (n, a prompt that does not
fit the cache, max_tokens beyond what is left) are checked where the prompt's length is known
(`infer.serve.app`): 400 or 413. Every error is `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

SEED_MAX = 2**63 - 1  # jax.random.key takes an int64


class ApiError(Exception):
    """An error answered to the client: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        if self.status == 404:
            return "not_found_error"
        if self.status == 503:
            return "server_overloaded"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


NonNegative = Annotated[float, Field(ge=0.0, le=1e30, allow_inf_nan=False)]


class SamplingBody(_Body):
    """What both endpoints take besides the prompt."""

    model: str
    max_tokens: int | None = None
    temperature: NonNegative = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and unused, as OpenAI's clients send it

    def stops(self) -> list[str]:
        found = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in found):
            raise ApiError(400, "stop: every stop string must be non-empty", "stop")
        return found


class CompletionRequest(SamplingBody):
    prompt: str | list[int]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingBody):
    messages: list[Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens

    def conversation(self) -> list[dict[str, str]]:
        if not self.messages:
            raise ApiError(400, "messages: the conversation is empty; send at least one message", "messages")
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def parse(raw: bytes, kind: type[SamplingBody]) -> SamplingBody:
    """A request body as `kind`: ApiError 400 for malformed JSON, 422 for the schema."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not valid JSON ({err})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    try:
        body = kind.model_validate(data)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        what = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        raise ApiError(422, f"{param}: {what}", param, code=first["type"]) from None
    if body.n != 1:
        raise ApiError(400, f"n: only n=1 is served (one completion per request), got {body.n}", "n")
    return body
