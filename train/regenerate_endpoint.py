"""`--data.regenerate_endpoint`: the target's greedy answers from a server that speaks the OpenAI
API (vLLM, SGLang) instead of the engine in process.

One request per conversation: `v1/completions` with the prompt's token ids (exactly the prompt the
trainer encodes), or `v1/chat/completions` with the messages (templated by the server); greedy
(temperature 0, top_p 1, n 1), `max_tokens` = data.regenerate_tokens, the target's eos ids as
`stop_token_ids`. The answer's token ids are taken as the server returns them (vLLM's
`return_token_ids`, from 0.10.2) and decoded here as the in-process path decodes its own; a server
that returns text only (SGLang, older vLLM) has its text kept and re-tokenised, and the length it
reports checked against it (`Answer.mismatch`).

Requests run `concurrency` at a time on threads sharing one pooled `httpx2.Client`. A timeout, a
lost connection, 408 / 429 / 5xx are retried with exponential backoff; the first conversation that
fails every try stops the run with one line naming the endpoint and its row. The answers received
before are handed to `on_answer` (the JSONL cache) as they arrive, so nothing done is lost.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import threading
import urllib.parse
from collections.abc import Callable, Sequence

__all__ = ["Endpoint", "EndpointError", "Job", "Answer", "generate_remote", "base_url"]

APIS = ("completions", "chat")
RETRY_STATUS = frozenset({408, 425, 429})  # and every 5xx: the server may answer the next try
MAX_BACKOFF_S = 60.0


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where and how to ask: `url` (e.g. http://localhost:8000/v1), the API, the served model's
    name (None: the first of v1/models), requests in flight, seconds per request, retries after
    the first try, and the first retry's wait in seconds (doubled per retry, at most 60)."""

    url: str
    api: str = "completions"
    model: str | None = None
    concurrency: int = 32
    timeout: float = 600.0
    retries: int = 5
    backoff: float = 1.0


class EndpointError(ValueError):
    """Regeneration through an endpoint stopped (the message is one line naming the endpoint)."""


@dataclasses.dataclass(frozen=True)
class Job:
    index: int  # the conversation's position in the records (the cache's key)
    where: str  # its file and row, for messages
    ids: list[int]  # the prompt's token ids (the trainer's encoding)
    messages: list[dict]  # the prompt's messages (the chat API's input)


@dataclasses.dataclass(frozen=True)
class Answer:
    text: str
    ids: list[int] | None  # the generated tokens as the server returned them (None: text only)
    mismatch: str | None = None  # what did not check out (prompt or length), None when all did


class _Failed(Exception):
    """Every try of one request failed (`cause`: the last one's reason)."""

    def __init__(self, cause: str, tries: int):
        super().__init__(cause)
        self.cause, self.tries = cause, tries


class _Fatal(Exception):
    """An answer no retry will change (a 4xx, a reply that is no completion)."""


class _Stopped(Exception):
    """The run is stopping: a request left before its next try."""


def base_url(url: str) -> str:
    """The API root: `http://host:8000` and `http://host:8000/v1/` both give `http://host:8000/v1`;
    a full route (`.../v1/completions`) is cut back to its root; another path prefix is kept."""
    url = url.strip().rstrip("/")
    for route in ("/chat/completions", "/completions", "/models"):
        if url.endswith(route):
            url = url[: -len(route)]
    return url if urllib.parse.urlsplit(url).path not in ("", "/") else url + "/v1"


def _headers() -> dict[str, str]:
    """vLLM's --api-key (and OpenAI's convention): the key from the environment, never a flag
    (flags land in OUT/config.json)."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _shown(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _try_once(client, method: str, url: str, body, timeout: float):
    """The decoded JSON reply; _Failed(cause, 1) for what a retry may cure, _Fatal otherwise."""
    import httpx2

    try:
        reply = client.request(method, url, json=body, timeout=timeout)
    except httpx2.TimeoutException:
        raise _Failed(f"no reply within {timeout:g} s (timed out)", 1) from None
    except httpx2.TransportError as e:
        raise _Failed(f"connection failed ({type(e).__name__}: {_shown(e) or 'no detail'})", 1) from None
    if reply.status_code >= 400:
        cause = f"HTTP {reply.status_code} {reply.reason_phrase}: {_shown(reply.text) or 'no body'}"
        if reply.status_code >= 500 or reply.status_code in RETRY_STATUS:
            raise _Failed(cause, 1)
        raise _Fatal(cause)
    try:
        return reply.json()
    except ValueError:
        raise _Fatal(f"the reply is not JSON: {_shown(reply.text)}") from None


def _call(client, method: str, url: str, body, ep: Endpoint, stop: threading.Event):
    """`_try_once` with retries: waits of backoff x 2^n between tries (cut short by `stop`)."""
    for attempt in range(ep.retries + 1):
        try:
            return _try_once(client, method, url, body, ep.timeout)
        except _Failed as e:
            if attempt == ep.retries:
                raise _Failed(e.cause, attempt + 1) from None
        if stop.wait(min(ep.backoff * 2**attempt, MAX_BACKOFF_S)):
            raise _Stopped
    raise AssertionError("unreachable")


def served_model(client, ep: Endpoint) -> str:
    """The model to ask for: `ep.model`, else the first one the server lists under v1/models."""
    if ep.model:
        return ep.model
    url = base_url(ep.url) + "/models"
    try:
        reply = _call(client, "GET", url, None, ep, threading.Event())
        return str(reply["data"][0]["id"])
    except _Failed as e:
        raise EndpointError(f"regeneration through {ep.url}: GET {url}: {e.cause} after {e.tries} tries") from None
    except _Fatal as e:
        raise EndpointError(f"regeneration through {ep.url}: GET {url}: {e}") from None
    except (KeyError, IndexError, TypeError):
        raise EndpointError(
            f"regeneration through {ep.url}: GET {url} lists no model: name it with --data.regenerate_model"
        ) from None


def request_body(job: Job, ep: Endpoint, model: str, max_new: int, stop_ids: Sequence[int]) -> dict:
    """Greedy, as the in-process path decodes: temperature 0, one choice, the target's eos ids."""
    body = {
        "model": model,
        "max_tokens": max_new,
        "temperature": 0.0,
        "top_p": 1.0,
        "n": 1,
        "stream": False,
        "stop_token_ids": list(stop_ids),
        "skip_special_tokens": True,
        "return_token_ids": True,  # vLLM >= 0.10.2; others ignore it and return text only
    }
    if ep.api == "chat":
        return {**body, "messages": job.messages}
    return {**body, "prompt": list(job.ids)}


def parse_answer(reply, job: Job, ep: Endpoint, tokenizer, vocab: int) -> Answer:
    """The answer of a reply: the returned ids decoded as in process, else the text re-tokenised
    and its length checked against the server's count. _Fatal for a reply that is no completion."""
    try:
        choice = reply["choices"][0]
        text = choice["message"]["content"] if ep.api == "chat" else choice["text"]
    except (KeyError, IndexError, TypeError):
        raise _Fatal(f"the reply holds no completion: {_shown(json.dumps(reply))}") from None
    prompt = choice.get("prompt_token_ids") or reply.get("prompt_token_ids")
    mismatch = None
    if prompt is not None and list(prompt) != list(job.ids):
        mismatch = "the server's prompt tokens differ from the trainer's"
    ids = choice.get("token_ids")
    if ids is not None:
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise _Fatal(f"token_ids outside the target's vocabulary [0, {vocab}): is it serving the target?")
        return Answer(tokenizer.decode(ids, skip_special_tokens=True), list(ids), mismatch)
    text = text or ""
    count = (reply.get("usage") or {}).get("completion_tokens")
    own = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    stopped = choice.get("finish_reason") == "stop"  # the stop token is counted, not shown
    if isinstance(count, int) and count not in (own, own + stopped):
        mismatch = mismatch or (
            f"the text re-tokenises to {own} tokens, the server generated {count} (special tokens it dropped, or "
            "another tokenizer than the target's)"
        )
    return Answer(text, None, mismatch)


def _error(ep: Endpoint, job: Job, cause: str) -> EndpointError:
    return EndpointError(f"regeneration through {ep.url}: {job.where} (conversation {job.index}): {cause}")


class _Window:
    """At most `ep.concurrency` requests in flight (a bounded window, not one task per conversation:
    the first failure stops the rest, and an interrupt leaves little behind)."""

    def __init__(self, client, ep: Endpoint, url: str, body: Callable[[Job], dict]):
        self.client, self.ep, self.url, self.body = client, ep, url, body
        self.pool = cf.ThreadPoolExecutor(ep.concurrency, thread_name_prefix="regenerate")
        self.stop = threading.Event()
        self.pending: dict[cf.Future, Job] = {}

    def fill(self, jobs) -> None:
        while len(self.pending) < self.ep.concurrency and not self.stop.is_set():
            job = next(jobs, None)
            if job is None:
                return
            fut = self.pool.submit(_call, self.client, "POST", self.url, self.body(job), self.ep, self.stop)
            self.pending[fut] = job

    def finished(self):
        """(job, reply or the exception) of the requests that ended since the last call."""
        done, _ = cf.wait(list(self.pending), return_when=cf.FIRST_COMPLETED)
        for fut in done:
            job = self.pending.pop(fut)
            yield job, (fut.exception() or fut.result())

    def close(self) -> None:
        self.stop.set()  # retries waiting give up; a request in flight ends within its timeout
        self.pool.shutdown(wait=False, cancel_futures=True)


def generate_remote(
    jobs: Sequence[Job],
    tokenizer,
    ep: Endpoint,
    *,
    max_new: int,
    stop_ids: Sequence[int],
    vocab: int,
    on_answer: Callable[[Job, Answer], None],
    progress: bool = False,
) -> None:
    """Every job's answer from the endpoint, handed to `on_answer` (in the calling thread) as it
    arrives. EndpointError (one line) once a request failed every try, or was refused; the
    requests still in flight finish first (their answers handed on too)."""
    import httpx2
    from tqdm import tqdm

    limits = httpx2.Limits(max_connections=ep.concurrency, max_keepalive_connections=ep.concurrency)
    with httpx2.Client(headers=_headers(), limits=limits) as client:
        model = served_model(client, ep)
        route = "/chat/completions" if ep.api == "chat" else "/completions"
        body = lambda job: request_body(job, ep, model, max_new, stop_ids)
        window, todo, failure = _Window(client, ep, base_url(ep.url) + route, body), iter(jobs), None
        bar = tqdm(total=len(jobs), unit="conv", desc="regenerate", disable=not progress, dynamic_ncols=True)
        try:
            window.fill(todo)
            while window.pending:
                for job, got in window.finished():
                    err = _handle(job, got, ep, tokenizer, vocab, on_answer, bar)  # answers after a failure count too
                    failure = failure or err
                if failure is not None:
                    window.stop.set()  # no new requests, no more retries: drain the ones in flight
                window.fill(todo)
        finally:
            window.close()
            bar.close()
    if failure is not None:
        raise failure


def _handle(job, got, ep, tokenizer, vocab, on_answer, bar) -> EndpointError | None:
    """One ended request: its answer handed on, or the error it stops the run with."""
    if isinstance(got, _Stopped):
        return None
    if isinstance(got, _Failed):
        return _error(ep, job, f"{got.cause} after {got.tries} tries")
    if isinstance(got, BaseException):
        return _error(ep, job, str(got) or type(got).__name__)
    try:
        answer = parse_answer(got, job, ep, tokenizer, vocab)
    except _Fatal as e:
        return _error(ep, job, str(e))
    on_answer(job, answer)
    bar.update(1)
    return None
