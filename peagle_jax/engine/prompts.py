"""Evaluation prompt sets as chat conversations, and their tokenization.

``load_prompts(source, limit=None)`` returns a list of conversations, each a list of
``{"role": ..., "content": ...}`` messages ending with a user turn, ready for a chat template.
``source`` is one of:

``"mtbench"``
    The 80 MT-Bench questions (FastChat, Apache-2.0, vendored in ``peagle_jax/engine/data``). Only the
    **first user turn** of each question becomes a conversation: the second turn is a follow-up
    to the model's own first answer, which a prompt set fixed ahead of generation does not have,
    and the first turns alone cover all 8 categories (writing, roleplay, reasoning, math,
    coding, extraction, stem, humanities; 10 each). File order (question_id 81..160).
``"humaneval"``
    The 164 HumanEval problems (OpenAI, MIT, vendored in ``peagle_jax/engine/data``), each as one user turn::

        Complete the following Python function:
        ```python
        <the problem's prompt: signature + docstring>
        ```

    (every HumanEval prompt ends with a newline, so the closing fence is on its own line).
    File order (HumanEval/0..163).
a path to a JSONL file
    One JSON object per line (blank lines skipped), holding exactly one of
    ``{"prompt": str}`` (one user turn), ``{"messages": [{"role": str, "content": str}, ...]}``
    (used as given), or ``{"turns": [str, ...]}`` (MT-Bench style: the first turn becomes one
    user turn, as for ``"mtbench"``). Other keys are ignored. A malformed row raises
    ``ValueError`` naming the file and the 1-based line number.
Tokenization is `peagle_jax.conversations.chat`.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from peagle_jax.conversations.chat import Conversation, encode_prompt, user_turn

__all__ = ["DATA_DIR", "PROMPT_SETS", "load_prompts", "prompt_ids"]

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"
MTBENCH_FILE = DATA_DIR / "mt_bench_questions.jsonl"
HUMANEVAL_FILE = DATA_DIR / "HumanEval.jsonl.gz"
PROMPT_SETS = ("mtbench", "humaneval")

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"


def _json_rows(path: pathlib.Path) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed JSON) for every non-blank line; bad JSON names file:line."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


def _row_to_conversation(row: Any, where: str) -> Conversation:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    present = [k for k in ("prompt", "messages", "turns") if k in row]
    if len(present) != 1:
        what = "none" if not present else " and ".join(repr(k) for k in present)
        raise ValueError(f"{where}: a row needs exactly one of 'prompt', 'messages', 'turns' (found {what})")
    key = present[0]
    value = row[key]
    if key == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        return user_turn(value)
    if key == "turns":
        if not isinstance(value, list) or not value or not all(isinstance(t, str) and t for t in value):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        return user_turn(value[0])
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    messages: Conversation = []
    for i, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not m["role"]
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def _load_mtbench() -> list[Conversation]:
    out = []
    for lineno, row in _json_rows(MTBENCH_FILE):
        out.append(_row_to_conversation({"turns": row.get("turns")}, f"{MTBENCH_FILE}:{lineno}"))
    return out


def _load_humaneval() -> list[Conversation]:
    out = []
    for lineno, row in _json_rows(HUMANEVAL_FILE):
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{HUMANEVAL_FILE}:{lineno}: no 'prompt' string")
        out.append(user_turn(HUMANEVAL_TEMPLATE.format(prompt=prompt)))
    return out


def _load_jsonl(path: pathlib.Path) -> list[Conversation]:
    return [_row_to_conversation(row, f"{path}:{lineno}") for lineno, row in _json_rows(path)]


def load_prompts(source: str | os.PathLike, limit: int | None = None) -> list[Conversation]:
    """Conversations of ``source`` ("mtbench", "humaneval" or a JSONL path), the first
    ``limit`` of them when given. See the module docstring for the formats."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    name = os.fspath(source)
    if name.lower().replace("-", "").replace("_", "") in PROMPT_SETS:
        key = name.lower().replace("-", "").replace("_", "")
        conversations = _load_mtbench() if key == "mtbench" else _load_humaneval()
    else:
        path = pathlib.Path(name).expanduser()
        if not path.is_file():
            raise ValueError(
                f"prompt source {name!r} is neither one of {', '.join(PROMPT_SETS)} nor an existing JSONL file"
            )
        conversations = _load_jsonl(path)
    return conversations if limit is None else conversations[:limit]


def prompt_ids(tokenizer, conversations, max_tokens: int | None = None, limit: int | None = None) -> list[list[int]]:
    """Token ids of `conversations` in the trainer's prompt format (`peagle_jax.conversations.chat.encode_prompt`);
    prompts over `max_tokens` are left out; at most `limit` of them."""
    out = []
    for conversation in conversations:
        ids = encode_prompt(tokenizer, conversation)
        if max_tokens is None or len(ids) <= max_tokens:
            out.append(ids)
        if limit is not None and len(out) >= limit:
            break
    return out
