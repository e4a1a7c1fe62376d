"""A request body as the rows it asks for, checked against the model before any device work.

`plan` parses the body (`infer.serve.protocol`), tokenizes its prompts (the chat template for a
conversation), checks each against the vocabulary and the cache, and gives one `Row` per choice
(n choices of each prompt, each an independent request with its own SamplingParams). It is CPU
work that can take a while (a long prompt, a template): the handlers run it in `Served.pool`,
off the event loop.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
import time

from infer.serve.protocol import ApiError, ChatRequest, CompletionRequest, SamplingBody, parse
from peagle_jax.conversations import chat
from peagle_jax.engine.sampling import SamplingParams

log = logging.getLogger("infer.serve")
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's max_tokens default for /v1/completions


@dataclasses.dataclass
class Served:
    """What the handlers need: the scheduler, and what requests are checked against (the
    tokenizer is never None: the server refuses a target without one)."""

    scheduler: object
    tokenizer: object
    model: str
    vocab_size: int
    max_len: int
    strict: bool = False  # unknown fields: 422 (else accepted and named in a warning)
    pool: concurrent.futures.Executor | None = None  # tokenizing and templating, off the event loop
    heads: object | None = None  # `infer.serve.heads.Heads`: the head served and its swaps (None: mode none)
    admin_keys: tuple[bytes, ...] = ()  # the admin routes' keys (none: the routes do not exist)
    recorder: object | None = None  # `infer.serve.recorder.Recorder` (--log-requests)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def metrics(self):
        return self.scheduler.metrics

    @property
    def slots(self):
        return self.scheduler.slots


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # what echo prepends: the text as sent, or the token ids decoded
    sent: str | None = None  # the text as sent (None: token ids, or a conversation)


@dataclasses.dataclass(frozen=True)
class Row:
    """One choice: which prompt, its index among the choices (OpenAI's: prompt i, choice j of n
    is i * n + j) and what it asks of the engine."""

    index: int
    prompt: int
    params: SamplingParams
    prompt_logprobs: int | None = None  # echo with logprobs


@dataclasses.dataclass
class Plan:
    body: SamplingBody
    chat: bool
    prompts: list[Prompt]
    rows: list[Row]
    unknown: list[str]  # fields the server does not know (accepted, named in one warning line)


def plan(served: Served, raw: bytes, chat_request: bool) -> Plan:
    """The rows a request body asks for; ApiError for anything that is not served."""
    body, unknown = parse(raw, ChatRequest if chat_request else CompletionRequest, served.strict)
    if unknown:
        names = ", ".join(n[:64] for n in unknown[:10]) + (
            f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        )
        log.warning("a request's unknown fields were ignored: %s", names)
    if body.model != served.model:
        model = body.model[:100]
        raise ApiError(
            404, f"model {model!r} is not served here; this server serves {served.model!r}", "model", "model_not_found"
        )
    prompts = [_chat_prompt(served, body)] if chat_request else [_prompt(served, body, p) for p in body.prompts()]
    rows_asked = len(prompts) * (body.n or 1)
    if rows_asked > served.scheduler.max_queue:
        raise ApiError(
            400, f"n x prompts = {rows_asked} rows, more than the queue holds ({served.scheduler.max_queue})", "n"
        )
    _check_ids(served, body.stop_token_ids or [], "stop_token_ids")
    bias = tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items()))
    _check_ids(served, [t for t, _ in bias], "logit_bias")
    rows = []
    for i, prompt in enumerate(prompts):
        tokens = _budget(served, body, len(prompt.ids))
        for j in range(body.n or 1):
            index = i * (body.n or 1) + j
            rows.append(Row(index, i, _params(body, tokens, bias), _prompt_logprobs(body)))
    return Plan(body, chat_request, prompts, rows, unknown)


# ---------------------------------------------------------------- prompts


def _prompt(served: Served, body: CompletionRequest, prompt) -> Prompt:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ApiError(400, "prompt: the prompt is empty (or only whitespace)", "prompt")
        ids = [int(t) for t in served.tokenizer(prompt)["input_ids"]]
        text = prompt
    else:
        ids = list(prompt)
        _check_ids(served, ids, "prompt")
        text = served.tokenizer.decode(ids, skip_special_tokens=bool(body.skip_special_tokens)) if body.echo else ""
    if not ids:  # a text the tokenizer turns into nothing, or an empty list of ids
        raise ApiError(400, "prompt: the prompt has no tokens", "prompt")
    return Prompt(ids, text, prompt if isinstance(prompt, str) else None)


def _chat_prompt(served: Served, body: ChatRequest) -> Prompt:
    try:
        ids = chat.encode_prompt(served.tokenizer, body.conversation())
    except Exception as err:  # noqa: BLE001 - a template's refusal (e.g. roles out of order) is the client's
        message = " ".join(str(err).split())[:200]
        raise ApiError(400, f"messages: the chat template refused them ({message})", "messages") from None
    if not ids:
        raise ApiError(400, "messages: the conversation has no tokens", "messages")
    return Prompt(ids, "")


def _check_ids(served: Served, ids: list[int], param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < served.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary [0, {served.vocab_size})", param)


# ---------------------------------------------------------------- what each row asks for


def _budget(served: Served, body: SamplingBody, prompt_len: int) -> int:
    """max_tokens of a prompt: as asked, or the default (16 for completions, OpenAI's; what the
    slot has left for chat), never more than the slot has left."""
    room = served.slots.max_new_tokens(prompt_len)
    if room < 1:
        raise ApiError(
            413,
            f"the prompt has {prompt_len} tokens, more than the cache holds with one new token "
            f"(--max-len {served.max_len}: at most {prompt_len + room - 1} prompt tokens)",
            "prompt",
            "context_length_exceeded",
        )
    asked = body.new_tokens()
    if asked is None:
        asked = room if isinstance(body, ChatRequest) else min(COMPLETION_DEFAULT_TOKENS, room)
    elif asked > room:
        param = (
            "max_completion_tokens" if isinstance(body, ChatRequest) and body.max_completion_tokens else "max_tokens"
        )
        raise ApiError(
            400,
            f"{param}={asked} does not fit: a prompt of {prompt_len} tokens leaves room for "
            f"{room} new tokens (--max-len {served.max_len})",
            param,
        )
    if (body.min_tokens or 0) > asked:
        raise ApiError(400, f"min_tokens={body.min_tokens} is more than max_tokens={asked}", "min_tokens")
    return asked


def _params(body: SamplingBody, max_tokens: int, bias: tuple) -> SamplingParams:
    """A row's settings: the request's seed (each choice draws with its own key, `row_key(seed,
    index)`), or a fresh one."""
    seed = random.getrandbits(63) if body.seed is None else body.seed
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        seed=seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        min_tokens=body.min_tokens or 0,
        logprobs=body.logprob_count(),
        logit_bias=bias,
    )


def _prompt_logprobs(body: SamplingBody) -> int | None:
    if isinstance(body, CompletionRequest) and body.echo:
        return body.logprob_count()
    return None
