"""`--data.regenerate`: replace each conversation's answer by the target's own greedy
continuation (the head then learns the distribution it will draft for).

The prompt is the conversation up to its first assistant turn, in the trainer's format
(`peagle_jax.chat.encode_prompt`); the answer is `peagle_jax.engine.generation.generate_greedy` (the
engine's mode "none"), batched. Answers are appended to a JSONL cache (one line per
conversation, flushed per batch), so an interrupted run continues where it stopped and a
rerun regenerates nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from peagle_jax.chat import encode_prompt
from peagle_jax.engine import generate_greedy

__all__ = ["regenerate"]

BATCH = 8
MAX_PROMPT = 512


def _prompt(messages):
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            return messages[:i]
    return None


def regenerate(records, target, tokenizer, cache: Path, max_new: int) -> dict[int, list[dict]]:
    """{record index: messages with the target's answer} for every record that has a prompt
    of at most MAX_PROMPT tokens (the others keep their answers)."""
    from train.data import DataError, to_messages

    cache = Path(cache)
    done: dict[int, str] = {}
    if cache.exists():
        good = []
        lines = cache.read_text().splitlines()
        for line in lines:
            try:
                rec = json.loads(line)
                done[int(rec["i"])] = rec["text"]
                good.append(line)
            except (ValueError, KeyError, TypeError):
                break  # a line cut by an interruption: regenerate from there
        if len(good) != len(lines) or not cache.read_text().endswith("\n"):
            tmp = cache.with_name(cache.name + ".tmp")
            tmp.write_text("".join(ln + "\n" for ln in good))
            os.replace(tmp, cache)
    todo, prompts = [], {}
    for i, (_, rec) in enumerate(records):
        try:
            prompt = _prompt(to_messages(rec))
        except DataError:
            continue
        if not prompt:
            continue
        prompts[i] = prompt
        if i not in done:
            ids = encode_prompt(tokenizer, prompt)
            if len(ids) <= MAX_PROMPT:
                todo.append((i, ids))
    with cache.open("a") as f:
        for s in range(0, len(todo), BATCH):
            chunk = todo[s : s + BATCH]
            outs = generate_greedy(target, [ids for _, ids in chunk], max_new)
            for (i, _), toks in zip(chunk, outs):
                text = tokenizer.decode(toks, skip_special_tokens=True)
                done[i] = text
                f.write(json.dumps({"i": i, "text": text}) + "\n")
            f.flush()
    return {i: prompts[i] + [{"role": "assistant", "content": text}] for i, text in done.items() if i in prompts}
