"""The HTTP side (FastAPI): OpenAI's endpoints over the scheduler.

Handlers only turn bodies into jobs and events into responses; the device thread does the rest
(`infer.serve.scheduler`). A client that goes away mid-request has its job cancelled (its slot is
freed before the next round), streaming or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from infer.serve import protocol
from infer.serve.protocol import ApiError
from infer.serve.scheduler import Closed, Finished, Job, QueueFull, Tokens
from infer.serve.text import TextStream
from peagle_jax import chat
from peagle_jax.engine.sampling import SamplingParams

log = logging.getLogger("infer.serve")
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
RETRY_AFTER_S = "1"


@dataclasses.dataclass
class Served:
    """What the handlers need: the scheduler and what the prompts are checked against (the
    tokenizer is never None: the server refuses a target without one)."""

    scheduler: object
    tokenizer: object
    model: str
    vocab_size: int
    max_len: int
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def metrics(self):
        return self.scheduler.metrics

    @property
    def slots(self):
        return self.scheduler.slots


@dataclasses.dataclass
class Call:
    """One request in flight: its body, prompt, job and the job's events."""

    body: protocol.SamplingBody
    ids: list[int]
    job: Job
    events: asyncio.Queue
    chat: bool
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict:
        done = self.job.generated
        return {"prompt_tokens": len(self.ids), "completion_tokens": done, "total_tokens": len(self.ids) + done}


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="peagle-jax", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_request, err: ApiError):
        headers = {"Retry-After": RETRY_AFTER_S} if err.status == 503 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_request, err: HTTPException):
        return JSONResponse(ApiError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def crash(_request, err: Exception):
        log.exception("request failed")
        return JSONResponse(ApiError(500, f"{type(err).__name__}: {err}").body(), status_code=500)

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        served.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        sched = served.scheduler
        if sched.failure is not None or sched.closing:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(served.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {"id": served.model, "object": "model", "created": served.created, "owned_by": "peagle-jax"}
        return {"object": "list", "data": [{**card, "max_model_len": served.max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = protocol.parse(await request.body(), protocol.CompletionRequest)
        _check_model(served, body)
        return await _respond(served, request, body, _completion_ids(served, body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = protocol.parse(await request.body(), protocol.ChatRequest)
        _check_model(served, body)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        return await _respond(served, request, body, _chat_ids(served, body), chat=True)

    return app


# ---------------------------------------------------------------- prompts and limits


def _check_model(served: Served, body) -> None:
    if body.model != served.model:
        raise ApiError(
            404,
            f"model {body.model!r} is not served here; this server serves {served.model!r}",
            "model",
            "model_not_found",
        )


def _completion_ids(served: Served, body) -> list[int]:
    if isinstance(body.prompt, str):
        if not body.prompt:
            raise ApiError(400, "prompt: the prompt is empty", "prompt")
        return [int(t) for t in served.tokenizer(body.prompt)["input_ids"]]
    if not body.prompt:
        raise ApiError(400, "prompt: the list of token ids is empty", "prompt")
    _check_vocab(served, body.prompt, "prompt")
    return list(body.prompt)


def _chat_ids(served: Served, body) -> list[int]:
    conversation = body.conversation()
    try:
        return chat.encode_prompt(served.tokenizer, conversation)
    except Exception as err:  # noqa: BLE001 - a template's refusal (e.g. roles out of order) is the client's
        raise ApiError(400, f"messages: the chat template refused them ({err})", "messages") from None


def _check_vocab(served: Served, ids: list[int], param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < served.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary [0, {served.vocab_size})", param)


def _budget(served: Served, body, prompt_len: int) -> int:
    room = served.slots.max_new_tokens(prompt_len)
    if room < 1:
        raise ApiError(
            413,
            f"the prompt has {prompt_len} tokens, more than the cache holds with one new token "
            f"(--max-len {served.max_len}: at most {prompt_len + room - 1} prompt tokens)",
            "prompt",
            "context_length_exceeded",
        )
    if body.max_tokens is None:
        return room
    if body.max_tokens < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {body.max_tokens}", "max_tokens")
    if body.max_tokens > room:
        raise ApiError(
            400,
            f"max_tokens={body.max_tokens} does not fit: a prompt of {prompt_len} tokens leaves room for "
            f"{room} new tokens (--max-len {served.max_len})",
            "max_tokens",
        )
    return body.max_tokens


# ---------------------------------------------------------------- jobs and responses


def _job(served: Served, body, ids: list[int]) -> tuple[Job, asyncio.Queue]:
    max_tokens = _budget(served, body, len(ids))
    body.stops()  # a bad stop string is refused before the job is queued
    _check_vocab(served, body.stop_token_ids or [], "stop_token_ids")
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def emit(event) -> None:  # the device thread's side
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody waits for this event
            pass

    seed = random.getrandbits(63) if body.seed is None else body.seed
    params = SamplingParams(
        max_tokens, body.temperature, body.top_p, seed=seed, stop_token_ids=tuple(body.stop_token_ids or ())
    )
    job = Job(ids, params, emit)
    return job, events


async def _respond(served: Served, request: Request, body, ids: list[int], chat: bool):
    job, events = _job(served, body, ids)
    try:
        served.scheduler.submit(job)
    except QueueFull as err:
        raise ApiError(503, f"the server is busy ({err}); retry later", code="queue_full") from None
    except Closed as err:
        raise ApiError(503, str(err), code="shutting_down") from None
    call = Call(body, ids, job, events, chat)
    if body.stream:
        return StreamingResponse(_stream(served, call), media_type="text/event-stream")
    return await _collect(served, request, call)


async def _events(served: Served, call: Call):
    """(text, finish reason or None) as the job's events come; a stop string ends it ("stop")."""
    text = TextStream(served.tokenizer, call.body.stops())
    while True:
        event = await call.events.get()
        if isinstance(event, Tokens):
            piece = text.add(event.ids)
            if text.stopped:
                served.scheduler.cancel(call.job)
                yield piece, "stop"
                return
            yield piece, None
        else:
            assert isinstance(event, Finished)
            yield text.finish(), event.reason
            return


async def _collect(served: Served, request: Request, call: Call) -> dict:
    pieces, reason = [], None
    events = _events(served, call)
    try:
        while reason is None:
            step = asyncio.ensure_future(anext(events))
            while not step.done():
                await asyncio.wait([step], timeout=DISCONNECT_POLL_S)
                if not step.done() and await request.is_disconnected():
                    step.cancel()
                    served.scheduler.cancel(call.job)
                    return Response(status_code=499)
            piece, reason = step.result()
            pieces.append(piece)
    finally:
        await events.aclose()
    text = "".join(pieces)
    choice = {"index": 0, "finish_reason": reason, "logprobs": None}
    if call.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return _object(served, call, [choice], chunk=False) | {"usage": call.usage()}


def _object(served: Served, call: Call, choices: list, chunk: bool) -> dict:
    kind = ("chat.completion" + (".chunk" if chunk else "")) if call.chat else "text_completion"
    prefix = "chatcmpl-" if call.chat else "cmpl-"
    return {"id": prefix + call.id, "object": kind, "created": call.created, "model": served.model, "choices": choices}


def _chunk(served: Served, call: Call, text: str | None, reason: str | None, role: bool = False) -> str:
    if call.chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
    data = _object(served, call, [choice], chunk=True)
    if reason is not None:
        data["usage"] = call.usage()
    return f"data: {json.dumps(data)}\n\n"


async def _stream(served: Served, call: Call):
    finished = False
    try:
        if call.chat:
            yield _chunk(served, call, None, None, role=True)
        async for piece, reason in _events(served, call):
            if piece and reason is None:
                yield _chunk(served, call, piece, None)
            elif reason is not None:
                if piece:
                    yield _chunk(served, call, piece, None)
                yield _chunk(served, call, None, reason)
        options = call.body.stream_options
        if options is not None and options.include_usage:
            yield f"data: {json.dumps(_object(served, call, [], chunk=True) | {'usage': call.usage()})}\n\n"
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client went away (the response task was cancelled)
            served.scheduler.cancel(call.job)
