"""A request in flight: its rows submitted as jobs, their events turned into OpenAI's response
or its stream of chunks.

Each choice keeps its own text stream (stop strings, special tokens) and its tokens' logprobs.
A stop string ends its choice (its job is cancelled: the slot is freed before the next round);
a failed job ends the whole request with an error (the others are cancelled): a JSON error with
the failure's status, or in a stream an error event and `[DONE]`. A client that goes away has
every job of its request cancelled, streaming or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from infer.serve import render
from infer.serve.jobs import Plan, Row, Served
from infer.serve.protocol import ApiError
from infer.serve.scheduler import Closed, Failed, Finished, Job, PromptLogprobs, QueueFull, Tokens
from infer.serve.text import TextStream

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


@dataclasses.dataclass
class Update:
    """What one event adds to a choice: text, the logprobs of the tokens that came with it, an end."""

    index: int
    text: str
    logprobs: dict | None = None
    reason: str | None = None


@dataclasses.dataclass
class Choice:
    row: Row
    job: Job
    text: TextStream
    echo: str | None  # the prompt's text, until it is sent (echo)
    reason: str | None = None
    prompt_entries: list | None = None  # the prompt's logprobs (echo with logprobs)
    offset: int = 0  # characters of the tokens whose logprobs were sent (text_offset)
    pieces: list[str] = dataclasses.field(default_factory=list)  # the completion's text so far
    ids: list[int] = dataclasses.field(default_factory=list)  # its token ids so far


class CallFailed(Exception):
    def __init__(self, failure: Failed):
        super().__init__(failure.message)
        self.failure = failure

    def error(self) -> ApiError:
        return ApiError(self.failure.status, self.failure.message)


class Call:
    """A request's jobs and the queue their events arrive on, tagged with the choice's index."""

    def __init__(self, served: Served, plan: Plan):
        self.served, self.plan = served, plan
        self.id, self.created = uuid.uuid4().hex, int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        body = plan.body
        self.choices = []
        for row in plan.rows:
            emit = functools.partial(_emit, loop, self.events, row.index)
            prompt = plan.prompts[row.prompt]
            job = Job(prompt.ids, row.params, emit, prompt_logprobs=row.prompt_logprobs, choice=row.index)
            text = TextStream(
                served.tokenizer, body.stops(), bool(body.skip_special_tokens), bool(body.include_stop_str_in_output)
            )
            echo = prompt.text if getattr(body, "echo", False) else None
            self.choices.append(Choice(row, job, text, echo))

    def submit(self) -> None:
        try:
            self.served.scheduler.submit(*[c.job for c in self.choices])
        except QueueFull as err:
            raise ApiError(503, f"the server is busy ({err}); retry later", code="queue_full") from None
        except Closed as err:
            raise ApiError(503, str(err), code="shutting_down") from None

    @property
    def done(self) -> bool:
        return all(c.reason is not None for c in self.choices)

    def cancel(self) -> None:
        for c in self.choices:
            if c.reason is None:
                self.served.scheduler.cancel(c.job, "abort")

    def usage(self) -> dict:
        prompt = sum(len(p.ids) for p in self.plan.prompts)
        return render.usage(prompt, sum(c.job.generated for c in self.choices))

    def envelope(self, chunk: bool) -> dict:
        return render.envelope(self.id, self.created, self.served.model, self.plan.chat, chunk)

    # ------------------------------------------------------------ events to updates

    def take(self, index: int, event) -> list[Update]:
        """The updates an event makes (none once its choice has ended); CallFailed for a failure."""
        choice = self.choices[index]
        if choice.reason is not None:
            return []
        if isinstance(event, Failed):
            raise CallFailed(event)
        if isinstance(event, PromptLogprobs):
            choice.prompt_entries = list(event.logprobs)
            return [self._echo(choice)] if choice.echo is not None else []
        updates = [self._echo(choice)] if choice.echo is not None else []
        if isinstance(event, Tokens):
            text = choice.text.add(event.ids)
            choice.ids += event.ids
            reason = "stop" if choice.text.stopped else None
            if reason:  # a stop string: nothing more of this job is needed
                self.served.scheduler.cancel(choice.job, "stop")
            entries = event.logprobs or [None] * len(event.ids)
            updates.append(Update(index, text, self._logprobs(choice, event.ids, entries), reason))
        else:
            assert isinstance(event, Finished)
            reason = event.reason
            updates.append(Update(index, choice.text.finish(), None, reason))
        choice.pieces.append(updates[-1].text)
        choice.reason = reason
        if reason is not None and self.served.recorder is not None:
            self.served.recorder.record(self.served, self, choice)
        return updates

    def _echo(self, choice: Choice) -> Update:
        text, choice.echo = choice.echo, None
        ids = self.plan.prompts[choice.row.prompt].ids
        entries = choice.prompt_entries or [None] * len(ids)
        return Update(choice.row.index, text, self._logprobs(choice, ids, entries))

    def _logprobs(self, choice: Choice, ids: list[int], entries: list) -> dict | None:
        if choice.row.params.logprobs is None:
            return None
        decode = functools.partial(_token_text, self.served.tokenizer)
        if self.plan.chat:
            return render.chat_logprobs(ids, entries, decode)
        out = render.completion_logprobs(ids, entries, decode, choice.offset)
        choice.offset += sum(len(t) for t in out["tokens"])
        return out


def _emit(loop, events: asyncio.Queue, index: int, event) -> None:
    """A job's event, from the device thread onto the request's queue."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, (index, event))
    except RuntimeError:  # the event loop has closed: nobody waits for this event
        pass


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


# ---------------------------------------------------------------- whole responses


async def collect(call: Call, request: Request):
    """The whole response once every choice has ended (499, nothing sent, if the client left)."""
    texts = {c.row.index: [] for c in call.choices}
    logprobs = {c.row.index: [] for c in call.choices}
    reasons = {}
    try:
        while not call.done:
            got = await _next_event(call, request)
            if got is None:
                call.cancel()
                return Response(status_code=499)
            for update in call.take(*got):
                texts[update.index].append(update.text)
                if update.logprobs is not None:
                    logprobs[update.index].append(update.logprobs)
                if update.reason:
                    reasons[update.index] = update.reason
    except CallFailed as failed:
        call.cancel()
        raise failed.error() from None
    choices = [
        render.choice(
            i, "".join(texts[i]), reasons[i], render.join_logprobs(logprobs[i], call.plan.chat), call.plan.chat
        )
        for i in sorted(texts)
    ]
    return call.envelope(chunk=False) | {"choices": choices, "usage": call.usage()}


async def _next_event(call: Call, request: Request):
    """The next (index, event), or None once the client has gone away."""
    step = asyncio.ensure_future(call.events.get())
    while not step.done():
        await asyncio.wait([step], timeout=DISCONNECT_POLL_S)
        if not step.done() and await request.is_disconnected():
            step.cancel()
            return None
    return step.result()


# ---------------------------------------------------------------- streams


async def stream(call: Call):
    """The server-sent events of a streamed response: chunks, then (include_usage) one usage
    chunk, then `[DONE]`; a failure is an error event before `[DONE]`."""
    options = call.plan.body.stream_options
    continuous = bool(options and options.continuous_usage_stats)
    finished = False
    try:
        if call.plan.chat:
            for c in call.choices:
                yield _chunk(call, render.delta(c.row.index, "", None, None, True, first=True), continuous)
        try:
            while not call.done:
                for u in call.take(*await call.events.get()):
                    if u.text or u.reason or u.logprobs:
                        yield _chunk(
                            call, render.delta(u.index, u.text, u.reason, u.logprobs, call.plan.chat), continuous
                        )
        except CallFailed as failed:
            call.cancel()
            yield render.sse(failed.error().body())
        else:
            if options and options.include_usage:
                yield render.sse(call.envelope(chunk=True) | {"choices": [], "usage": call.usage()})
        yield render.sse("[DONE]")
        finished = True
    finally:
        if not finished:  # the client went away (the response task was cancelled)
            call.cancel()


def _chunk(call: Call, choice: dict, continuous: bool) -> str:
    data = call.envelope(chunk=True) | {"choices": [choice]}
    if continuous:
        data["usage"] = call.usage()
    return render.sse(data)
