"""Conversations -> token ids (inference prompts; the trainer adds its assistant-token mask here).

A conversation is a list of ``{"role": ..., "content": ...}`` messages. With a tokenizer that
has a chat template the template is used (``add_generation_prompt=True`` for a prompt);
without one (base models such as Gemma-3-270M) the contents are joined by newlines and
tokenized plainly, with the tokenizer's default special tokens (e.g. a leading BOS).
"""

from __future__ import annotations

Message = dict[str, str]
Conversation = list[Message]


def user_turn(content: str) -> Conversation:
    """A one-message conversation."""
    return [{"role": "user", "content": content}]


def _as_list(ids) -> list[int]:
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding by default
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


# ---------------------------------------------------------------------------------------
# training side: conversation -> (ids, assistant-token loss mask)
PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


class ConversationError(ValueError):
    """A conversation that cannot be encoded for training (the message says why)."""


def _check_messages(messages) -> list[Message]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConversationError("a conversation must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConversationError(f"message {i} is not {{'role': str, 'content': str}}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise ConversationError("no assistant turn")
    return out


def _plain_turn(message: Message) -> str:
    role = PLAIN_ROLES.get(message["role"], message["role"].capitalize())
    return f"{role}: {message['content']}"


def plain_prompt_text(messages: Conversation | str) -> str:
    """The fallback format of a prompt (no chat template): `User: ...` turns joined by
    newlines, then `Assistant:` (the generation prompt), exactly as training writes it."""
    if isinstance(messages, str):
        messages = user_turn(messages)
    return "\n".join(_plain_turn(m) for m in messages) + "\nAssistant:"


def encode_prompt(tokenizer, messages: Conversation | str) -> list[int]:
    """Token ids of a prompt conversation (a string is one user turn), in the format the
    trainer writes: the chat template with ``add_generation_prompt=True`` when the tokenizer
    has one, else `plain_prompt_text` (``User: ...`` turns, then ``Assistant:``) tokenized with
    the tokenizer's default special tokens (e.g. a leading BOS). Inference and training share it:
    a head served on another prompt format than it was trained on loses acceptance."""
    if isinstance(messages, str):
        messages = user_turn(messages)
    if getattr(tokenizer, "chat_template", None):
        return _as_list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True))
    return _as_list(tokenizer(plain_prompt_text(messages))["input_ids"])


def _template_ids(tokenizer, messages) -> tuple[list[int], list[bool]]:
    """Chat template with an assistant mask: rendered prefix by prefix, so a token is
    supervised when it belongs to an assistant message's rendering (no {% generation %}
    block needed). A template that re-renders earlier turns differently is refused."""
    ids: list[int] = []
    mask: list[bool] = []
    for i, m in enumerate(messages):
        full = _as_list(tokenizer.apply_chat_template(messages[: i + 1], tokenize=True))
        if full[: len(ids)] != ids:
            raise ConversationError(
                "the chat template renders earlier turns differently once a turn is "
                "added (cannot place the assistant mask)"
            )
        new = full[len(ids) :]
        if m["role"] == "assistant":
            # the header of the turn (e.g. '<start_of_turn>model\n') is what the generation prompt adds
            head = (
                _as_list(tokenizer.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True))
                if i
                else []
            )
            n_head = len(head) - len(ids) if head[: len(ids)] == ids and len(head) >= len(ids) else 0
            mask += [False] * n_head + [True] * (len(new) - n_head)
        else:
            mask += [False] * len(new)
        ids = full
    return ids, mask


def _plain_ids(tokenizer, messages, eos_id) -> tuple[list[int], list[bool]]:
    ids = _as_list(tokenizer("")["input_ids"])  # default specials, e.g. BOS
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        sep = "\n" if i else ""
        if m["role"] == "assistant":
            head = _as_list(tokenizer(sep + "Assistant:", add_special_tokens=False)["input_ids"])
            body = _as_list(tokenizer(" " + m["content"], add_special_tokens=False)["input_ids"])
            tail = [eos_id] if eos_id is not None else []
            ids += head + body + tail
            mask += [False] * len(head) + [True] * (len(body) + len(tail))
        else:
            part = _as_list(tokenizer(sep + _plain_turn(m), add_special_tokens=False)["input_ids"])
            ids += part
            mask += [False] * len(part)
    return ids, mask


def encode_training(tokenizer, messages: Conversation, *, template: str = "auto") -> tuple[list[int], list[bool]]:
    """(token ids, loss mask) of a training conversation: True on the assistant tokens.

    template: "auto" (the chat template when the tokenizer has one, else plain), "chat" or
    "plain". Plain format: `User: ...\\nAssistant: <answer><eos>` turns joined by newlines
    (the answer and its EOS supervised, the `Assistant:` header not), after the tokenizer's
    default leading specials (BOS). Raises ConversationError (no assistant turn, malformed
    message)."""
    messages = _check_messages(messages)
    has = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has:
        raise ConversationError("template='chat' but the tokenizer has no chat template")
    if template not in ("auto", "chat", "plain"):
        raise ValueError(f"template must be auto, chat or plain, got {template!r}")
    if has and template != "plain":
        return _template_ids(tokenizer, messages)
    return _plain_ids(tokenizer, messages, getattr(tokenizer, "eos_token_id", None))
