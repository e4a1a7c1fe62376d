"""Decode slots for continuous batching over an `Engine`: requests prefilled in their slots, piece
by piece and together, while the others decode.

B rows of static KV caches (target and head) hold requests that come and go. `admit` gives a
request a free slot; `prefill` runs one piece of the waiting prompts, several requests in one
call (rows in powers of two), into their own slots (`Engine.extend`: chunked prefill), at most
`prefill_tokens` prompt tokens a call: about what a step verifies while a full batch decodes, so
a long prompt never stalls the decoding slots for much more than a step, and up to
`prefill_tokens`' share of the slots not decoding while the batch fills up (`budget`); a request
whose prompt is done has its first token and decodes from the next `step` on. A step
(`Engine.step`) runs the rows up to the last busy one, rounded up to a power of two; finished,
free and still-prefilling rows are frozen (position -1). Every shape a call may take is in
`shapes()`, so a server compiles them all before it serves (`warm_up`). Each row samples with its
own settings and key: a request's tokens never depend on the other rows.

Which slot holds what is kept here and only here (`holders`): whatever the caller admitted with a
request (a server's job) comes back with that row's news, and leaves with it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from peagle_jax.engine import cache as kv
from peagle_jax.engine import speculative as sp
from peagle_jax.engine.engine import Call, Engine, Tokens, to_host
from peagle_jax.engine.sampling import SamplingParams, row_key

SLOT_STOP_WIDTH = 32  # stop ids a slot's request may hold (its eos ids included)
SLOT_BIAS_WIDTH = 300  # logit biases a slot's request may hold (OpenAI's limit)
MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask for (vLLM's default --max-logprobs)
PIECE = 16  # the shortest prompt piece; pieces are powers of two: one compile per (rows, piece length)


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class News:
    """What one row gained: its new tokens (a prefill: the first token), whether it is done, the
    rounds it ran and how many of them accepted n drafts (n = 0..K), its tokens' log-probabilities
    (token [n], top ids [n, width], top [n, width]) when kept, and, with its first token, its
    prompt's (one (log-probability, [(id, log-probability)]) per prompt token after the first)
    when it asked."""

    holder: object
    ids: list[int]
    done: bool
    rounds: int = 0
    accepted: np.ndarray | None = None
    logprobs: tuple | None = None
    prompt_logprobs: list | None = None


@dataclasses.dataclass
class Filling:
    """A request whose prompt is being prefilled in its slot: `done` of its tokens so far."""

    ids: list[int]
    params: SamplingParams
    key: object
    done: int = 0
    prompt_logprobs: list | None = None


def _placed(shape, sharding):
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)


def _logprobs(tokens: Tokens, row: int, count: int):
    if tokens.logprobs is None:
        return None
    return tuple(np.asarray(x[row, :count]) for x in tokens.logprobs)


class Slots:
    """`batch` decode rows of `max_len` cache positions (rounded up to LENGTH_MULTIPLE) over an
    `Engine` that keeps what a request may ask for (MAX_LOGPROBS log-probabilities, token counts
    for penalties). A step runs up to `rounds_per_step` rounds in one device loop, ending early
    after a round in which a row finished. A prefill call runs at most `prefill_tokens` prompt
    tokens (rows x piece length), less while slots decode (`budget`). `abstract`: the state is
    only its shapes and shardings (nothing allocated), for the plan to compile the slots' programs
    (`*_call`) for a device not here."""

    def __init__(self, engine: Engine, batch: int, max_len: int, rounds_per_step: int = 1, *,
                 prefill_tokens: int | None = None, abstract: bool = False):  # fmt: skip
        self.engine = engine = engine.with_records(MAX_LOGPROBS, True)
        self.batch = int(batch)
        self.length = kv.round_up(max_len, kv.LENGTH_MULTIPLE)
        self.rounds_per_step = int(rounds_per_step)
        self.prefill_tokens = max(PIECE, _pow2_floor(prefill_tokens or self.length))
        self.widths = dict(stop_width=SLOT_STOP_WIDTH, bias_width=SLOT_BIAS_WIDTH)
        self.state = self.allocate(self.batch, abstract)
        self.start = np.zeros((self.batch,), np.int32)  # out positions already handed out
        self.rounds = np.zeros((self.batch,), np.int32)  # rounds already reported
        self.accepted = np.zeros((self.batch, engine.k + 1), np.int32)
        self.holders: dict[int, object] = {}  # slot -> what holds it (admitted, not yet done or released)
        self.filling: dict[int, Filling] = {}  # the slots whose prompt is being prefilled, in admission order

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

    def row_counts(self) -> list[int]:
        """The row counts a step runs at (powers of two, and the batch): one compile each."""
        return sorted({min(1 << i, self.batch) for i in range(self.batch.bit_length() + 1)})

    def rows_for(self, n: int) -> int:
        return next(r for r in self.row_counts() if r >= n)

    def budget(self) -> int:
        """The prompt tokens the next prefill call may run (a power of two, at most
        `prefill_tokens`): the larger of about what a step verifies ((K + 1) x the decoding
        slots: a full batch's streams stall for about one step) and `prefill_tokens`' share of
        the slots not decoding (a batch filling up is admitted in a few calls: each step over
        empty slots is throughput lost, the stall falls on few streams)."""
        running = len(self.running)
        step = _pow2_floor((self.engine.k + 1) * running)
        idle_share = _pow2_ceil(max(self.prefill_tokens * (self.batch - running) // self.batch, 1))
        return max(PIECE, min(self.prefill_tokens, max(step, idle_share)))

    def prefill_rows(self, budget: int | None = None) -> list[int]:
        """The row counts a prefill call of `budget` prompt tokens runs at: each row takes at least
        one piece."""
        most = (budget or self.prefill_tokens) // PIECE
        return [r for r in self.row_counts() if r <= most] or [1]

    def piece_limit(self, rows: int, budget: int | None = None) -> int:
        """The longest piece (a power of two) a prefill call of `rows` rows gives each."""
        return max(PIECE, min(_pow2_floor((budget or self.prefill_tokens) // rows), _pow2_floor(self.length)))

    def shapes(self) -> dict[str, list]:
        """Every shape a call takes: prefill (rows, piece length) and step rows."""
        pieces = lambda r: [1 << i for i in range(PIECE.bit_length() - 1, self.piece_limit(r).bit_length())]  # noqa: E731
        return {"prefill": [(r, t) for r in self.prefill_rows() for t in pieces(r)], "step": self.row_counts()}

    def free(self) -> list[int]:
        return [s for s in range(self.batch) if s not in self.holders]

    @property
    def running(self) -> list[int]:
        return [s for s in self.holders if s not in self.filling]

    # ---------------------------------------------------------------- verbs

    def admit(self, requests: list[tuple[list[int], SamplingParams, object]], holders: list) -> list[int]:
        """Free slots (the lowest first) for requests (prompt ids, params, key): their prompts are
        prefilled by the next `prefill` calls. ValueError, before any slot is taken, when one does
        not fit, or when there are more requests than free slots."""
        for ids, params, _ in requests:
            self.engine.check_fit(len(ids), params.max_tokens, self.length)
        slots = self.free()[: len(requests)]
        if len(slots) < len(requests):
            raise ValueError(f"{len(requests)} requests for {len(slots)} free slots")
        for slot, (ids, params, key), holder in zip(slots, requests, holders):
            self.holders[slot] = holder
            self.filling[slot] = Filling(list(ids), params, key)
        return slots

    def prefill_call(self, slots: list[int] | None = None, piece: int | None = None) -> Call:
        """The next prefill call's program and arguments: a piece of each filling slot's prompt
        (the first admitted first; `slots` / `piece`: those, at that piece length)."""
        rows, pieces = self.next_prefill() if slots is None else (slots, piece)
        count = self.rows_for(len(rows))
        chunk, params, keys = self._chunk(rows, pieces, count)
        sampling = self.engine.sampling(params, count, keys, **self.widths)
        return self.engine.extend_call(self.state, np.array(rows + [self.batch] * (count - len(rows))), chunk, sampling)

    def next_prefill(self) -> tuple[list[int], int]:
        """The filling slots the next prefill call takes (the first admitted first), and its piece
        length, within `budget`."""
        budget = self.budget()
        rows = list(self.filling)[: max(self.prefill_rows(budget))]
        limit = self.piece_limit(self.rows_for(len(rows)), budget)
        longest = max(len(self.filling[s].ids) - self.filling[s].done for s in rows)
        return rows, min(_pow2_ceil(max(longest, PIECE)), limit)

    def _chunk(self, rows: list[int], piece: int, count: int) -> tuple[sp.Chunk, list, list]:
        tokens = np.zeros((count, piece), np.int32)
        start, length, after, budget = (np.zeros((count,), np.int32) for _ in range(4))
        final = np.zeros((count,), bool)
        params, keys = [], []
        for i, slot in enumerate(rows):
            f = self.filling.get(slot)  # None: a row of nothing (warm-up), nothing is written
            ids, done = (f.ids, f.done) if f else ([], 0)
            n = min(len(ids) - done, piece)
            tokens[i, :n], start[i], length[i] = ids[done : done + n], done, n
            final[i] = f is not None and done + n == len(ids)
            after[i] = ids[done + n] if f is not None and not final[i] else 0
            budget[i] = f.params.max_tokens if f else 1
            params.append(f.params if f else SamplingParams(1))
            keys.append(f.key if f else jax.random.key(0))
        arrays = (jax.numpy.asarray(x) for x in (tokens, start, length, after, final, budget))
        return sp.Chunk(*arrays), params, keys

    def intact(self) -> bool:
        """Whether the state is still there (a call that failed after taking it leaves it deleted)."""
        return not any(x.is_deleted() for x in jax.tree.leaves(self.state) if isinstance(x, jax.Array))

    def prefill(self, rows: list[int] | None = None, piece: int | None = None) -> list[News]:
        """One prefill call: a piece of the filling prompts (`rows` / `piece`: as `next_prefill`
        gives them). The news of each request whose prompt is done (its first token; done already
        when that token ends it: its slot is free again)."""
        if rows is None:
            rows, piece = self.next_prefill()
        self.state, prompt_lp = self.prefill_call(rows, piece).run()
        tokens = self.engine.read(self.state, np.zeros((self.batch,), np.int32), 1)
        asked = any(self.filling[s].params.prompt_logprobs is not None for s in rows)
        prompt_lp = to_host(prompt_lp) if asked else None
        news = []
        for i, slot in enumerate(rows):
            f = self.filling[slot]
            n = min(len(f.ids) - f.done, piece)
            if f.params.prompt_logprobs is not None and prompt_lp is not None:
                f.prompt_logprobs = (f.prompt_logprobs or []) + _entries(prompt_lp, i, n, f.params.prompt_logprobs)
            f.done += n
            if f.done == len(f.ids):
                news.append(self._started(slot, f, tokens))
        return news

    def _started(self, slot: int, f: Filling, tokens: Tokens) -> News:
        """The news of a slot whose prompt is done; the slot decodes from now on (or is free again)."""
        del self.filling[slot]
        holder = self.holders[slot]
        done = bool(tokens.done[slot])
        prompt = None if f.prompt_logprobs is None else f.prompt_logprobs[: len(f.ids) - 1]
        news = News(holder, tokens.tail[slot, :1].tolist(), done, logprobs=_logprobs(tokens, slot, 1),
                    prompt_logprobs=prompt)  # fmt: skip
        self.start[slot], self.rounds[slot], self.accepted[slot] = 1, 0, 0  # the first token went out
        if done:
            del self.holders[slot]
        return news

    def release(self, slots) -> None:
        """Frees `slots`: their rows stop decoding (or prefilling) from the next call on."""
        slots = [s for s in slots if s in self.holders]
        if not slots:
            return
        rows = np.zeros((self.batch,), bool)
        rows[slots] = True
        self.state = self.engine.release(self.state, rows)
        for s in slots:
            del self.holders[s]
            self.filling.pop(s, None)

    def step_call(self, rows: int) -> Call:
        return self.engine.step_call(self.state, self.rounds_per_step, rows)

    def step(self, rows: int | None = None) -> list[News]:
        """One step over the rows up to the last decoding one (`rows`: that many): each decoding
        slot's news; a slot whose request is done is free again."""
        running = self.running
        if rows is None:
            rows = self.rows_for(max(running, default=-1) + 1)
        self.state = self.step_call(rows).run()
        width = self.rounds_per_step * (self.engine.k + 1)
        tokens = self.engine.read(self.state, self.start, width)
        news = []
        for slot in sorted(running):
            count = int(tokens.end[slot] - tokens.start[slot])
            rounds = int(tokens.rounds[slot]) - int(self.rounds[slot])
            accepted = tokens.accepted[slot] - self.accepted[slot]
            news.append(News(self.holders[slot], tokens.tail[slot, :count].tolist(), bool(tokens.done[slot]),
                             rounds, accepted, _logprobs(tokens, slot, count)))  # fmt: skip
        self.start, self.rounds = np.array(tokens.end, np.int32), np.array(tokens.rounds, np.int32)
        self.accepted = np.array(tokens.accepted, np.int32)
        for slot in [s for s in running if tokens.done[s]]:
            del self.holders[slot]
        return news

    def warm_up(self) -> None:
        """Runs every shape a call may take (`shapes`) once on free rows, so that none compiles
        while requests wait: prefill pieces of nothing (length 0: nothing is written), steps over
        frozen rows."""
        for rows, piece in self.shapes()["prefill"]:
            self.state, _ = self.prefill_call([self.batch] * rows, piece).run()
        self.engine.read(self.state, np.zeros((self.batch,), np.int32), 1)
        for rows in self.shapes()["step"]:
            self.state = self.step_call(rows).run()
        self.engine.read(self.state, self.start, self.rounds_per_step * (self.engine.k + 1))
        self.state = self.engine.release(self.state, np.zeros((self.batch,), bool))
        self.admit([([0], SamplingParams(1), row_key(0, 0))], [None])  # a request's own small programs too
        while self.filling:
            self.prefill()


def _entries(prompt_lp, row: int, count: int, top: int) -> list:
    """A prefill call's prompt log-probabilities of one row's piece as (log-probability, [(id,
    log-probability)] of its `top` most likely) per position."""
    token, top_ids, values = (np.asarray(x)[row, :count] for x in prompt_lp)
    return [
        (float(token[j]), [(int(t), float(v)) for t, v in zip(top_ids[j, :top], values[j, :top])]) for j in range(count)
    ]
