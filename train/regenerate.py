"""`--data.regenerate`: replace each conversation's answer by the target's own greedy
continuation (the head then learns the distribution it will draft for).

The prompt is the conversation up to its first assistant turn, in the trainer's format
(`peagle_jax.conversations.chat.encode_prompt`). The answer comes from the engine in process
(`peagle_jax.engine.generate_greedy`, the engine's mode "none"): prompts sorted by length and cut
into batches of `batch`, so a batch holds prompts of similar length (little padding, few compiled
shapes), its rows split over the mesh's data x fsdp devices as the train step splits its batch.
Or it comes from a server of the target (`train.regenerate_endpoint`: vLLM, SGLang).

Answers are appended to a JSONL cache as they arrive (one line per conversation, its text and the
generated token ids), so an interrupted or failed run continues where it stopped and a rerun
regenerates nothing.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from peagle_jax.conversations.chat import encode_prompt
from peagle_jax.engine import generate_greedy
from train.regenerate_endpoint import Answer, Endpoint, EndpointError, Job, generate_remote

__all__ = ["regenerate", "regenerate_for", "read_cache", "Endpoint", "EndpointError"]

BATCH = 8
MAX_PROMPT = 512


def _prompt(messages):
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            return messages[:i]
    return None


def read_cache(cache: Path) -> dict[int, str]:
    """{conversation index: answer text} of a cache; a last line cut by an interruption (and
    anything after it) is dropped from the file, so appending continues on a clean line."""
    done: dict[int, str] = {}
    if not cache.exists():
        return done
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
    return done


def _jobs(records, tokenizer, done) -> tuple[dict[int, list], list[Job]]:
    """(prompt messages by index, the conversations still to answer): those with a prompt of at
    most MAX_PROMPT tokens and no answer in the cache."""
    from train.data import DataError, to_messages

    prompts, todo = {}, []
    for i, (where, rec) in enumerate(records):
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
                todo.append(Job(i, where, ids, prompt))
    return prompts, todo


def place_on_mesh(target, mesh) -> None:
    """The target's weights on `mesh` by the sharding rules, as `load_target(mesh=...)` places them
    (the engine then splits a batch's rows over data x fsdp); nothing for one device."""
    if mesh is None or mesh.size == 1 or target.mesh is not None:
        return
    from peagle_jax.runtime.sharding import shard_state

    target.state, target.mesh = shard_state(target.state, mesh), mesh


def generate_local(
    target, tokenizer, jobs, max_new: int, batch: int, on_answer: Callable, progress: bool = False
) -> None:
    """Every job's answer from the engine in process, shortest prompts first, `batch` at a time."""
    from tqdm import tqdm

    ordered = sorted(jobs, key=lambda j: len(j.ids))  # stable: ties keep the source order
    with tqdm(total=len(jobs), unit="conv", desc="regenerate", disable=not progress, dynamic_ncols=True) as bar:
        for s in range(0, len(ordered), batch):
            chunk = ordered[s : s + batch]
            outs = generate_greedy(target, [j.ids for j in chunk], max_new)
            for job, toks in zip(chunk, outs):
                on_answer(job, Answer(tokenizer.decode(toks, skip_special_tokens=True), list(toks)))
            bar.update(len(chunk))


def regenerate(
    records,
    target,
    cache: Path,
    max_new: int,
    *,
    batch: int = BATCH,
    endpoint: Endpoint | None = None,
    mesh=None,
    progress: bool = False,
) -> dict[int, list[dict]]:
    """{record index: messages with the target's answer} for every record that has a prompt
    of at most MAX_PROMPT tokens in the target's tokenizer (the others keep their answers). The answers come from the
    engine in process (`batch` conversations a call, on `mesh` when given), or from `endpoint`.
    EndpointError (one line, the cache kept) when the endpoint fails."""
    cache, tokenizer = Path(cache), target.tokenizer
    done = read_cache(cache)
    prompts, todo = _jobs(records, tokenizer, done)
    mismatched: list[str] = []
    with cache.open("a") as f:

        def write(job: Job, answer: Answer) -> None:
            line = {"i": job.index, "text": answer.text}
            if answer.ids is not None:
                line["ids"] = answer.ids
            f.write(json.dumps(line) + "\n")
            f.flush()  # an interruption loses at most the line being written
            done[job.index] = answer.text
            if answer.mismatch:
                mismatched.append(f"{job.where}: {answer.mismatch}")

        try:
            if endpoint is None:
                place_on_mesh(target, mesh)
                generate_local(target, tokenizer, todo, max_new, batch, write, progress)
            else:
                stops = target.eos_token_ids
                vocab = target.config.vocab_size
                kw = dict(max_new=max_new, stop_ids=stops, vocab=vocab, on_answer=write, progress=progress)
                generate_remote(todo, tokenizer, endpoint, **kw)
        except EndpointError as e:
            kept = sum(i in done for i in prompts)
            if not kept:  # nothing to resume from: the run's folder may go (train.loop.leave_out says)
                raise EndpointError(f"{e}; no answer was regenerated") from None
            raise EndpointError(f"{e}; {kept} of {len(prompts)} answers are in {cache}: rerun to resume") from None
    if mismatched:
        print(
            f"warning: {len(mismatched)} regenerated answers did not check out, e.g. {mismatched[0]}", file=sys.stderr
        )
    return {i: prompts[i] + [{"role": "assistant", "content": text}] for i, text in done.items() if i in prompts}


def regenerate_for(cfg, records, target, out: Path, mesh=None, progress: bool = False) -> dict:
    """`regenerate` with a run's flags (`data.regenerate_*`) into OUT/regenerated.jsonl."""
    d = cfg.data
    endpoint = None
    if d.regenerate_endpoint is not None:
        endpoint = Endpoint(
            url=d.regenerate_endpoint,
            api=d.regenerate_api,
            model=d.regenerate_model,
            concurrency=d.regenerate_concurrency,
            timeout=d.regenerate_timeout,
            retries=d.regenerate_retries,
        )
    cache = Path(out) / "regenerated.jsonl"
    opts = dict(batch=d.regenerate_batch, endpoint=endpoint, mesh=mesh, progress=progress)
    return regenerate(records, target, cache, d.regenerate_tokens, **opts)
