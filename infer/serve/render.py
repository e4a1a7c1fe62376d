"""OpenAI's response objects, built from what a request's choices gathered (pure functions).

Log-probabilities come from the scheduler's events (`TokenLogprob`: a token's own, and the most
likely tokens there); a token is shown as its own decoded text. -inf is written as -9999.0, as
OpenAI and vLLM do (JSON has no infinity). Completions: `{tokens, token_logprobs, top_logprobs,
text_offset}`, each top_logprobs entry a {token: logprob} map of the emitted token and the most
likely ones; chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from infer.serve.scheduler import TokenLogprob

LOGPROB_FLOOR = -9999.0

Decode = Callable[[int], str]  # one token id -> its text


def _value(logprob: float) -> float:
    return max(float(logprob), LOGPROB_FLOOR)


def completion_logprobs(ids: list[int], entries: list[TokenLogprob | None], decode: Decode, offset: int = 0) -> dict:
    """The completions `logprobs` object of these tokens; `offset`: where the first token's text
    starts in the choice's text (after the echoed prompt, or the text already streamed). An entry
    None (a prompt's first token: nothing precedes it) has null values."""
    tokens = [decode(t) for t in ids]
    starts = []
    for token in tokens:
        starts.append(offset)
        offset += len(token)
    values, tops = [], []
    for token, entry in zip(tokens, entries):
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_value(entry.logprob))
        top = {token: _value(entry.logprob)}
        for t, lp in entry.top:
            top.setdefault(decode(t), _value(lp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": starts}


def _chat_token(token: str, logprob: float | None) -> dict:
    return {
        "token": token,
        "logprob": None if logprob is None else _value(logprob),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def chat_logprobs(ids: list[int], entries: list[TokenLogprob | None], decode: Decode) -> dict:
    """The chat `logprobs` object of these tokens."""
    content = []
    for t, entry in zip(ids, entries):
        item = _chat_token(decode(t), None if entry is None else entry.logprob)
        item["top_logprobs"] = [] if entry is None else [_chat_token(decode(i), lp) for i, lp in entry.top]
        content.append(item)
    return {"content": content}


def join_logprobs(parts: list[dict], chat: bool) -> dict | None:
    """One logprobs object of a choice from those of its pieces (None: none were asked)."""
    if not parts:
        return None
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for p in parts for v in p[k]] for k in keys}


# ---------------------------------------------------------------- objects and chunks


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(call_id: str, created: int, model: str, chat: bool, chunk: bool) -> dict:
    """The fields every response object and chunk of one request share."""
    kind = ("chat.completion" + (".chunk" if chunk else "")) if chat else "text_completion"
    prefix = "chatcmpl-" if chat else "cmpl-"
    return {"id": prefix + call_id, "object": kind, "created": created, "model": model}


def choice(index: int, text: str, reason: str | None, logprobs: dict | None, chat: bool) -> dict:
    """A choice of a whole (non-streamed) response."""
    if chat:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def delta(index: int, text: str | None, reason: str | None, logprobs: dict | None, chat: bool, first=False) -> dict:
    """A choice of a chunk: new text (chat: a delta; the first one names the role)."""
    if not chat:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
    body = {"role": "assistant", "content": text or ""} if first else ({} if text is None else {"content": text})
    return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": reason}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
