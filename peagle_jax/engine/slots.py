"""Decode slots for continuous batching (JetStream's prefill / insert / generate).

B rows of static KV caches (target and head) hold requests that come and go. A request is
prefilled alone into a one-row state of the slots' cache length (its prompt right-padded to a
bucket of LENGTH_MULTIPLE tokens: one compile per bucket), then inserted into a free row between
rounds. A step (`speculative.jit_rounds`) runs the rows up to the last busy one, rounded up to a
power of two (one compile each: a server with one client pays a 1-row round); finished and free
rows are frozen (position -1), so a row is released by marking it done. Each row samples with its own settings
and key (`speculative.RowSampling`): a request's tokens never depend on the other rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.engine import cache as kv
from peagle_jax.engine import speculative as sp


@dataclasses.dataclass(frozen=True)
class RoundTokens:
    """What a step left on the host: per row, the tokens it emitted and whether it is done."""

    start: np.ndarray  # [B] tokens of each row before the step
    end: np.ndarray  # [B] after it
    done: np.ndarray  # [B] bool
    tail: np.ndarray  # [B, rounds x (K + 1)] the row's tokens from `start` on
    rounds: np.ndarray  # [B] rounds each row ran in the step

    def new(self, row: int) -> list[int]:
        return self.tail[row, : self.end[row] - self.start[row]].tolist()


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty(k: int, target_spec, drafter_spec) -> sp.DecodeState:
    """B free rows (done, nothing written) of the specs' batch and cache length."""
    b, length = target_spec[0][1][:2]
    zeros = jnp.zeros((b,), jnp.int32)
    return sp.DecodeState(
        target_cache=kv.allocate(target_spec),
        drafter_cache=kv.allocate(drafter_spec),
        length=zeros,
        last=zeros,
        drafts=jnp.zeros((b, k), jnp.int32),
        done=jnp.ones((b,), bool),
        out=jnp.zeros((b, length), jnp.int32),
        out_len=zeros,
        budget=zeros,
        key=jax.random.key(0),
        rounds=zeros,
        accept_hist=jnp.zeros((k + 1,), jnp.int32),
        sampling=sp.RowSampling(
            jnp.zeros((b,), jnp.float32), jnp.ones((b,), jnp.float32), jax.random.split(jax.random.key(0), b)
        ),
    )


@functools.partial(jax.jit, donate_argnums=(0,))
def _insert(state: sp.DecodeState, row: sp.DecodeState, slot) -> sp.DecodeState:
    def put(big, small):
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis=0)

    fields = {f: jax.tree.map(put, getattr(state, f), getattr(row, f)) for f in sp.ROW_FIELDS}
    return state._replace(**fields, accept_hist=state.accept_hist + row.accept_hist)


@functools.partial(jax.jit, donate_argnums=(0,))
def _release(state: sp.DecodeState, rows) -> sp.DecodeState:
    return state._replace(done=state.done | rows)


@functools.partial(jax.jit, static_argnums=(2,))
def _tokens(state: sp.DecodeState, start, width: int):
    index = jnp.minimum(start[:, None] + jnp.arange(width), state.out.shape[1] - 1)
    return state.out_len, state.done, jnp.take_along_axis(state.out, index, axis=1), state.rounds


class Slots:
    """`batch` decode rows of `max_len` cache positions (rounded up to LENGTH_MULTIPLE) over a
    `SpeculativeDecoder`'s target, head, K and mode. Stop ids: the decoder's eos ids. A step
    (`round`) runs up to `rounds_per_step` rounds in one device loop, ending early after a
    round in which a row finished: fewer host round trips, and no row waits on a finished one."""

    def __init__(self, decoder, batch: int, max_len: int, rounds_per_step: int = 1):
        self.decoder = decoder
        self.batch = int(batch)
        self.length = kv.round_up(max_len, kv.LENGTH_MULTIPLE)
        self.cfg = decoder.engine_config()  # greedy; the rows' RowSampling overrides it
        self.modules = decoder.modules()
        self.row_specs = decoder.cache_specs(1, self.length)
        self.state = _empty(self.cfg.k, *decoder.cache_specs(self.batch, self.length))
        self.start = np.zeros((self.batch,), np.int32)
        self.rounds_before = np.zeros((self.batch,), np.int32)
        self.rounds_per_step = int(rounds_per_step)
        self.busy: set[int] = set()  # rows inserted and not yet done or released

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most new tokens a prompt of `prompt_len` tokens may ask for (< 1: it does not fit)."""
        room = self.length - kv.length_for(prompt_len, 0, self.cfg.k)
        return min(room, self.decoder.target.config.max_position_embeddings - prompt_len)

    def bucket(self, prompt_len: int) -> int:
        """The padded prompt length a prompt is prefilled at (each bucket compiles once)."""
        return min(kv.round_up(prompt_len, kv.LENGTH_MULTIPLE), self.length)

    def buckets(self) -> list[int]:
        return list(range(kv.LENGTH_MULTIPLE, self.length + 1, kv.LENGTH_MULTIPLE))

    def prefill(self, ids, max_new_tokens: int, temperature=0.0, top_p=1.0, seed=0) -> sp.DecodeState:
        """A one-row state of the slots' cache length: the prompt's prefill, first token and drafts."""
        if not 1 <= max_new_tokens <= self.max_new_tokens(len(ids)):
            raise ValueError(f"{len(ids)} prompt tokens + {max_new_tokens} new tokens do not fit {self.length} slots")
        prompt = np.zeros((1, self.bucket(len(ids))), np.int32)
        prompt[0, : len(ids)] = ids
        key = jax.random.key(seed)
        sampling = sp.RowSampling(
            jnp.full((1,), temperature, jnp.float32), jnp.full((1,), top_p, jnp.float32), key[None]
        )
        lens, budget = jnp.full((1,), len(ids), jnp.int32), jnp.full((1,), max_new_tokens, jnp.int32)
        return sp.jit_prefill(self.cfg, *self.modules, prompt, lens, budget, *self.row_specs, key, sampling)

    @staticmethod
    def first_tokens(row: sp.DecodeState) -> tuple[list[int], bool]:
        """A prefilled row's tokens (its first one, or none: a zero budget) and whether it is done
        already (that token ends it: nothing to insert)."""
        out, out_len, done = jax.device_get((row.out[0, :1], row.out_len[0], row.done[0]))
        return out[: int(out_len)].tolist(), bool(done)

    def insert(self, row: sp.DecodeState, slot: int) -> None:
        """Puts a prefilled row into `slot` (its previous request, if any, is overwritten)."""
        self.state = _insert(self.state, row, jnp.int32(slot))
        self.start[slot] = 1  # its first token went out with `first_tokens`
        self.rounds_before[slot] = 0
        self.busy.add(slot)

    def release(self, slots) -> None:
        """Marks rows done: they stop decoding from the next round on."""
        rows = np.zeros((self.batch,), bool)
        rows[list(slots)] = True
        self.state = _release(self.state, jnp.asarray(rows))
        self.busy.difference_update(slots)

    def tokens(self) -> RoundTokens:
        """Every row's tokens since the last call (an inserted row: after its first token); a step
        emits at most rounds_per_step x (K + 1) tokens a row, so call it after every step."""
        width = self.rounds_per_step * (self.cfg.k + 1)
        out_len, done, tail, rounds = jax.device_get(_tokens(self.state, jnp.asarray(self.start), width))
        ran = np.asarray(rounds) - self.rounds_before
        news = RoundTokens(self.start.copy(), np.asarray(out_len), np.asarray(done), np.asarray(tail), ran)
        self.start, self.rounds_before = news.end.astype(np.int32), np.array(rounds)
        self.busy.difference_update(np.flatnonzero(news.done).tolist())
        return news

    def row_counts(self) -> list[int]:
        """The row counts a step runs at (powers of two, and the batch): one compile each."""
        return sorted({min(1 << i, self.batch) for i in range(self.batch.bit_length() + 1)})

    def round(self, rows: int | None = None) -> None:
        """One step: `rounds_per_step` rounds at most, fewer when a row finishes first, over the
        rows up to the last busy one (rounded up to a `row_counts` entry; `rows`: that many)."""
        if rows is None:
            last = max(self.busy, default=-1) + 1
            rows = next((n for n in self.row_counts() if n >= last), self.batch)
        self.state = sp.jit_rounds(self.cfg, *self.modules, self.state, self.rounds_per_step, rows)
