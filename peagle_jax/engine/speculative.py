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
round are simply overwritten by the next one.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import kernels
from peagle_jax.engine import cache as kv
from peagle_jax.models.drafter import draft_to_target
from peagle_jax.sharding import kernels_partitioned

MODES = ("parallel", "chain", "dflash", "none")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static settings of one compiled engine (hashable: a jit static argument)."""

    k: int
    mode: str
    aux_layer_ids: tuple[int, ...]
    eos_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    mesh: jax.sharding.Mesh | None = None  # the target's mesh: the Pallas kernels run per shard of it

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "none" and self.k != 0:
            object.__setattr__(self, "k", 0)
        if self.mode != "none" and self.k < 1:
            raise ValueError(f"k must be >= 1 for mode {self.mode!r}, got {self.k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RowSampling(NamedTuple):
    """Sampling settings of each row, traced (rows of one batch may differ, no recompile per
    value), and each row's own key: a row's draws never depend on the other rows."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_p: jax.Array  # [B] f32 in (0, 1]
    key: jax.Array  # [B] typed PRNG keys


# DecodeState fields indexed by row (the others, key and accept_hist, belong to the whole batch)
ROW_FIELDS = ("target_cache", "drafter_cache", "length", "last", "drafts", "done", "out", "out_len", "budget")
ROW_FIELDS += ("rounds", "sampling")


class DecodeState(NamedTuple):
    target_cache: tuple
    drafter_cache: tuple | None
    length: jax.Array  # [B] tokens committed to the target cache (positions 0..length-1)
    last: jax.Array  # [B] newest token, at position `length`, not yet seen by the target
    drafts: jax.Array  # [B, K] target ids proposed for positions length+1 .. length+K
    done: jax.Array  # [B] bool
    out: jax.Array  # [B, L] generated tokens (L = the cache length: room for a final overshoot)
    out_len: jax.Array  # [B]
    budget: jax.Array  # [B] max new tokens of each row (traced: no recompile per value)
    key: jax.Array
    rounds: jax.Array  # [B] verification rounds each row took part in
    accept_hist: jax.Array  # [K + 1] how many active rounds accepted n drafts, summed over rows
    sampling: RowSampling | None = None  # per-row sampling (a server's slots); None: the EngineConfig's


# ---------------------------------------------------------------- sampling and acceptance


def warp_probs(logits: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Target sampling distribution: temperature, then nucleus (top-p) filtering.
    temperature and top_p: numbers, or arrays broadcasting against logits' [..., 1]."""
    probs = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    if isinstance(top_p, (int, float)) and top_p >= 1.0:
        return probs
    sorted_p = -jnp.sort(-probs, axis=-1)
    # keep a token if the mass strictly before it is below top_p (the top token always stays);
    # ties at the cut-off are all kept, identically in every mode; top_p = 1 keeps every token
    keep_sorted = ((jnp.cumsum(sorted_p, axis=-1) - sorted_p) < top_p) | (top_p >= 1.0)
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_p, jnp.inf), axis=-1, keepdims=True)
    filtered = jnp.where(probs >= cutoff, probs, 0.0)
    return filtered / jnp.sum(filtered, axis=-1, keepdims=True)


def accept_greedy(logits: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Longest prefix of drafts equal to the target's argmax, plus its bonus token.

    logits [B, K+1, V], drafts [B, K] -> (n accepted [B], bonus [B]).
    """
    choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    n = jnp.sum(jnp.cumprod(drafts == choice[:, :-1], axis=-1), axis=-1).astype(jnp.int32)
    return n, jnp.take_along_axis(choice, n[:, None], axis=1)[:, 0]


def accept_rejection(
    probs: jax.Array, drafts: jax.Array, draft_probs: jax.Array | None, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Speculative rejection sampling (lossless).

    probs [B, K+1, V] target; draft_probs [B, K, V] the drafter's q (None = greedy drafts,
    i.e. one-hot q). Accept d_i with prob min(1, p(d)/q(d)); at the first rejection sample
    from norm(max(0, p - q)); if all K survive, sample the bonus from p at slot K.
    """
    b, k1, v = probs.shape
    k = k1 - 1
    if draft_probs is None:
        draft_probs = jax.nn.one_hot(drafts, v, dtype=probs.dtype)
    p_d = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    key_u, key_s = jax.random.split(key)
    u = jax.random.uniform(key_u, (b, k))
    accepted = u * q_d < p_d  # u < min(1, p/q) without dividing by zero
    n = jnp.sum(jnp.cumprod(accepted, axis=-1), axis=-1).astype(jnp.int32)
    residual = jnp.maximum(probs[:, :k] - draft_probs, 0.0)
    residual = jnp.concatenate([residual, probs[:, k:]], axis=1)  # slot K: plain p
    pick = jnp.take_along_axis(residual, n[:, None, None], axis=1)[:, 0]
    mass = jnp.sum(pick, axis=-1, keepdims=True)
    fallback = jnp.take_along_axis(probs, n[:, None, None], axis=1)[:, 0]  # p == q exactly
    pick = jnp.where(mass > 0, pick / jnp.where(mass > 0, mass, 1.0), fallback)
    bonus = jax.random.categorical(key_s, jnp.log(pick), axis=-1).astype(jnp.int32)
    return n, bonus


def _split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's key split in two: (the row's next key [B], a key to draw with now [B])."""
    pairs = jax.vmap(jax.random.split)(keys)
    return pairs[:, 0], pairs[:, 1]


def _rows_probs(logits: jax.Array, s: RowSampling) -> jax.Array:
    """`warp_probs` per row; greedy rows get temperature 1 (their draws are not used)."""
    shape = (-1,) + (1,) * (logits.ndim - 1)
    temperature = jnp.where(s.temperature > 0, s.temperature, 1.0).reshape(shape)
    return warp_probs(logits, temperature, s.top_p.reshape(shape))


def accept_rows(logits: jax.Array, drafts: jax.Array, s: RowSampling) -> tuple[jax.Array, jax.Array, RowSampling]:
    """Acceptance with per-row sampling: greedy rows (temperature 0) by `accept_greedy`, the
    others by `accept_rejection` with each row's own key. The sampled path runs only when some
    row samples. Returns (n [B], bonus [B], the rows' next sampling state)."""
    n_greedy, bonus_greedy = accept_greedy(logits, drafts)
    keys, draw = _split_rows(s.key)

    def sampled(_):
        probs = _rows_probs(logits, s)
        row = jax.vmap(lambda p, d, k: accept_rejection(p[None], d[None], None, k))
        n, bonus = row(probs, drafts, draw)
        return n[:, 0], bonus[:, 0]

    n, bonus = jax.lax.cond(jnp.any(s.temperature > 0), sampled, lambda _: (n_greedy, bonus_greedy), None)
    greedy = s.temperature == 0
    return jnp.where(greedy, n_greedy, n), jnp.where(greedy, bonus_greedy, bonus), s._replace(key=keys)


def pick_rows(logits: jax.Array, s: RowSampling) -> tuple[jax.Array, RowSampling]:
    """One token per row of logits [B, V] under per-row sampling, and the rows' next state."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys, draw = _split_rows(s.key)

    def sampled(_):
        probs = _rows_probs(logits, s)
        return jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(draw, probs).astype(jnp.int32)

    ids = jax.lax.cond(jnp.any(s.temperature > 0), sampled, lambda _: greedy_ids, None)
    return jnp.where(s.temperature == 0, greedy_ids, ids), s._replace(key=keys)


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


def _pick_token(cfg: EngineConfig, logits: jax.Array, key: jax.Array) -> jax.Array:
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = warp_probs(logits, cfg.temperature, cfg.top_p)
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def prefill(
    cfg: EngineConfig, target, drafter, prompt, prompt_len, budget, target_cache, drafter_cache, key, sampling=None
):
    """Target prefill, its next token, and the first drafts.

    prompt [B, P] right-padded; prompt_len [B], 0 for a batch-padding row (done at once);
    budget [B] new tokens allowed per row; sampling: per-row settings (RowSampling) instead of
    the config's. Returns a DecodeState whose `out` holds the first token.
    """
    b, p = prompt.shape
    idx = jnp.arange(p)[None, :]
    positions = jnp.where(idx < prompt_len[:, None], idx, -1)
    last_slot = jnp.maximum(prompt_len - 1, 0)
    out = target(prompt, positions, target_cache, aux_layer_ids=cfg.aux_layer_ids, logits_at=last_slot[:, None])
    key, sub = jax.random.split(key)
    if sampling is None:
        first = _pick_token(cfg, out.logits[:, 0], sub)
    else:
        first, sampling = pick_rows(out.logits[:, 0], sampling)
    drafts = jnp.zeros((b, cfg.k), jnp.int32)
    if cfg.mode != "none":
        # slot j holds token x[j+1] with aux of position j; the last real slot holds `first`
        shifted = jnp.concatenate([prompt[:, 1:], jnp.zeros((b, 1), prompt.dtype)], axis=1)
        shifted = jnp.where(idx == (prompt_len - 1)[:, None], first[:, None], shifted)
        drafts, drafter_cache = draft(cfg, drafter, shifted, out.aux_hidden, positions, last_slot, drafter_cache)
    state = DecodeState(
        target_cache=out.cache,
        drafter_cache=drafter_cache,
        length=prompt_len.astype(jnp.int32),
        last=first,
        drafts=drafts,
        done=prompt_len == 0,
        out=jnp.zeros((b, target_cache[0][0].shape[1]), jnp.int32).at[:, 0].set(first),
        out_len=(prompt_len > 0).astype(jnp.int32),
        budget=budget.astype(jnp.int32),
        key=key,
        rounds=jnp.zeros((b,), jnp.int32),
        accept_hist=jnp.zeros((cfg.k + 1,), jnp.int32),
        sampling=sampling,
    )
    return _finish(cfg, state, first[:, None], (prompt_len > 0)[:, None])


def _finish(cfg: EngineConfig, state: DecodeState, emitted, valid) -> DecodeState:
    """Marks rows done on EOS among this step's emitted tokens or at the token budget.

    `emitted` [B, E] were already written at out_len - sum(valid) ..; `valid` [B, E] says
    which of them count. Tokens after the first EOS are cut.
    """
    hit_eos = valid & jnp.isin(emitted, jnp.asarray(cfg.eos_ids or (-1,), jnp.int32))
    has_eos = jnp.any(hit_eos, axis=-1)
    first_eos = jnp.argmax(hit_eos, axis=-1)
    emitted_count = jnp.sum(valid, axis=-1)
    out_len = jnp.where(has_eos, state.out_len - emitted_count + first_eos + 1, state.out_len)
    done = state.done | has_eos | (out_len >= state.budget)
    return state._replace(done=done, out_len=jnp.minimum(out_len, state.budget))


def decode_round(cfg: EngineConfig, target, drafter, state: DecodeState) -> DecodeState:
    """One verification round (+ drafting) for every row; finished rows are frozen."""
    b, k = state.drafts.shape[0], cfg.k
    active = ~state.done
    slots = jnp.arange(k + 1)[None, :]
    positions = jnp.where(active[:, None], state.length[:, None] + slots, -1)
    tokens = jnp.concatenate([state.last[:, None], state.drafts], axis=1)
    out = target(tokens, positions, state.target_cache, aux_layer_ids=cfg.aux_layer_ids)
    key, sub = jax.random.split(state.key)
    sampling = state.sampling
    if sampling is not None:
        n, bonus, sampling = accept_rows(out.logits, state.drafts, sampling)
    elif cfg.greedy:
        n, bonus = accept_greedy(out.logits, state.drafts)
    else:
        probs = warp_probs(out.logits, cfg.temperature, cfg.top_p)
        n, bonus = accept_rejection(probs, state.drafts, None, sub)
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
    hist = state.accept_hist + jnp.sum(
        jax.nn.one_hot(n, k + 1, dtype=jnp.int32) * active[:, None].astype(jnp.int32), axis=0
    )
    new = state._replace(
        target_cache=out.cache,
        drafter_cache=drafter_cache,
        length=jnp.where(active, state.length + n + 1, state.length),
        last=jnp.where(active, bonus, state.last),
        drafts=jnp.where(active[:, None], drafts, state.drafts),
        out=new_out,
        out_len=jnp.where(active, state.out_len + n + 1, state.out_len),
        key=key,
        rounds=state.rounds + active.astype(jnp.int32),
        accept_hist=hist,
        sampling=sampling,
    )
    return _finish(cfg, new, emitted, valid)


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
    key,
    sampling=None,
) -> DecodeState:
    """Allocates both caches (`peagle_jax.engine.cache` specs) and runs `prefill`."""
    target, drafter = _modules(target_def, target_state, drafter_def, drafter_state)
    with kernels_partitioned(cfg.mesh):
        return prefill(
            cfg,
            target,
            drafter,
            prompt,
            prompt_len,
            budget,
            kv.allocate(target_cache_shape),
            kv.allocate(drafter_cache_shape),
            key,
            sampling,
        )


@functools.partial(jax.jit, static_argnums=(0, 1, 3), donate_argnums=(5,))
def jit_generate(cfg, target_def, target_state, drafter_def, drafter_state, state) -> DecodeState:
    target, drafter = _modules(target_def, target_state, drafter_def, drafter_state)
    with kernels_partitioned(cfg.mesh):
        return generate_loop(cfg, target, drafter, state)


@functools.partial(jax.jit, static_argnums=(0, 1, 3), donate_argnums=(5,))
def jit_round(cfg, target_def, target_state, drafter_def, drafter_state, state) -> DecodeState:
    """One round (benchmarks time it; `generate` runs them in a device loop)."""
    target, drafter = _modules(target_def, target_state, drafter_def, drafter_state)
    with kernels_partitioned(cfg.mesh):
        return decode_round(cfg, target, drafter, state)


def first_rows(state: DecodeState, rows: int) -> DecodeState:
    """The state of the first `rows` rows (the batch-wide fields as they are)."""
    return state._replace(**{f: jax.tree.map(lambda x: x[:rows], getattr(state, f)) for f in ROW_FIELDS})


def with_first_rows(state: DecodeState, part: DecodeState) -> DecodeState:
    """`state` with its first rows replaced by `part`'s (and `part`'s batch-wide fields)."""

    def put(whole, head):
        return jax.lax.dynamic_update_slice_in_dim(whole, head.astype(whole.dtype), 0, axis=0)

    rows = {f: jax.tree.map(put, getattr(state, f), getattr(part, f)) for f in ROW_FIELDS}
    return part._replace(**rows)


@functools.partial(jax.jit, static_argnums=(0, 1, 3, 6, 7), donate_argnums=(5,))
def jit_rounds(
    cfg, target_def, target_state, drafter_def, drafter_state, state, max_rounds: int, rows: int | None = None
) -> DecodeState:
    """`rounds_until_a_row_ends` (several rounds a host call: a server's step) over the first
    `rows` rows only (None: all), when the others are free: a round costs what its rows need."""
    target, drafter = _modules(target_def, target_state, drafter_def, drafter_state)
    with kernels_partitioned(cfg.mesh):
        if rows is None or rows == state.done.shape[0]:
            return rounds_until_a_row_ends(cfg, target, drafter, state, max_rounds)
        part = rounds_until_a_row_ends(cfg, target, drafter, first_rows(state, rows), max_rounds)
        return with_first_rows(state, part)


def lower_round(cfg, target_def, target_state, drafter_def, drafter_state, state, platform: str):
    """One round traced and lowered for `platform` ("cuda", "tpu", "cpu") with that platform's
    kernels (`kernels.for_platform`), on any machine: the program an accelerator would run.
    A fresh function under a fresh jit, so no trace made for another platform is reused."""

    def one_round(target_state, drafter_state, state):
        target, drafter = _modules(target_def, target_state, drafter_def, drafter_state)
        with kernels_partitioned(cfg.mesh):
            return decode_round(cfg, target, drafter, state)

    with kernels.for_platform(platform):
        traced = jax.jit(one_round).trace(target_state, drafter_state, state)
        return traced.lower(lowering_platforms=(platform,))
