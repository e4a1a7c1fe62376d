"""Decode slots for continuous batching (JetStream's prefill / insert / generate) over an `Engine`.

B rows of static KV caches (target and head) hold requests that come and go. Requests are
prefilled together into a state of their own (rows in powers of two, prompts right-padded to a
bucket of LENGTH_MULTIPLE tokens: one compile per (rows, bucket)), then inserted into free rows
between steps. A step (`Engine.step`) runs the rows up to the last busy one, rounded up to a
power of two (one compile each: a server with one client pays a 1-row round); finished and free
rows are frozen (position -1), so a row is released by marking it done. Each row samples with
its own settings and key: a request's tokens never depend on the other rows.

Which slot holds what is kept here and only here (`holders`): whatever the caller inserted with
a row (a server's request) comes back with that row's news from `step`, and leaves with it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from peagle_jax.engine import cache as kv
from peagle_jax.engine.engine import Call, Engine, Tokens
from peagle_jax.engine.sampling import SamplingParams

SLOT_STOP_WIDTH = 32  # stop ids a slot's request may hold (its eos ids included)
SLOT_BIAS_WIDTH = 300  # logit biases a slot's request may hold (OpenAI's limit)
MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask for (vLLM's default --max-logprobs)


@dataclasses.dataclass(frozen=True)
class News:
    """What one row gained: its new tokens (a prefill: the first token), whether it is done, the
    rounds it ran and how many of them accepted n drafts (n = 0..K), its tokens' log-probabilities
    (token [n], top ids [n, width], top [n, width]) when kept."""

    holder: object
    ids: list[int]
    done: bool
    rounds: int = 0
    accepted: np.ndarray | None = None
    logprobs: tuple | None = None


def _placed(shape, sharding):
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)


def _news(tokens: Tokens, row: int, holder, before_rounds=0, before_accepted=None) -> News:
    count = int(tokens.end[row] - tokens.start[row])
    logprobs = None
    if tokens.logprobs is not None:
        logprobs = tuple(np.asarray(x[row, :count]) for x in tokens.logprobs)
    accepted = tokens.accepted[row] - (0 if before_accepted is None else before_accepted)
    rounds = int(tokens.rounds[row]) - before_rounds
    return News(holder, tokens.tail[row, :count].tolist(), bool(tokens.done[row]), rounds, accepted, logprobs)


@dataclasses.dataclass
class Prefilled:
    """Rows prefilled together, not yet in a slot: the state and each request's first news."""

    state: object
    news: list[News]


class Slots:
    """`batch` decode rows of `max_len` cache positions (rounded up to LENGTH_MULTIPLE) over an
    `Engine` that keeps what a request may ask for (MAX_LOGPROBS log-probabilities, token counts
    for penalties). A step (`step`) runs up to `rounds_per_step` rounds in one device loop, ending
    early after a round in which a row finished: fewer host round trips, and no row waits on a
    finished one. `abstract`: the state is only its shapes and shardings (nothing allocated), for
    the plan to compile the slots' programs (`*_call`) for a device that is not here."""

    def __init__(self, engine: Engine, batch: int, max_len: int, rounds_per_step: int = 1, *, abstract=False):
        self.engine = engine = engine.with_records(MAX_LOGPROBS, True)
        self.batch = int(batch)
        self.length = kv.round_up(max_len, kv.LENGTH_MULTIPLE)
        self.rounds_per_step = int(rounds_per_step)
        self.widths = dict(stop_width=SLOT_STOP_WIDTH, bias_width=SLOT_BIAS_WIDTH)
        self.state = self.allocate(self.batch, abstract)
        self.start = np.zeros((self.batch,), np.int32)  # out positions already handed out
        self.rounds = np.zeros((self.batch,), np.int32)  # rounds already reported
        self.accepted = np.zeros((self.batch, engine.k + 1), np.int32)
        self.holders: dict[int, object] = {}  # slot -> what holds it (inserted, not yet done or released)

    def allocate(self, rows: int, abstract: bool = False):
        """A state of `rows` free rows placed on the engine's mesh (`abstract`: its shapes only)."""
        shapes = jax.eval_shape(lambda: self.engine.empty(rows, self.length, **self.widths))
        shardings = self.engine.state_shardings(shapes)
        if abstract:
            return shapes if shardings is None else jax.tree.map(_placed, shapes, shardings)
        state = self.engine.empty(rows, self.length, **self.widths)
        return state if shardings is None else jax.device_put(state, shardings)

    # ---------------------------------------------------------------- sizes

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most new tokens a prompt of `prompt_len` tokens may ask for (< 1: it does not fit)."""
        return self.engine.fit(prompt_len, self.length)

    def bucket(self, prompt_len: int) -> int:
        return self.engine.bucket(prompt_len, self.length)

    def buckets(self) -> list[int]:
        return self.engine.buckets(self.length)

    def row_counts(self) -> list[int]:
        """The row counts a step and a prefill run at (powers of two, and the batch): one compile each."""
        return sorted({min(1 << i, self.batch) for i in range(self.batch.bit_length() + 1)})

    def rows_for(self, n: int) -> int:
        return next(r for r in self.row_counts() if r >= n)

    def free(self) -> list[int]:
        return [s for s in range(self.batch) if s not in self.holders]

    # ---------------------------------------------------------------- verbs

    def prefill_call(self, requests: list[tuple[list[int], SamplingParams, object]]) -> Call:
        """`prefill`'s program and arguments: requests (prompt ids, params, key), at most `batch`."""
        prompts, params, keys = (list(x) for x in zip(*requests))
        rows = self.rows_for(len(requests))
        return self.engine.prefill_call(prompts, params, self.length, rows=rows, keys=keys, **self.widths)

    def prefill(self, requests: list[tuple[list[int], SamplingParams, object]], holders: list) -> Prefilled:
        """Requests (prompt ids, params, key) prefilled together: their state and first news (a
        request whose first token ends it is done already: nothing to insert)."""
        state = self.prefill_call(requests).run()
        tokens = self.engine.read(state, np.zeros((len(state.done),), np.int32), 1)
        return Prefilled(state, [_news(tokens, i, h) for i, h in enumerate(holders)])

    def insert_call(self, part, slots) -> Call:
        return self.engine.insert_call(self.state, part, slots)

    def insert(self, prefilled: Prefilled, slots: list[int]) -> None:
        """Puts the prefilled rows that are not done into `slots` (one each, in order)."""
        rows = [i for i, n in enumerate(prefilled.news) if not n.done]
        if not rows:
            return
        dst = np.full((len(prefilled.state.done),), self.batch, np.int32)  # past the end: not inserted
        dst[rows] = slots[: len(rows)]
        self.state = self.insert_call(prefilled.state, dst).run()
        for i, slot in zip(rows, slots):
            self.start[slot], self.rounds[slot], self.accepted[slot] = 1, 0, 0  # the first token went out
            self.holders[slot] = prefilled.news[i].holder

    def release(self, slots) -> None:
        """Frees `slots`: their rows stop decoding from the next step on."""
        slots = [s for s in slots if s in self.holders]
        if not slots:
            return
        rows = np.zeros((self.batch,), bool)
        rows[slots] = True
        self.state = self.engine.release(self.state, rows)
        for s in slots:
            del self.holders[s]

    def step_call(self, rows: int) -> Call:
        return self.engine.step_call(self.state, self.rounds_per_step, rows)

    def step(self, rows: int | None = None) -> list[News]:
        """One step over the rows up to the last busy one (`rows`: that many): each busy slot's
        news; a slot whose request is done is free again."""
        if rows is None:
            rows = self.rows_for(max(self.holders, default=-1) + 1)
        self.state = self.step_call(rows).run()
        width = self.rounds_per_step * (self.engine.k + 1)
        tokens = self.engine.read(self.state, self.start, width)
        news = []
        for slot, holder in sorted(self.holders.items()):
            news.append(_news(tokens, slot, holder, int(self.rounds[slot]), self.accepted[slot]))
        self.start, self.rounds = np.array(tokens.end, np.int32), np.array(tokens.rounds, np.int32)
        self.accepted = np.array(tokens.accepted, np.int32)
        for slot in [s for s in self.holders if tokens.done[s]]:
            del self.holders[slot]
        return news
