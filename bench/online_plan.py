"""What `bench.online_loop` sends and how long it trains, decided before anything runs: the domain's
prompts split into a served set and a held-out set never sent, the requests drawn from the served
set, and the fine-tune's steps from a measured step time. Pure functions of their arguments (a
seed), so a rerun of the loop decides the same."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from peagle_jax.conversations.chat import user_turn

TINY_WORDS = 56  # the tiny preset target's words w0..w55 (train.tiny)


def split_prompts(count: int, heldout: int, seed: int) -> tuple[list[int], list[int]]:
    """(served, held out): the indices 0..count-1 in a seeded shuffle, its first `heldout` held out;
    each part in ascending order."""
    if not 0 < heldout < count:
        raise ValueError(f"--heldout must be between 1 and {count - 1} (the set has {count} prompts), got {heldout}")
    order = np.random.default_rng(seed).permutation(count)
    return sorted(map(int, order[heldout:])), sorted(map(int, order[:heldout]))


def plan_requests(served: list[int], count: int, max_tokens: int, temperature: float, seed: int) -> list[dict]:
    """`count` requests cycling over the served prompts, each pass in a seeded shuffle of its own: a
    prompt's first request is greedy, its later ones sample at `temperature` with a seed of their own
    (so the log holds several answers per prompt). A request: {"index", "prompt", "max_tokens",
    "temperature", "seed"}."""
    rng = np.random.default_rng(seed + 1)
    requests = []
    while len(requests) < count:
        first_pass = not requests
        for prompt in rng.permutation(served)[: count - len(requests)]:
            index = len(requests)
            request = {"index": index, "prompt": int(prompt), "max_tokens": max_tokens}
            request |= {"temperature": 0.0, "seed": None} if first_pass else {"temperature": temperature, "seed": index}
            requests.append(request)
    return requests


def smoke_prompts(count: int, domain: int, seed: int) -> list[list[dict]]:
    """Prompts for the tiny preset target (its word tokenizer): `count` user turns of 6 to 12 words,
    domain 0 drawn from the first half of its words, domain 1 from the second (two 'domains')."""
    rng = np.random.default_rng(seed + domain)
    half = TINY_WORDS // 2
    words = [rng.integers(0, half, size=rng.integers(6, 13)) + domain * half for _ in range(count)]
    return [user_turn(" ".join(f"w{w}" for w in ws)) for ws in words]


def step_seconds(metrics: Path) -> float:
    """The median time of a training step in a `python -m train` run's metrics.jsonl, the first
    step (its compile) left out: each step line holds its tokens and the run's tokens per second
    so far, so the time to the end of step i is tokens up to i over that rate."""
    steps = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    steps = [s for s in steps if "tokens_per_second" in s]
    ends = np.cumsum([s["tokens"] for s in steps]) / np.array([s["tokens_per_second"] for s in steps])
    if len(ends) < 3:
        raise ValueError(f"{metrics}: {len(ends)} steps; the step time needs at least 3")
    return float(np.median(np.diff(ends)))


def steps_for(budget_seconds: float, seconds_per_step: float) -> int:
    """The steps a training budget holds (at least 1)."""
    return max(1, int(budget_seconds // seconds_per_step))
