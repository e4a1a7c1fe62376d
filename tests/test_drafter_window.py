"""Drafter layers with a sliding window: the COD-row forward (dense mask and block kernels), the
single-pass draft step over the drafter's KV cache and the EAGLE-3 chain steps, each against a
dense-mask reference of the same network whose masks are built here from the rule:

- COD rows (training): a row sees the depth-0 rows within `window` of its reference position
  (anchor + depth), and its own chain (speculators' `create_peagle_mask_mod`);
- inference over the cache: a slot sees the slots within `window` of its own position (vLLM).

A 2-layer head, layer 0 sliding and layer 1 full, several documents, ragged batches, windows
smaller than the sequence, window 1, and a window at least the length (= no window)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels.layouts import cod_layout, pad_layout
from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.target_config import ConfigError
from peagle_jax.engine import cache as kv
from peagle_jax.engine import speculative as sp
from peagle_jax.handles.drafter import Drafter
from peagle_jax.models.eagle import abstract_drafter, cod_rows_forward, flat_state
from peagle_jax.models.layers import apply_rope

V, VD, H, K = 64, 40, 32, 4
SLIDING = ("sliding_attention", "full_attention")
BASE = DrafterConfig(
    hidden_size=H,
    target_hidden_size=H,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=V,
    draft_vocab_size=VD,
    mask_token_id=V - 1,
    aux_layer_ids=(1, 2, 3),
    k_train=K,
    max_position_embeddings=256,
)
DRAFT_IDS = np.sort(np.random.default_rng(0).choice(V, VD, replace=False))


@functools.cache
def head(window: int | None, mode: str = "parallel") -> Drafter:
    """The same random weights (scaled so attention is far from uniform) for every window."""
    cfg = dataclasses.replace(
        BASE,
        layer_types=SLIDING if window else (),
        sliding_window=window,
        mode=mode,
        mask_token_id=BASE.mask_token_id if mode == "parallel" else None,
    )
    rng = np.random.default_rng(1)
    arrays = {}
    for path, var in flat_state(abstract_drafter(cfg)[1]).items():
        if path == ("d2t",):
            arrays[path] = (DRAFT_IDS - np.arange(VD)).astype(np.int32)
        elif path[-1] == "weight":  # norms
            arrays[path] = (1 + 0.3 * rng.standard_normal(var.shape)).astype(np.float32)
        elif path[-1] in ("embedding", "mask_hidden"):
            arrays[path] = rng.standard_normal(var.shape).astype(np.float32)
        else:
            arrays[path] = (2 * rng.standard_normal(var.shape) / np.sqrt(var.shape[0])).astype(np.float32)
    return Drafter.from_arrays(cfg, arrays)


# ---------------------------------------------------------------------------------------
# the reference: the same layers, attention through an explicit mask per layer
def cod_mask(anchor, depth, doc, window):
    """[B, N, N] from the rule, for COD rows."""
    aq, dq, cq = (np.asarray(x)[:, :, None] for x in (anchor, depth, doc))
    ak, dk, ck = (np.asarray(x)[:, None, :] for x in (anchor, depth, doc))
    near = True if window is None else ak > aq + dq - window
    return (cq >= 0) & (ck == cq) & (((dk == 0) & (ak <= aq) & near) | ((ak == aq) & (dk <= dq)))


def position_mask(positions, window):
    """[B, T, T] over slots by position (-1 = unused): causal, within `window` of the query."""
    pq, pk = np.asarray(positions)[:, :, None], np.asarray(positions)[:, None, :]
    near = True if window is None else pq - pk < window
    return (pq >= 0) & (pk >= 0) & (pk <= pq) & near


def masked_attention(q, k, v, mask, scale):
    rep = q.shape[2] // k.shape[2]  # GQA: query head h reads kv head h // rep
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=hi) * scale
    m = jnp.asarray(mask)[:, None]
    mx = jnp.max(jnp.where(m, s, -jnp.inf), axis=-1, keepdims=True)
    p = jnp.where(m, jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0)), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision=hi)


def reference_prenorm(model, tokens, g, positions, masks):
    """The drafter network (docs/method.md section 3) with layer i attending by masks[i]."""
    embeds = model.embed_tokens(tokens)
    x = g
    for i, layer in enumerate(model.layers):
        if i == 0:
            hn = layer.hidden_norm(x)
            residual = hn if model.config.norm_before_residual else x
            z = jnp.concatenate([layer.input_layernorm(embeds), hn], axis=-1)
        else:
            residual, z = x, layer.input_layernorm(x)
        q, k, v = layer.self_attn.heads(z)
        q, k = (apply_rope(h, positions, layer.self_attn.rope) for h in (q, k))
        att = masked_attention(q, k, v, masks[i], model.config.attn_scale)
        x = residual + layer.self_attn.o_proj(att.reshape(*att.shape[:2], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


@functools.cache
def _jit_reference(graphdef):
    def run(state, tokens, g, positions, masks):
        m = nnx.merge(graphdef, state)
        pre = reference_prenorm(m, tokens, g, positions, masks)
        return pre, m.head(pre), m.feedback(pre)

    return jax.jit(run)


def reference(d: Drafter, tokens, g, positions, masks):
    """(pre-norm states, logits, chain feedback) of head `d`'s weights through
    `reference_prenorm`, jitted. The masks say everything about attention, so every head of a
    mode shares one compiled reference (the window-free head's graph)."""
    args = (jnp.asarray(tokens), jnp.asarray(g, jnp.float32), jnp.asarray(positions))
    graphdef = head(None, d.config.mode).graphdef
    return _jit_reference(graphdef)(d.state, *args, tuple(jnp.asarray(mk) for mk in masks))


def close(got, want, tol=2e-5):
    got, want = np.asarray(got), np.asarray(want)
    err = float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1.0)
    assert err < tol, err


# ---------------------------------------------------------------------------------------
# training: COD rows
def cod_inputs(seed=0):
    rng = np.random.default_rng(seed)
    rows = [cod_layout(72, K, rng=rng, docs=3), cod_layout(60, K, r=0.8, rng=rng, docs=2)]
    n = max(len(r[0]) for r in rows) + 4
    anchor, depth, doc = (np.stack(x) for x in zip(*[pad_layout(*r, n) for r in rows]))
    tokens = rng.integers(0, V, (2, 72))
    aux = rng.standard_normal((2, 72, 3 * H)).astype(np.float32)
    return tokens, aux, anchor, depth, doc


def cod_reference(d: Drafter, tokens, aux, anchor, depth, doc):
    """The COD rows as a plain drafter call: every row's inputs gathered at its reference position."""
    m = d.model
    take, ref = np.arange(len(anchor))[:, None], np.minimum(anchor + depth, tokens.shape[1] - 1)
    tokens, aux = tokens[take, ref], aux[take, ref]
    real = depth == 0
    tok = jnp.asarray(np.where(real, tokens, d.config.mask_token_id))
    hidden = jnp.where(real[..., None], aux, m.mask_hidden[...][0])
    pos = jnp.asarray(np.where(doc >= 0, anchor + depth, -1))
    masks = [cod_mask(anchor, depth, doc, d.config.window(i)) for i in range(d.config.num_layers)]
    return reference(d, tok, m.fuse(hidden), pos, masks)[1]


@functools.cache
def _cod_fn(mask: str):
    return jax.jit(lambda gd, st, *a: cod_rows_forward(nnx.merge(gd, st), *a, mask=mask), static_argnums=(0,))


def cod_logits(d: Drafter, rows, mask: str):
    return _cod_fn(mask)(d.graphdef, d.state, *(jnp.asarray(x) for x in rows))


@pytest.mark.parametrize("window,mask", [(3, "dense"), (1, "kernels"), (1000, "dense")])
def test_cod_rows_equal_the_dense_reference(window, mask):
    d = head(window)
    rows = cod_inputs()
    valid = rows[4] >= 0
    got = np.asarray(cod_logits(d, rows, mask))[valid]
    close(got, np.asarray(cod_reference(d, *rows))[valid])
    free = np.asarray(cod_logits(head(None), rows, "dense"))[valid]
    if window >= 72:  # a window at least the sequence: the same as none
        np.testing.assert_array_equal(got, free)
    else:  # the window changes the logits (so the comparison above can fail)
        assert float(np.abs(got - free).max()) > 1e-2


# ---------------------------------------------------------------------------------------
# inference: the single-pass draft step (P-EAGLE) and the chain steps (EAGLE-3) over the cache
PROMPT, NEW = (11, 7), (3, 1)  # ragged batch: real slots per row in round 1, then in round 2
SLOTS = 24  # the reference's padded width (>= every slot sequence here: one compile per head)


@functools.cache
def _jit_draft(graphdef, fn: str):
    return jax.jit(lambda st, *a: getattr(sp, fn)(nnx.merge(graphdef, st), *a[:4], K, a[4]))


def draft_step(d: Drafter, tokens, aux, positions, bonus, cache):
    """The engine's drafting step of the head's mode, jitted: (drafts [B, K], cache)."""
    fn = "draft_parallel" if d.config.mode == "parallel" else "draft_chain"
    return _jit_draft(d.graphdef, fn)(d.state, *(jnp.asarray(x) for x in (tokens, aux, positions, bonus)), cache)


def rounds():
    """Round 1: prompts of PROMPT real slots at positions 0..; round 2: NEW real slots after
    them (both padded to one width: one compile). Also every real slot of both rounds per row
    (the reference's view)."""
    rng = np.random.default_rng(0)
    width = max(PROMPT) + max(NEW)
    tokens = rng.integers(0, V, (2, width))
    aux = rng.standard_normal((2, width, 3 * H)).astype(np.float32)
    idx = np.arange(width)[None]
    rows = np.arange(2)[:, None]

    def part(lo, n):
        j = idx[:, : max(PROMPT)]
        take = np.clip(lo[:, None] + j, 0, width - 1)
        pos = np.where(j < np.asarray(n)[:, None], take, -1)
        return tokens[rows, take], aux[rows, take], pos, np.asarray(n) - 1

    total = np.asarray(PROMPT) + np.asarray(NEW)
    both = (tokens, aux, np.where(idx < total[:, None], idx, -1))
    return part(np.zeros(2, int), PROMPT), part(np.asarray(PROMPT), NEW), both


def reference_drafts(d: Drafter, tokens, aux, positions):
    """Per row, from every real slot so far (positions 0..p): the K drafts by the rule over
    positions. Parallel: one pass over the real slots and K-1 mask slots at p+1..; chain: K
    passes, each new slot fed the previous pre-norm state. Slots padded to SLOTS (one compile).
    -> (draft ids [B, K] in the target vocabulary, their logits [B, K, Vd])."""
    m = d.model
    g_real = np.asarray(m.fuse(jnp.asarray(aux)))
    g_mask = np.asarray(m.mask_g()) if d.config.mode == "parallel" else None
    drafts, logits = [], []
    for b in range(tokens.shape[0]):
        keep = positions[b] >= 0
        n = int(keep.sum())
        tok, g = np.zeros((1, SLOTS), int), np.zeros((1, SLOTS, H), np.float32)
        tok[0, :n], g[0, :n] = tokens[b][keep], g_real[b][keep]
        if d.config.mode == "parallel":
            tok[0, n : n + K - 1], g[0, n : n + K - 1] = d.config.mask_token_id, g_mask
        rows = []
        for step in range(1 if d.config.mode == "parallel" else K):
            length = n + K - 1 if d.config.mode == "parallel" else n + step
            pos = np.where(np.arange(SLOTS) < length, np.arange(SLOTS), -1)[None]
            masks = [position_mask(pos, d.config.window(i)) for i in range(d.config.num_layers)]
            _, out, back = (np.asarray(x[0]) for x in reference(d, tok, g, pos, masks))
            if d.config.mode == "parallel":
                rows = list(out[n - 1 : n + K - 1])
            else:  # the next slot: the draft token with the fed-back state
                rows.append(out[length - 1])
                tok[0, length], g[0, length] = DRAFT_IDS[np.argmax(rows[-1])], back[length - 1]
        drafts.append(DRAFT_IDS[np.argmax(np.stack(rows), -1)])
        logits.append(np.stack(rows))
    return np.stack(drafts), np.stack(logits)


@pytest.mark.parametrize("mode,window", [("parallel", 3), ("chain", 2)])
def test_drafts_over_the_cache_equal_the_dense_reference(mode, window):
    """Two rounds: a prefill pass over ragged prompts, then new real slots on top of a cache
    that still holds the first round's mask / chain slots (stale, overwritten now)."""
    d = head(window, mode)
    first, second, both = rounds()
    cache = kv.init(d.config, 2, 32)
    drafts, cache = draft_step(d, *first, cache)
    want, logits = reference_drafts(d, *[x[:, : max(PROMPT)] for x in both[:2]], first[2])
    np.testing.assert_array_equal(np.asarray(drafts), want)
    drafts2, _ = draft_step(d, *second, cache)
    want2, logits2 = reference_drafts(d, *both)
    np.testing.assert_array_equal(np.asarray(drafts2), want2)
    if mode == "parallel":  # the window matters here: without it the draft rows' logits differ
        free = reference_drafts(head(None, mode), *both)[1]
        assert float(np.abs(free - logits2).max()) > 1e-2


@pytest.mark.parametrize("window", [1])
def test_cache_forward_logits_equal_the_reference(window):
    """The drafter over its KV cache (kernels.decode with the window), slot by slot: the
    single-pass layout's logits of every slot, second round on the first round's cache."""
    d = head(window)
    first, second, both = rounds()
    m = d.model

    def slots(tokens, aux, positions, bonus):
        mask_pos = np.where(positions[np.arange(2), bonus] >= 0, positions[np.arange(2), bonus] + 1, -1)[:, None]
        mask_pos = np.where(mask_pos >= 0, mask_pos + np.arange(K - 1), -1)
        tok = np.concatenate([tokens, np.full((2, K - 1), d.config.mask_token_id)], 1)
        g = jnp.concatenate([m.fuse(jnp.asarray(aux)), jnp.broadcast_to(m.mask_g(), (2, K - 1, H))], 1)
        return jnp.asarray(tok), g, jnp.asarray(np.concatenate([positions, mask_pos], 1))

    apply = jax.jit(lambda st, *a: nnx.merge(d.graphdef, st)(*a))
    g_all = np.asarray(m.fuse(jnp.asarray(both[1])))
    out1 = apply(d.state, *slots(*first), kv.init(d.config, 2, 32))
    out2 = apply(d.state, *slots(*second), out1.cache)
    for out, (tokens, aux, positions, bonus) in ((out1, first), (out2, second)):
        tok, g, pos = slots(tokens, aux, positions, bonus)
        for b in range(2):
            n = int(bonus[b]) + 1  # this round's real slots of row b, then its mask slots
            rows = np.r_[0:n, positions.shape[1] : positions.shape[1] + K - 1]
            lo = int(pos[b, 0])
            seq_tok = np.r_[both[0][b, :lo], np.asarray(tok[b, rows])]
            seq_g = np.concatenate([g_all[b, :lo], np.asarray(g[b, rows])])
            length = lo + len(rows)
            p = np.where(np.arange(SLOTS) < length, np.arange(SLOTS), -1)[None]
            masks = [position_mask(p, d.config.window(i)) for i in range(d.config.num_layers)]
            pad_tok = np.zeros((1, SLOTS), int)
            pad_g = np.zeros((1, SLOTS, H), np.float32)
            pad_tok[0, :length], pad_g[0, :length] = seq_tok, seq_g
            want = reference(d, pad_tok, pad_g, p, masks)[1]
            close(np.asarray(out.logits[b, rows]), np.asarray(want[0, lo:length]))


def test_single_pass_layout_equals_cod_rows_when_the_window_covers_the_chain():
    """Training and serving agree: with window >= K, the single-pass draft (positional window
    over the cache) gives the logits of the COD rows (window from the reference position) of
    the same anchors, depth 0..K-1 at the last anchor."""
    d = head(K)
    rng = np.random.default_rng(4)
    n = 12
    tokens = rng.integers(0, V, (1, n))
    aux = rng.standard_normal((1, n, 3 * H)).astype(np.float32)
    anchor = np.r_[np.arange(n), np.full(K - 1, n - 1)][None]
    depth = np.r_[np.zeros(n, int), np.arange(1, K)][None]
    rows = (tokens, aux, anchor, depth, np.zeros_like(anchor))
    cod = np.asarray(cod_logits(d, rows, "dense"))[0]
    m = d.model
    tok = np.r_[tokens[0], np.full(K - 1, d.config.mask_token_id)][None]
    g = jnp.concatenate([m.fuse(jnp.asarray(aux)), jnp.broadcast_to(m.mask_g(), (1, K - 1, H))], 1)
    out = d.apply(jnp.asarray(tok), g, jnp.arange(n + K - 1)[None], kv.init(d.config, 1, 32))
    close(np.asarray(out.logits[0]), cod)


# ---------------------------------------------------------------------------------------
def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="layer_types has 3 entries for num_hidden_layers 2"):
        dataclasses.replace(BASE, layer_types=SLIDING + SLIDING[:1], sliding_window=4)
    with pytest.raises(ConfigError, match="unknown layer_types \\['chunked_attention'\\]"):
        dataclasses.replace(BASE, layer_types=("chunked_attention",) * 2, sliding_window=4)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="sliding_window must be an int >= 1"):
            dataclasses.replace(BASE, layer_types=SLIDING, sliding_window=bad)
    with pytest.raises(ConfigError, match="sliding_window is not set"):
        dataclasses.replace(BASE, layer_types=SLIDING)
    cfg = dataclasses.replace(BASE, layer_types=SLIDING, sliding_window=4)
    assert [cfg.window(i) for i in range(2)] == [4, None]
    assert cfg.sliding
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    assert dataclasses.replace(BASE, layer_types=["full_attention"] * 2) == BASE  # () = all full; hashable
    hash(cfg)
