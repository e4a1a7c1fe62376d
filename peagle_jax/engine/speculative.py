"""The speculative-decoding engine: prefill, one jitted round, and the generation loop.

One round = the target verifies [last token, d1..dK] in one pass, acceptance picks how many
drafts survive plus a bonus token, then the drafter proposes the next K drafts:
  - "parallel" (P-EAGLE): ONE drafter pass over vLLM's slot layout (accepted tokens
    shifted by one with their target aux states, the bonus slot, K-1 mask slots);
  - "chain" (EAGLE-3): a pass over the accepted slots, then K-1 single-token passes that
    feed the drafter's own pre-norm state back;
  - "dflash": the accepted tokens' context K/V are written to the drafter cache, then ONE
    pass over the block [bonus, MASK x (B-1)] reads them (`DFlashModel.draft_block`);
  - "none": K = 0, plain autoregressive decoding on the same engine (the baseline).
Everything is static-shaped: rows that finished keep running with position -1 (no cache
writes) and their outputs are ignored. Caches are position-indexed, so rejected slots of a
round are simply overwritten by the next one. Every row carries its own sampling settings, key
and stop ids (`sampling.Sampling`, traced data: `sampler` decides what each row accepts), so
one compiled round serves every request; only what changes shapes is static (`EngineConfig`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kernels
from peagle_jax.engine import cache as kv
from peagle_jax.engine.sampler import (
    Logprobs,
    accept_rows,
    count_tokens,
    empty_logprobs,
    pick_rows,
    processed_logits,
    prompt_logprobs,
    prompt_tokens_seen,
    record_logprobs,
)
from peagle_jax.engine.sampling import Sampling
from peagle_jax.models.eagle import draft_to_target
from peagle_jax.runtime.sharding import ROLES, kernels_partitioned

MODES = ("parallel", "chain", "dflash", "none")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static settings of one compiled engine (hashable: a jit static argument): only what changes
    the programs' shapes. Sampling settings and stop ids are per-row data (`sampling.Sampling`)."""

    k: int
    mode: str
    aux_layer_ids: tuple[int, ...]
    mesh: jax.sharding.Mesh | None = None  # the target's mesh: the Pallas kernels run per shard of it
    logprobs: int | None = None  # None: no log-probabilities kept; n: each token's and its top n
    penalties: bool = False  # the state counts each row's tokens (presence / frequency / repetition)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "none" and self.k != 0:
            object.__setattr__(self, "k", 0)
        if self.mode != "none" and self.k < 1:
            raise ValueError(f"k must be >= 1 for mode {self.mode!r}, got {self.k}")


class DecodeState(NamedTuple):
    """Every field is indexed by row first: rows move between states whole (`Slots`)."""

    target_cache: tuple
    drafter_cache: tuple | None
    length: jax.Array  # [B] tokens committed to the target cache (positions 0..length-1)
    last: jax.Array  # [B] newest token, at position `length`, not yet seen by the target
    drafts: jax.Array  # [B, K] target ids proposed for positions length+1 .. length+K
    done: jax.Array  # [B] bool
    out: jax.Array  # [B, L] generated tokens (L = the cache length: room for a final overshoot)
    out_len: jax.Array  # [B]
    budget: jax.Array  # [B] max new tokens of each row (traced: no recompile per value)
    rounds: jax.Array  # [B] verification rounds each row took part in
    accepted: jax.Array  # [B, K + 1] how many of the row's rounds accepted n drafts
    sampling: Sampling  # [B] each row's settings, stop ids and key
    counts: jax.Array | None = None  # [B, V] times each token was generated (cfg.penalties)
    seen: jax.Array | None = None  # [B, V] the prompt's tokens (cfg.penalties)
    logprobs: Logprobs | None = None  # [B, L] per emitted token (cfg.logprobs)


# ---------------------------------------------------------------- drafting


def _draft_ids(drafter, logits: jax.Array) -> jax.Array:
    """Greedy draft ids mapped from the draft vocabulary to target ids."""
    return draft_to_target(drafter.d2t, jnp.argmax(logits, axis=-1))


def draft_parallel(drafter, tokens, aux, positions, bonus_slot, k: int, cache):
    """P-EAGLE: one pass over the real slots plus K-1 mask slots.

    tokens/positions [B, R] and aux [B, R, 3Ht] are the real slots (position -1 = unused);
    bonus_slot [B] indexes the bonus slot among them. Returns (drafts [B, K], cache).
    """
    b = tokens.shape[0]
    first_mask_pos = jnp.take_along_axis(positions, bonus_slot[:, None], axis=1) + 1  # [B, 1]
    mask_pos = jnp.where(first_mask_pos > 0, first_mask_pos + jnp.arange(k - 1), -1)
    mask_id = drafter.config.mask_token_id
    g = jnp.concatenate(
        [
            drafter.fuse(aux),
            jnp.broadcast_to(drafter.mask_g(), (b, k - 1, drafter.config.hidden_size)).astype(aux.dtype),
        ],
        axis=1,
    )
    slot_tokens = jnp.concatenate([tokens, jnp.full((b, k - 1), mask_id, tokens.dtype)], axis=1)
    slot_pos = jnp.concatenate([positions, mask_pos], axis=1)
    out = drafter(slot_tokens, g, slot_pos, cache)
    r = tokens.shape[1]
    pick = jnp.concatenate([bonus_slot[:, None], r + jnp.arange(k - 1)[None, :].repeat(b, 0)], axis=1)
    # logits of the K draft slots only (out.logits is then dead code: XLA drops the [R, Vd] product)
    logits = drafter.head(jnp.take_along_axis(out.prenorm, pick[..., None], axis=1))
    return _draft_ids(drafter, logits), out.cache


def draft_chain(drafter, tokens, aux, positions, bonus_slot, k: int, cache):
    """EAGLE-3: a pass over the real slots, then K-1 passes feeding the pre-norm state back."""
    out = drafter(tokens, drafter.fuse(aux), positions, cache)
    prenorm = jnp.take_along_axis(out.prenorm, bonus_slot[:, None, None], axis=1)
    token = _draft_ids(drafter, drafter.head(prenorm))[:, 0]
    hidden = drafter.feedback(prenorm)
    pos = jnp.take_along_axis(positions, bonus_slot[:, None], axis=1)

    def step(carry, _):
        token, hidden, pos, cache = carry
        pos = jnp.where(pos >= 0, pos + 1, -1)
        o = drafter(token[:, None], hidden, pos, cache)
        nxt = _draft_ids(drafter, o.logits)[:, 0]
        return (nxt, drafter.feedback(o.prenorm), pos, o.cache), nxt

    (_, _, _, cache), rest = jax.lax.scan(step, (token, hidden, pos, out.cache), None, length=k - 1)
    return jnp.concatenate([token[:, None], rest.T], axis=1), cache


def draft_dflash(drafter, tokens, aux, positions, bonus_slot, k: int, cache):
    """DFlash: the real slots' context K/V (each slot's aux state, at its position) go into the
    cache, then one pass over the block anchored one past the bonus slot's position.

    The block always runs at its full size B even when K < B - 1: its attention is
    bidirectional, so the trailing mask rows change slots 1..K (a block of K + 1 rows is not
    what the head was trained on), and B - 1 - K extra rows cost next to nothing beside the
    layer weights and context keys every pass reads. Only slots 1..K reach the lm_head.
    """
    size = drafter.config.block_size
    if not 1 <= k <= size - 1:
        raise ValueError(f"k={k}: a DFlash head of block_size {size} drafts 1 to {size - 1} tokens a pass")
    cache = drafter.write_context(cache, aux, positions)
    bonus = jnp.take_along_axis(tokens, bonus_slot[:, None], axis=1)[:, 0]
    last = jnp.take_along_axis(positions, bonus_slot[:, None], axis=1)[:, 0]
    out = drafter.draft_block(bonus, jnp.where(last >= 0, last + 1, -1), cache)
    return _draft_ids(drafter, drafter.head(out.prenorm[:, 1 : k + 1])), cache


def draft(cfg: EngineConfig, drafter, tokens, aux, positions, bonus_slot, cache):
    """The drafting step of `cfg.mode`: (drafts [B, K] target ids, drafter cache).

    tokens / aux / positions: the slots the target has just run (position -1: none), each
    token being the one that follows its slot's position, and `bonus_slot` the newest one."""
    fn = {"parallel": draft_parallel, "chain": draft_chain, "dflash": draft_dflash}[cfg.mode]
    return fn(drafter, tokens, aux, positions, bonus_slot, cfg.k, cache)


# ---------------------------------------------------------------- prefill and rounds


def empty_state(cfg: EngineConfig, target_spec, drafter_spec, vocab: int, sampling) -> DecodeState:
    """Free rows (done, nothing written) of the caches' specs, with the records `cfg` keeps."""
    b, length = target_spec[0][1][:2]
    zeros = jnp.zeros((b,), jnp.int32)
    return DecodeState(
        target_cache=kv.allocate(target_spec),
        drafter_cache=kv.allocate(drafter_spec),
        length=zeros,
        last=zeros,
        drafts=jnp.zeros((b, cfg.k), jnp.int32),
        done=jnp.ones((b,), bool),
        out=jnp.zeros((b, length), jnp.int32),
        out_len=zeros,
        budget=zeros,
        rounds=zeros,
        accepted=jnp.zeros((b, cfg.k + 1), jnp.int32),
        sampling=sampling,
        counts=jnp.zeros((b, vocab), jnp.int32) if cfg.penalties else None,
        seen=jnp.zeros((b, vocab), bool) if cfg.penalties else None,
        logprobs=None if cfg.logprobs is None else empty_logprobs(b, length, cfg.logprobs),
    )


class Chunk(NamedTuple):
    """One piece of each row's prompt (`extend`): tokens [R, T] right-padded, at positions
    start + j for j < length; `after` [R] the prompt token that follows the piece (rows whose
    prompt goes on); `final` [R] the piece ends the row's prompt; budget [R] its new tokens."""

    tokens: jax.Array
    start: jax.Array
    length: jax.Array
    after: jax.Array
    final: jax.Array
    budget: jax.Array


def _rows_where(rows, new, old):
    """`new` where the row mask `rows` [R] is set, else `old` (pytrees of row-first arrays)."""
    return jax.tree.map(lambda a, b: jnp.where(rows.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, old)


def extend(cfg: EngineConfig, target, drafter, state: DecodeState, chunk: Chunk, sampling):
    """A piece of each row's prompt into the rows' caches (a prompt is prefilled in one piece or
    in several: chunked prefill). A row whose piece ends its prompt gets its first token, drafts
    and sampling settings and is ready to decode; the others keep their decode fields (a row being
    prefilled stays done, so rounds leave it alone). Returns (state, the prompt's log-probabilities
    at the piece's positions when a row asks: `sampler.prompt_logprobs`)."""
    r, t = chunk.tokens.shape
    idx = jnp.arange(t)[None, :]
    positions = jnp.where(idx < chunk.length[:, None], chunk.start[:, None] + idx, -1)
    last_slot = jnp.maximum(chunk.length - 1, 0)
    out = target(
        chunk.tokens, positions, state.target_cache, aux_layer_ids=cfg.aux_layer_ids, logits_at=last_slot[:, None]
    )
    vocab = out.logits.shape[-1]
    ends = chunk.final & (chunk.length > 0)
    seen, counts = state.seen, None
    if seen is not None:
        fresh = ((chunk.start == 0) & (chunk.length > 0))[:, None]  # a new prompt: the slot's last one is gone
        seen = jnp.where(fresh, False, seen) | prompt_tokens_seen(chunk.tokens, chunk.length, vocab)
        counts = jnp.zeros_like(state.counts)
    nothing = jnp.zeros((r, 0), jnp.int32)
    logits = processed_logits(out.logits, sampling, jnp.zeros((r,), jnp.int32), nothing, counts, seen)
    first, picked = pick_rows(logits[:, 0], sampling)
    drafts, drafter_cache = state.drafts, state.drafter_cache
    if cfg.mode != "none":
        # slot j holds token x[j+1] with aux of position j; the last real slot holds the token after it
        shifted = jnp.concatenate([chunk.tokens[:, 1:], jnp.zeros((r, 1), chunk.tokens.dtype)], axis=1)
        following = jnp.where(ends, first, chunk.after)
        shifted = jnp.where(idx == last_slot[:, None], following[:, None], shifted)
        drafts, drafter_cache = draft(cfg, drafter, shifted, out.aux_hidden, positions, last_slot, drafter_cache)
    ones = jnp.ones((r, 1), bool)
    started = state._replace(
        length=chunk.start + chunk.length,
        last=first,
        drafts=drafts,
        done=jnp.zeros((r,), bool),
        out=jnp.zeros_like(state.out).at[:, 0].set(first),
        out_len=jnp.ones((r,), jnp.int32),
        budget=chunk.budget.astype(jnp.int32),
        rounds=jnp.zeros_like(state.rounds),
        accepted=jnp.zeros_like(state.accepted),
        sampling=picked,
        counts=None if counts is None else count_tokens(counts, first[:, None], ones),
        logprobs=None
        if state.logprobs is None
        else record_logprobs(
            empty_logprobs(r, state.out.shape[1], cfg.logprobs),
            out.logits,
            first[:, None],
            jnp.zeros((r, 1), jnp.int32),
            sampling,
        ),
    )
    decode = ("length", "last", "drafts", "done", "out", "out_len", "budget", "rounds", "accepted", "sampling")
    decode += ("counts", "logprobs")
    picked_fields = {f: getattr(state, f) for f in decode}
    fields = _rows_where(ends, {f: getattr(started, f) for f in decode}, picked_fields)
    new = state._replace(target_cache=out.cache, drafter_cache=drafter_cache, seen=seen, **fields)
    prompt_lp = None
    if cfg.logprobs is not None:
        following = jnp.concatenate([chunk.tokens[:, 1:], chunk.after[:, None]], axis=1)
        following = jnp.where(idx == last_slot[:, None], chunk.after[:, None], following)
        asked = (sampling.prompt_logprobs >= 0) & (chunk.length > 0)
        prompt_lp = prompt_logprobs(target.lm_logits, out.hidden, following, cfg.logprobs, asked)
    return _finish(new, first[:, None], ends[:, None]), prompt_lp


def prefill(cfg: EngineConfig, target, drafter, prompt, prompt_len, budget, target_cache, drafter_cache, sampling):
    """Target prefill, its next token, and the first drafts: `extend` over fresh rows with every
    prompt in one piece. prompt [B, P] right-padded; prompt_len [B], 0 for a batch-padding row
    (done at once); budget [B] new tokens allowed per row. Returns a DecodeState whose `out`
    holds the first token."""
    b = prompt.shape[0]
    length = target_cache[0][0].shape[1]
    vocab = target.config.vocab_size
    state = DecodeState(
        target_cache=target_cache,
        drafter_cache=drafter_cache,
        length=jnp.zeros((b,), jnp.int32),
        last=jnp.zeros((b,), jnp.int32),
        drafts=jnp.zeros((b, cfg.k), jnp.int32),
        done=jnp.ones((b,), bool),
        out=jnp.zeros((b, length), jnp.int32),
        out_len=jnp.zeros((b,), jnp.int32),
        budget=jnp.zeros((b,), jnp.int32),
        rounds=jnp.zeros((b,), jnp.int32),
        accepted=jnp.zeros((b, cfg.k + 1), jnp.int32),
        sampling=sampling,
        counts=jnp.zeros((b, vocab), jnp.int32) if cfg.penalties else None,
        seen=jnp.zeros((b, vocab), bool) if cfg.penalties else None,
        logprobs=None if cfg.logprobs is None else empty_logprobs(b, length, cfg.logprobs),
    )
    zeros = jnp.zeros((b,), jnp.int32)
    chunk = Chunk(prompt, zeros, prompt_len, zeros, prompt_len > 0, budget)
    return extend(cfg, target, drafter, state, chunk, sampling)[0]


def _finish(state: DecodeState, emitted, valid) -> DecodeState:
    """Marks rows done on one of their stop ids among this step's emitted tokens or at the token
    budget. `emitted` [B, E] were already written at out_len - sum(valid) ..; `valid` [B, E] says
    which of them count. Tokens after the first stop id are cut."""
    stops = state.sampling.stop_ids  # [B, S], -1 padded (never a token)
    hit = valid & jnp.any(emitted[..., None] == stops[:, None, :], axis=-1)
    has_stop = jnp.any(hit, axis=-1)
    first_stop = jnp.argmax(hit, axis=-1)
    emitted_count = jnp.sum(valid, axis=-1)
    out_len = jnp.where(has_stop, state.out_len - emitted_count + first_stop + 1, state.out_len)
    done = state.done | has_stop | (out_len >= state.budget)
    return state._replace(done=done, out_len=jnp.minimum(out_len, state.budget))


def decode_round(cfg: EngineConfig, target, drafter, state: DecodeState) -> DecodeState:
    """One verification round (+ drafting) for every row; finished rows are frozen."""
    b, k = state.drafts.shape[0], cfg.k
    active = ~state.done
    slots = jnp.arange(k + 1)[None, :]
    positions = jnp.where(active[:, None], state.length[:, None] + slots, -1)
    tokens = jnp.concatenate([state.last[:, None], state.drafts], axis=1)
    out = target(tokens, positions, state.target_cache, aux_layer_ids=cfg.aux_layer_ids)
    s = state.sampling
    logits = processed_logits(out.logits, s, state.out_len, state.drafts, state.counts, state.seen)
    n, bonus, sampling = accept_rows(logits, state.drafts, s)
    # emitted tokens this round: d1..dn then the bonus (slot j <= n)
    padded = jnp.concatenate([state.drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(slots == n[:, None], bonus[:, None], padded)
    valid = active[:, None] & (slots <= n[:, None])
    write_at = jnp.where(valid, state.out_len[:, None] + slots, state.out.shape[1])
    new_out = state.out.at[jnp.arange(b)[:, None], write_at].set(emitted, mode="drop")

    drafts, drafter_cache = state.drafts, state.drafter_cache
    if cfg.mode != "none":
        # drafter slots: emitted tokens at the positions they follow, with those positions' aux
        draft_pos = jnp.where(valid, positions, -1)
        drafts, drafter_cache = draft(cfg, drafter, emitted, out.aux_hidden, draft_pos, n, state.drafter_cache)
    new = state._replace(
        target_cache=out.cache,
        drafter_cache=drafter_cache,
        length=jnp.where(active, state.length + n + 1, state.length),
        last=jnp.where(active, bonus, state.last),
        drafts=jnp.where(active[:, None], drafts, state.drafts),
        out=new_out,
        out_len=jnp.where(active, state.out_len + n + 1, state.out_len),
        rounds=state.rounds + active.astype(jnp.int32),
        accepted=state.accepted + jax.nn.one_hot(n, k + 1, dtype=jnp.int32) * active[:, None].astype(jnp.int32),
        sampling=sampling,
        counts=None if state.counts is None else count_tokens(state.counts, emitted, valid),
        logprobs=None if state.logprobs is None else record_logprobs(state.logprobs, out.logits, emitted, write_at, s),
    )
    return _finish(new, emitted, valid)


def generate_loop(cfg: EngineConfig, target, drafter, state: DecodeState) -> DecodeState:
    """Rounds until every row is done (a device-side while loop: no host sync per round)."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: decode_round(cfg, target, drafter, s), state)


def rounds_until_a_row_ends(cfg: EngineConfig, target, drafter, state: DecodeState, max_rounds: int) -> DecodeState:
    """Up to `max_rounds` rounds in one device loop, ending after the first round in which a row
    finished (a server frees its slot at once) or when no row is left running."""
    started_done = state.done

    def going(carry):
        i, s = carry
        return (i < max_rounds) & ~jnp.any(s.done & ~started_done) & ~jnp.all(s.done)

    def one(carry):
        i, s = carry
        return i + 1, decode_round(cfg, target, drafter, s)

    return jax.lax.while_loop(going, one, (jnp.int32(0), state))[1]


# ---------------------------------------------------------------- placement on a mesh


def row_axes(mesh: jax.sharding.Mesh, rows: int):
    """The mesh axes a state of `rows` rows is split over by rows: the batch axes (data x fsdp,
    as the prompts' rows) when they divide the rows, else None (every row on every device)."""
    axes = tuple(a for a in ROLES["batch"][0] if mesh.shape[a] > 1)
    if not axes or rows % math.prod(mesh.shape[a] for a in axes) != 0:
        return None
    return axes[0] if len(axes) == 1 else axes


def state_placement(mesh: jax.sharding.Mesh, state: DecodeState) -> DecodeState:
    """Where a state's arrays live on `mesh`: every array split by rows over the batch axes
    (`row_axes`), each KV cache [rows, length, KV heads, head dim] also by KV heads over `tensor`
    where it divides them (else replicated over it)."""
    rows = row_axes(mesh, state.done.shape[0])
    tensor = mesh.shape["tensor"]

    def place(x):
        spec = [rows] + [None] * (x.ndim - 1)
        if x.ndim == 4 and tensor > 1 and x.shape[2] % tensor == 0:
            spec[2] = "tensor"
        return NamedSharding(mesh, P(*spec))

    return jax.tree.map(place, state)


def placed(mesh: jax.sharding.Mesh | None, state: DecodeState) -> DecodeState:
    """`state` (inside a jitted program) kept where `state_placement` puts it: every program that
    returns a state returns it there, so a donated state is reused in place and the next call
    finds the shardings it was compiled for (no compile on a server's loop)."""
    return state if mesh is None else jax.lax.with_sharding_constraint(state, state_placement(mesh, state))


# ---------------------------------------------------------------- jitted entry points
# Graph definitions and the EngineConfig are static: one compile per (config, shapes).


def _modules(target_def, target_state, drafter_def, drafter_state):
    target = nnx.merge(target_def, target_state)
    drafter = None if drafter_def is None else nnx.merge(drafter_def, drafter_state)
    return target, drafter


@functools.partial(jax.jit, static_argnums=(0, 1, 3, 8, 9))
def jit_prefill(
    cfg,
    target_def,
    target_state,
    drafter_def,
    drafter_state,
    prompt,
    prompt_len,
    budget,
    target_cache_shape,
    drafter_cache_shape,
    sampling,
) -> DecodeState:
    """Allocates both caches (`peagle_jax.engine.cache` specs) and runs `prefill`."""
    target, drafter = _modules(target_def, target_state, drafter_def, drafter_state)
    with kernels_partitioned(cfg.mesh):
        state = prefill(
            cfg,
            target,
            drafter,
            prompt,
            prompt_len,
            budget,
            kv.allocate(target_cache_shape),
            kv.allocate(drafter_cache_shape),
            sampling,
        )
    return placed(cfg.mesh, state)


@functools.partial(jax.jit, static_argnums=(0, 1, 3), donate_argnums=(5,))
def jit_extend(cfg, target_def, target_state, drafter_def, drafter_state, state, rows, chunk: Chunk, sampling):
    """`extend` over rows `rows` [R] of `state` in place (an index past the last row: a padding
    row, nothing written): a server's prompts prefilled in their slots, piece by piece. Returns
    (state, the pieces' prompt log-probabilities or None)."""
    target, drafter = _modules(target_def, target_state, drafter_def, drafter_state)
    last = state.done.shape[0] - 1
    part = jax.tree.map(lambda x: x[jnp.minimum(rows, last)], state)
    with kernels_partitioned(cfg.mesh):
        part, prompt_lp = extend(cfg, target, drafter, part, chunk, sampling)
    whole = jax.tree.map(lambda whole, p: whole.at[rows].set(p, mode="drop"), state, part)
    return placed(cfg.mesh, whole), prompt_lp


@functools.partial(jax.jit, static_argnums=(0, 1, 3), donate_argnums=(5,))
def jit_generate(cfg, target_def, target_state, drafter_def, drafter_state, state) -> DecodeState:
    target, drafter = _modules(target_def, target_state, drafter_def, drafter_state)
    with kernels_partitioned(cfg.mesh):
        return placed(cfg.mesh, generate_loop(cfg, target, drafter, state))


@functools.partial(jax.jit, static_argnums=(0, 1, 3), donate_argnums=(5,))
def jit_round(cfg, target_def, target_state, drafter_def, drafter_state, state) -> DecodeState:
    """One round (benchmarks time it; `generate` runs them in a device loop)."""
    target, drafter = _modules(target_def, target_state, drafter_def, drafter_state)
    with kernels_partitioned(cfg.mesh):
        return placed(cfg.mesh, decode_round(cfg, target, drafter, state))


def first_rows(state: DecodeState, rows: int) -> DecodeState:
    """The state of the first `rows` rows."""
    return jax.tree.map(lambda x: x[:rows], state)


def put_rows(state: DecodeState, part: DecodeState, at) -> DecodeState:
    """`state` with its rows at..at+len(part) replaced by `part`'s."""

    def put(whole, rows):
        return jax.lax.dynamic_update_slice_in_dim(whole, rows.astype(whole.dtype), at, axis=0)

    return jax.tree.map(put, state, part)


@functools.partial(jax.jit, static_argnums=(0, 1, 3, 6, 7), donate_argnums=(5,))
def jit_rounds(
    cfg, target_def, target_state, drafter_def, drafter_state, state, max_rounds: int, rows: int | None = None
) -> DecodeState:
    """`rounds_until_a_row_ends` (several rounds a host call: a server's step) over the first
    `rows` rows only (None: all), when the others are free: a round costs what its rows need."""
    target, drafter = _modules(target_def, target_state, drafter_def, drafter_state)
    with kernels_partitioned(cfg.mesh):
        if rows is None or rows == state.done.shape[0]:
            return placed(cfg.mesh, rounds_until_a_row_ends(cfg, target, drafter, state, max_rounds))
        part = rounds_until_a_row_ends(cfg, target, drafter, first_rows(state, rows), max_rounds)
        return placed(cfg.mesh, put_rows(state, part, 0))


def lower_round(cfg, target_def, target_state, drafter_def, drafter_state, state, platform: str):
    """One round traced and lowered for `platform` ("cuda", "tpu", "cpu") with that platform's
    kernels (`kernels.for_platform`), on any machine: the program an accelerator would run.
    A fresh function under a fresh jit, so no trace made for another platform is reused."""

    def one_round(target_state, drafter_state, state):
        target, drafter = _modules(target_def, target_state, drafter_def, drafter_state)
        with kernels_partitioned(cfg.mesh):
            return placed(cfg.mesh, decode_round(cfg, target, drafter, state))

    with kernels.for_platform(platform):
        traced = jax.jit(one_round).trace(target_state, drafter_state, state)
        return traced.lower(lowering_platforms=(platform,))
