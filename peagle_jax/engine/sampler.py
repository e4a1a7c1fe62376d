"""Per-row sampling on the device: the distribution each row samples from at each verified slot,
the acceptance of the drafts, the first token of a prompt, and the log-probabilities a row asked for.

Every setting is a traced row of `sampling.Sampling`, so one compiled round serves greedy and
sampled rows, any temperature, filter, penalty, bias or stop set. The processing is vLLM's, in
its order: logit_bias and min_tokens (stop ids masked), penalties (repetition, then frequency and
presence), then for sampled rows temperature, min_p, top_k and top_p. A round's slot j is
preceded by the drafts d1..dj: the penalties at slot j count them as generated, so the
distribution verified at each slot is exactly the one plain decoding would sample from there
(speculative sampling stays lossless under penalties). Log-probabilities are the target's raw
ones (its log-softmax, before any processing: vLLM's default).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from peagle_jax.engine.sampling import Sampling

NEG_INF = -jnp.inf


def _safe_ids(ids: jax.Array, vocab: int) -> jax.Array:
    """Padding ids (-1) pointed past the vocabulary, so that scatters in "drop" mode skip them."""
    return jnp.where(ids < 0, vocab, ids)


# ---------------------------------------------------------------- the processed logits


def processed_logits(logits, s: Sampling, generated, drafts, counts=None, seen=None) -> jax.Array:
    """logits [B, J, V] at J consecutive slots -> the logits each row samples from (before temperature).

    generated [B]: tokens each row emitted before slot 0; drafts [B, J-1]: the tokens between
    the slots (slot j follows drafts[:, :j]); counts [B, V] the generated tokens' counts and seen
    [B, V] the prompt's tokens (None: the state keeps no counts, so no penalties)."""
    logits = logits.astype(jnp.float32)
    b, j, v = logits.shape
    rows = jnp.arange(b)[:, None]
    if s.bias_ids.shape[1]:

        def add_bias(x):
            bias = jnp.zeros((b, v), jnp.float32).at[rows, _safe_ids(s.bias_ids, v)].add(s.bias, mode="drop")
            return x + bias[:, None, :]

        logits = jax.lax.cond(jnp.any(s.bias_ids >= 0), add_bias, lambda x: x, logits)
    early = (generated[:, None] + jnp.arange(j)[None, :]) < s.min_tokens[:, None]  # [B, J]

    def mask_stops(x):
        stops = jnp.zeros((b, v), bool).at[rows, _safe_ids(s.stop_ids, v)].set(True, mode="drop")
        return jnp.where(early[:, :, None] & stops[:, None, :], NEG_INF, x)

    logits = jax.lax.cond(jnp.any(early), mask_stops, lambda x: x, logits)
    if counts is None:
        return logits
    penalized = (s.repetition != 1.0) | (s.frequency != 0.0) | (s.presence != 0.0)
    return jax.lax.cond(jnp.any(penalized), lambda x: penalize(x, s, drafts, counts, seen), lambda x: x, logits)


def _penalty(s: Sampling, x, count, present):
    """vLLM's penalties on logits `x` [B, J, *] of tokens generated `count` times, `present` in
    the prompt or the output: repetition (> 0 divided, else multiplied), frequency, presence."""
    rep, freq, pres = (a[:, None, None] for a in (s.repetition, s.frequency, s.presence))
    x = jnp.where(present, jnp.where(x > 0, x / rep, x * rep), x)
    return x - freq * count - pres * (count > 0)


def penalize(logits, s: Sampling, drafts, counts, seen) -> jax.Array:
    """The penalties at every slot: the state's counts everywhere, then the draft tokens'
    logits recomputed with the drafts before each slot counted (the only entries they change)."""
    out = _penalty(s, logits, counts[:, None, :], (seen | (counts > 0))[:, None, :])
    j = logits.shape[1]
    if j == 1:
        return out
    before = (jnp.arange(j)[:, None] > jnp.arange(j - 1)[None, :]).astype(jnp.int32)  # [J, M]: draft m precedes slot j
    same = (drafts[:, :, None] == drafts[:, None, :]).astype(jnp.int32)  # [B, M, I]
    extra = jnp.einsum("jm,bmi->bji", before, same)  # [B, J, I]: copies of draft i before slot j
    idx = jnp.broadcast_to(drafts[:, None, :], extra.shape)
    count = jnp.take_along_axis(counts, drafts, axis=1)[:, None, :] + extra
    present = jnp.take_along_axis(seen, drafts, axis=1)[:, None, :] | (count > 0)
    fixed = _penalty(s, jnp.take_along_axis(logits, idx, axis=2), count, present)
    b = logits.shape[0]
    return out.at[jnp.arange(b)[:, None, None], jnp.arange(j)[None, :, None], idx].set(fixed)


def count_tokens(counts, tokens, valid) -> jax.Array:
    """counts [B, V] with `tokens` [B, E] added where `valid`."""
    b, v = counts.shape
    return counts.at[jnp.arange(b)[:, None], jnp.where(valid, tokens, v)].add(1, mode="drop")


def prompt_tokens_seen(prompt, prompt_len, vocab: int) -> jax.Array:
    """[B, V] bool: the tokens of each row's prompt (prompt [B, P] right-padded to prompt_len)."""
    b, p = prompt.shape
    valid = jnp.arange(p)[None, :] < prompt_len[:, None]
    return (
        jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], jnp.where(valid, prompt, vocab)].set(True, mode="drop")
    )


# ---------------------------------------------------------------- the sampling distribution


def _order_keys(x: jax.Array) -> jax.Array:
    """int32 keys ordered as the float32 values of `x` are (-0.0 counted as 0.0): the thresholds
    below are found by bisection over these keys, exact in 32 halvings, with no sort of the
    vocabulary (a sort's temporaries and time are the largest part of a sampled step)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _bisect(holds, lo: jax.Array, hi: jax.Array, *, largest: bool) -> jax.Array:
    """The largest (or smallest) int32 t in [lo, hi] per row where `holds(t)` is true, for a
    `holds` true up to (or from) some point and true at lo (or hi); lo, hi: [..., 1]."""

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        if largest:
            mid = mid + ((lo ^ hi) & 1)  # the ceiling, so that lo = mid moves
            ok = holds(mid)
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
        ok = holds(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def kth_largest_key(keys: jax.Array, k: jax.Array) -> jax.Array:
    """The k-th largest key of each row of keys [..., V] (k [..., 1], 1 <= k <= V)."""

    def at_least_k(t):
        return jnp.sum(keys >= t, axis=-1, keepdims=True) >= k

    lo, hi = jnp.min(keys, axis=-1, keepdims=True), jnp.max(keys, axis=-1, keepdims=True)
    return _bisect(at_least_k, lo, hi, largest=True)


def nucleus_cutoff_key(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """The smallest probability kept by top-p, as a key: the least p whose strictly larger mass
    is below top_p (the top token always stays; ties at the cut-off are all kept)."""
    keys = _order_keys(probs)

    def mass_above_below_p(t):
        return jnp.sum(jnp.where(keys > t, probs, 0.0), axis=-1, keepdims=True) < top_p

    lo, hi = jnp.zeros_like(keys[..., :1]), jnp.max(keys, axis=-1, keepdims=True)
    return _bisect(mass_above_below_p, lo, hi, largest=False)


def warp_probs(logits: jax.Array, temperature, top_p) -> jax.Array:
    """Target sampling distribution: temperature, then nucleus (top-p) filtering.
    temperature and top_p: numbers, or arrays broadcasting against logits' [..., 1]."""
    probs = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    if isinstance(top_p, (int, float)) and top_p >= 1.0:
        return probs
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), probs.shape[:-1] + (1,))
    keep = (_order_keys(probs) >= nucleus_cutoff_key(probs, top_p)) | (top_p >= 1.0)
    filtered = jnp.where(keep, probs, 0.0)
    return filtered / jnp.sum(filtered, axis=-1, keepdims=True)


def _min_p_top_k(scaled, s: Sampling) -> jax.Array:
    """min_p (a token below min_p x the top token's probability) and top_k (below the k-th
    largest logit; ties kept) masked out of temperature-scaled logits [B, J, V]."""
    shape = (-1, 1, 1)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    scaled = jnp.where(scaled < top + jnp.log(s.min_p).reshape(shape), NEG_INF, scaled)
    k = jnp.broadcast_to(jnp.clip(s.top_k, 1, scaled.shape[-1]).reshape(shape), scaled.shape[:-1] + (1,))
    keys = _order_keys(scaled)
    return jnp.where((s.top_k > 0).reshape(shape) & (keys < kth_largest_key(keys, k)), NEG_INF, scaled)


def row_probs(logits, s: Sampling) -> jax.Array:
    """Each row's sampling distribution over processed logits [B, J, V]: temperature, min_p,
    top_k, top_p; greedy rows get temperature 1 (their draws are not used)."""
    shape = (-1, 1, 1)
    scaled = logits / jnp.where(s.temperature > 0, s.temperature, 1.0).reshape(shape)
    scaled = jax.lax.cond(jnp.any((s.min_p > 0) | (s.top_k > 0)), lambda x: _min_p_top_k(x, s), lambda x: x, scaled)
    return jax.lax.cond(
        jnp.any(s.top_p < 1.0),
        lambda x: warp_probs(x, 1.0, s.top_p.reshape(shape)),
        lambda x: jax.nn.softmax(x, axis=-1),
        scaled,
    )


# ---------------------------------------------------------------- acceptance and the first token


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


def accept_rows(logits, drafts, s: Sampling) -> tuple[jax.Array, jax.Array, Sampling]:
    """Acceptance over processed logits [B, K+1, V]: greedy rows (temperature 0) by
    `accept_greedy`, the others by `accept_rejection` with each row's own key (that path runs
    only when some row samples). Returns (n [B], bonus [B], the rows' next sampling state)."""
    n_greedy, bonus_greedy = accept_greedy(logits, drafts)
    keys, draw = _split_rows(s.key)

    def sampled(_):
        probs = row_probs(logits, s)
        row = jax.vmap(lambda p, d, k: accept_rejection(p[None], d[None], None, k))
        n, bonus = row(probs, drafts, draw)
        return n[:, 0], bonus[:, 0]

    n, bonus = jax.lax.cond(jnp.any(s.temperature > 0), sampled, lambda _: (n_greedy, bonus_greedy), None)
    greedy = s.temperature == 0
    return jnp.where(greedy, n_greedy, n), jnp.where(greedy, bonus_greedy, bonus), s._replace(key=keys)


def pick_rows(logits, s: Sampling) -> tuple[jax.Array, Sampling]:
    """One token per row of processed logits [B, V], and the rows' next sampling state."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys, draw = _split_rows(s.key)

    def sampled(_):
        probs = row_probs(logits[:, None], s)[:, 0]
        return jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(draw, probs).astype(jnp.int32)

    ids = jax.lax.cond(jnp.any(s.temperature > 0), sampled, lambda _: greedy_ids, None)
    return jnp.where(s.temperature == 0, greedy_ids, ids), s._replace(key=keys)


# ---------------------------------------------------------------- log-probabilities


class Logprobs(NamedTuple):
    """What a row's emitted tokens had under the target: each token's log-probability, and the
    `width` most likely (id, log-probability) there, most likely first. Rows of `out`'s length."""

    token: jax.Array  # [B, L] f32
    top_ids: jax.Array  # [B, L, width] i32
    top: jax.Array  # [B, L, width] f32


def empty_logprobs(batch: int, length: int, width: int) -> Logprobs:
    return Logprobs(
        jnp.zeros((batch, length), jnp.float32),
        jnp.zeros((batch, length, width), jnp.int32),
        jnp.zeros((batch, length, width), jnp.float32),
    )


def record_logprobs(record: Logprobs, raw_logits, emitted, write_at, s: Sampling) -> Logprobs:
    """`record` with the log-probabilities of `emitted` [B, E] under raw_logits [B, E, V] written
    at out positions `write_at` [B, E] (past the end: not written); only when a row asked."""

    def write(r: Logprobs) -> Logprobs:
        lsm = jax.nn.log_softmax(raw_logits.astype(jnp.float32), axis=-1)
        token = jnp.take_along_axis(lsm, emitted[..., None], axis=-1)[..., 0]
        top, top_ids = jax.lax.top_k(lsm, r.top.shape[-1])
        rows = jnp.arange(emitted.shape[0])[:, None]
        return Logprobs(
            r.token.at[rows, write_at].set(token, mode="drop"),
            r.top_ids.at[rows, write_at].set(top_ids.astype(jnp.int32), mode="drop"),
            r.top.at[rows, write_at].set(top, mode="drop"),
        )

    return jax.lax.cond(jnp.any(s.logprobs >= 0), write, lambda r: r, record)


LOGPROB_PIECE = 64  # positions whose [positions, V] log-softmax is live at once


def prompt_logprobs(lm_logits, hidden, following, width: int, asked):
    """(token [R, T], top_ids [R, T, width], top [R, T, width]): the log-probability of
    `following[:, j]` under the target at each position j of hidden [R, T, H] (its final-norm
    output; `lm_logits` maps it to logits), with the `width` most likely there, computed
    LOGPROB_PIECE positions at a time, and only when some row is `asked` [R] (else zeros)."""
    r, t, h = hidden.shape
    piece = LOGPROB_PIECE if t % LOGPROB_PIECE == 0 else t

    def compute(_):
        def one(args):
            x, nxt = args
            lsm = jax.nn.log_softmax(lm_logits(x).astype(jnp.float32), axis=-1)
            top, top_ids = jax.lax.top_k(lsm, width)
            return jnp.take_along_axis(lsm, nxt[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top

        pieces = (hidden.reshape(-1, piece, h), following.reshape(-1, piece))
        return jax.tree.map(lambda x: x.reshape((r, t) + x.shape[2:]), jax.lax.map(one, pieces))

    def nothing(_):
        return (
            jnp.zeros((r, t), jnp.float32),
            jnp.zeros((r, t, width), jnp.int32),
            jnp.zeros((r, t, width), jnp.float32),
        )

    return jax.lax.cond(jnp.any(asked), compute, nothing, None)
