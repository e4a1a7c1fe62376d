"""The drafter head: construction from a target, save/load, export/import round trips, flags,
chain mode, reduced draft vocabularies, the KV cache and the COD row layout."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.target_config import RopeConfig
from peagle_jax.engine import cache as kv
from peagle_jax.formats import export_speculators, export_vllm
from peagle_jax.handles.drafter import Drafter, load_drafter, new_drafter
from peagle_jax.models.eagle import (
    cod_rows_forward,
    draft_to_target,
    peagle_mask,
    select_draft_vocab,
    state_from_arrays,
)


def _hf_tiny():
    import hf_tiny

    return hf_tiny


V, H, T = 64, 32, 8
BASE = DrafterConfig(
    hidden_size=H,
    target_hidden_size=H,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=V,
    draft_vocab_size=40,
    mask_token_id=V - 1,
    aux_layer_ids=(1, 2, 3),
    k_train=4,
    max_position_embeddings=64,
)
DRAFT_IDS = np.sort(np.random.default_rng(0).choice(V, 40, replace=False))
FLAGS = {
    "norm_before_residual": dict(norm_before_residual=True),
    "norm_before_fc": dict(norm_before_fc=True),
    "fc_norm": dict(fc_norm=True),
    "attention_bias": dict(attention_bias=True),
    "llama3_rope": dict(
        rope=RopeConfig(
            theta=10000.0,
            type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )
    ),
    "qk_norm": dict(qk_norm=True),
}


@functools.cache
def perturbed(config: DrafterConfig, seed: int = 0) -> Drafter:
    """A random head with every float parameter noised (norm weights != 1, biases != 0),
    so each flag matters numerically."""
    d = Drafter.random(config, seed, draft_ids=DRAFT_IDS if config.draft_vocab_size < V else None)
    rng = np.random.default_rng(seed + 1)
    arrays = {
        p: (a + 0.2 * rng.standard_normal(a.shape).astype(a.dtype)) if a.dtype.kind == "f" else a
        for p, a in d.arrays().items()
    }
    graphdef, state = state_from_arrays(config, arrays)
    return Drafter(config, graphdef, state)


def inputs(config: DrafterConfig, seed: int = 0, t: int = T):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, V, (1, t)), jnp.int32)
    aux = jnp.asarray(rng.standard_normal((1, t, 3 * config.target_hidden_size)), jnp.float32)
    return tokens, aux, jnp.arange(t, dtype=jnp.int32)[None]


def forward(d: Drafter, seed: int = 0):
    tokens, aux, pos = inputs(d.config, seed)
    return np.asarray(d.apply(tokens, d.fuse(aux), pos).logits)


def same_arrays(a: Drafter, b: Drafter, cast=None):
    x, y = a.arrays(), b.arrays()
    assert set(x) == set(y)
    for k in x:
        want = x[k]
        if cast is not None and want.dtype.kind == "f":
            want = np.asarray(jnp.asarray(want).astype(cast).astype(want.dtype))
        assert y[k].dtype == x[k].dtype, k
        np.testing.assert_array_equal(y[k], want, err_msg=str(k))


# ---------------------------------------------------------------------------------------
def test_config_json_round_trip():
    cfg = dataclasses.replace(BASE, **FLAGS["llama3_rope"], norm_before_fc=True)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert DrafterConfig.from_dict(data) == cfg
    assert hash(cfg) == hash(DrafterConfig.from_dict(data))
    with pytest.raises(ValueError, match="mask_token_id"):
        dataclasses.replace(BASE, mask_token_id=None)
    with pytest.raises(ValueError, match="mutually exclusive"):
        dataclasses.replace(BASE, norm_before_fc=True, fc_norm=True)


def test_save_load_bit_exact(tmp_path):
    d = perturbed(dataclasses.replace(BASE, attention_bias=True, fc_norm=True))
    d.save(tmp_path / "ckpt")
    d.save(tmp_path / "ckpt")  # replacing an existing checkpoint works
    back = load_drafter(tmp_path / "ckpt")
    assert back.config == d.config
    same_arrays(d, back)
    assert not list(tmp_path.glob(".*"))  # no temporary folders left behind
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        d.save(tmp_path / "other")


@pytest.mark.parametrize("flag", list(FLAGS))
def test_flag_changes_output_and_round_trips(flag, tmp_path):
    cfg = dataclasses.replace(BASE, **FLAGS[flag])
    base, flagged = perturbed(BASE), perturbed(cfg)
    if flag in ("norm_before_residual", "llama3_rope"):  # same parameters, different math
        same_arrays(base, flagged)
    assert np.abs(forward(base) - forward(flagged)).max() > 1e-3

    flagged.save(tmp_path / "own")
    back = load_drafter(tmp_path / "own")
    assert back.config == cfg
    same_arrays(flagged, back)

    exports = [("speculators", export_speculators)]
    if flag != "qk_norm":  # vLLM's Llama EAGLE-3 layout has no q/k norms (export refuses)
        exports.append(("vllm", export_vllm))
    for name, export in exports:
        export(flagged, tmp_path / f"{name}-f32", dtype="float32")
        back = load_drafter(tmp_path / f"{name}-f32")
        assert back.config == cfg, name
        same_arrays(flagged, back)
        export(flagged, tmp_path / f"{name}-bf16")  # default bf16
        back = load_drafter(tmp_path / f"{name}-bf16")
        assert back.config == cfg, name
        same_arrays(flagged, back, cast=jnp.bfloat16)
    if flag == "qk_norm":
        with pytest.raises(ValueError, match="q/k norms"):
            export_vllm(flagged, tmp_path / "vllm")


def test_reduced_draft_vocab(tmp_path):
    d = perturbed(BASE)
    np.testing.assert_array_equal(d.d2t, DRAFT_IDS - np.arange(40))
    assert d.t2d.sum() == 40
    assert d.t2d[DRAFT_IDS].all()
    ids = draft_to_target(d.model.d2t, jnp.arange(40))
    np.testing.assert_array_equal(np.asarray(ids), DRAFT_IDS)
    export_vllm(d, tmp_path / "v")
    from safetensors.numpy import load_file

    w = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert w["d2t"].dtype == np.int64
    assert w["t2d"].dtype == np.bool_
    assert w["t2d"].shape == (V,)
    assert w["fc.weight"].dtype.name == "bfloat16"
    assert w["lm_head.weight"].shape == (40, H)
    assert w["mask_hidden"].shape == (1, 1, 3 * H)
    assert "midlayer.hidden_norm.weight" in w
    assert "layers.1.self_attn.q_proj.weight" in w
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["mask_token_id"] == cfg["pard_token"] == cfg["ptd_token_id"] == V - 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 40
    # top-Vd by count, ties to the lower id, sorted by id
    counts = np.zeros(V, np.int64)
    counts[[5, 9, 2, 7]] = [10, 10, 3, 50]
    np.testing.assert_array_equal(select_draft_vocab(counts, 3), [5, 7, 9])


def test_cache_equals_no_cache():
    d = perturbed(BASE)
    tokens, aux, pos = inputs(BASE, t=12)
    g = d.fuse(aux)
    full = d.apply(tokens, g, pos)
    cache = kv.init(BASE, 1, 16)
    logits, hidden = [], []
    for lo, hi in [(0, 6), (6, 12)]:
        out = d.apply(tokens[:, lo:hi], g[:, lo:hi], pos[:, lo:hi], cache)
        cache = out.cache
        logits.append(out.logits)
        hidden.append(out.prenorm)
    assert float(jnp.abs(jnp.concatenate(logits, 1) - full.logits).max()) < 1e-5
    assert float(jnp.abs(jnp.concatenate(hidden, 1) - full.prenorm).max()) < 1e-5
    # ragged batch: row 1 is shorter (padding slots at position -1 write nothing)
    tokens2 = jnp.concatenate([tokens, tokens], 0)
    g2 = jnp.concatenate([g, g], 0)
    pos2 = jnp.stack([pos[0], jnp.where(pos[0] < 7, pos[0], -1)])
    out2 = d.apply(tokens2, g2, pos2, kv.init(BASE, 2, 16))
    assert float(jnp.abs(out2.logits[0] - full.logits[0]).max()) < 1e-5
    assert float(jnp.abs(out2.logits[1, :7] - full.logits[0, :7]).max()) < 1e-5  # causal: a prefix
    assert float(jnp.abs(out2.cache[0][0][1, 7:]).max()) == 0.0


def test_context_calls_equal_one_call():
    """Rows run in two calls, the second over the first's keys and values (`context`: the EAGLE-3
    training-time test, the depth-0 rows shared by segments), give the one-call outputs under the
    P-EAGLE rule; the second call without its context does not."""
    import kernels

    d = perturbed(BASE)
    m = d.model
    tokens, aux, _ = inputs(BASE, t=12)
    g = d.fuse(aux)
    anchor = jnp.asarray([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])  # 6 depth-0 rows, then depth 1 of each anchor
    depth = jnp.asarray([[0] * 6 + [1] * 6])
    doc = jnp.asarray([[0] * 5 + [-1] + [0] * 5 + [-1]])  # a padding row in each call
    pos = jnp.where(doc >= 0, anchor + depth, -1)
    full = m(tokens, g, pos, None, kernels.AttentionSpec.peagle(anchor, depth, doc))
    first = m(
        tokens[:, :6],
        g[:, :6],
        pos[:, :6],
        None,
        kernels.AttentionSpec.peagle(anchor[:, :6], depth[:, :6], doc[:, :6]),
        context=m.empty_context(1, g.dtype),
    )
    spec = kernels.AttentionSpec.make(anchor[:, 6:], depth[:, 6:], doc[:, 6:], anchor, depth, doc)
    second = m(tokens[:, 6:], g[:, 6:], pos[:, 6:], None, spec, context=first.cache)
    real = np.asarray(doc[0] >= 0)
    for part, rows in ((first, slice(0, 6)), (second, slice(6, 12))):
        assert part.cache[0][0].shape == (1, 6, BASE.num_kv_heads, BASE.head_dim)  # this call's keys
        np.testing.assert_allclose(part.logits[0][real[rows]], full.logits[0, rows][real[rows]], atol=1e-5)
    alone = m(
        tokens[:, 6:], g[:, 6:], pos[:, 6:], None, kernels.AttentionSpec.peagle(anchor[:, 6:], depth[:, 6:], doc[:, 6:])
    )
    assert float(jnp.abs(alone.logits - second.logits).max()) > 1e-3
    with pytest.raises(ValueError, match="context"):
        m(tokens[:, 6:], g[:, 6:], pos[:, 6:], kv.init(BASE, 1, 16), spec, context=first.cache)


def test_chain_mode_feeds_prenorm_back():
    cfg = dataclasses.replace(BASE, mode="chain", mask_token_id=None)
    d = perturbed(cfg)
    m = d.model
    assert not hasattr(m, "mask_hidden")
    with pytest.raises(ValueError):
        m.mask_g()
    tokens, aux, pos = inputs(cfg)
    g = d.fuse(aux)
    out = d.apply(tokens, g, pos, kv.init(cfg, 1, 16))
    seq_tok, seq_g = [tokens], [g]
    hidden, cache = out.prenorm[:, -1:], out.cache
    draft = draft_to_target(m.d2t, jnp.argmax(out.logits[:, -1:], -1))
    for step in range(3):  # EAGLE-3: one pass per draft token, own hidden state fed back
        seq_tok.append(draft)
        seq_g.append(m.feedback(hidden))
        out = d.apply(draft, m.feedback(hidden), jnp.full((1, 1), T + step, jnp.int32), cache)
        hidden, cache = out.prenorm, out.cache
        draft = draft_to_target(m.d2t, jnp.argmax(out.logits, -1))
    full = d.apply(jnp.concatenate(seq_tok, 1), jnp.concatenate(seq_g, 1), jnp.arange(T + 3)[None])
    assert float(jnp.abs(full.logits[:, -1] - out.logits[:, 0]).max()) < 1e-5
    # norm_output (EAGLE 3.1) feeds back the post-norm state
    m2 = nnx.merge(d.graphdef, d.state)
    m2.config = dataclasses.replace(cfg, norm_output=True)
    h = jnp.ones((1, 1, H))
    assert float(jnp.abs(m2.feedback(h) - m2.norm(h)).max()) == 0.0
    assert m.feedback(h) is h


_cod_jit = jax.jit(lambda gd, st, *a: cod_rows_forward(nnx.merge(gd, st), *a), static_argnums=(0,))


def test_cod_rows_match_the_inference_layout():
    """A COD row (anchor a, depth k) sees exactly what the single-pass draft step's k-th mask
    slot sees after real slots 0..a: same logits."""
    d = perturbed(BASE)
    m = d.model
    tokens, aux, pos = inputs(BASE)
    anchor = jnp.asarray([list(range(T)) + [3, 3, 5]], jnp.int32)
    depth = jnp.asarray([[0] * T + [1, 2, 1]], jnp.int32)
    rows_logits = _cod_jit(d.graphdef, d.state, tokens, aux, anchor, depth, jnp.zeros_like(anchor))
    assert float(jnp.abs(rows_logits[:, :T] - d.apply(tokens, d.fuse(aux), pos).logits).max()) < 1e-5
    # the single-pass layouts, one per COD row, batched and right-padded (position -1)
    cases = [(3, 1), (3, 2), (5, 1)]
    width = max(a + 1 + k for a, k in cases)
    g_real, g_mask = d.fuse(aux)[0], m.mask_g()
    slot_tok, slot_g, slot_pos = [], [], []
    for a, k in cases:
        n = a + 1 + k
        slot_tok.append(
            jnp.pad(jnp.concatenate([tokens[0, : a + 1], jnp.full((k,), BASE.mask_token_id)]), (0, width - n))
        )
        slot_g.append(
            jnp.pad(jnp.concatenate([g_real[: a + 1], jnp.broadcast_to(g_mask, (k, H))]), ((0, width - n), (0, 0)))
        )
        slot_pos.append(jnp.where(jnp.arange(width) < n, jnp.arange(width), -1))
    slots = d.apply(jnp.stack(slot_tok).astype(jnp.int32), jnp.stack(slot_g), jnp.stack(slot_pos)).logits
    for i, (a, k) in enumerate(cases):
        diff = float(jnp.abs(slots[i, a + k] - rows_logits[0, T + i]).max())
        assert diff < 1e-5, (a, k, diff)
    # documents and padding
    mask = np.asarray(peagle_mask(jnp.asarray([0, 1, 0, 1]), jnp.asarray([0, 0, 0, 1]), jnp.asarray([0, 0, 1, -1])))
    np.testing.assert_array_equal(mask, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])


# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from peagle_jax.handles.target import load_target

    hf_tiny = _hf_tiny()
    folder = tmp_path_factory.mktemp("llama")
    hf_tiny.build("llama-mha-untied", folder)
    return load_target(folder, dtype="float32", aux_layer_ids=(0, 1, 2))


def test_new_drafter_from_target(tiny_target, tmp_path):
    target = tiny_target
    tc = target.config
    counts = np.random.default_rng(3).integers(0, 100, tc.vocab_size)
    d = new_drafter(target, num_layers=2, draft_vocab=24, token_counts=counts, seed=1, fc_norm=True)
    c = d.config
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (
        tc.hidden_size,
        tc.num_heads,
        tc.num_kv_heads,
        tc.head_dim,
        tc.intermediate_size,
    )
    assert c.rope == tc.rope
    assert c.max_position_embeddings == tc.max_position_embeddings
    assert c.aux_layer_ids == target.aux_layer_ids
    assert c.k_train == 8
    assert c.fc_norm
    assert c.mask_token_id == tc.vocab_size - 1  # no pad token: the last id
    tm = nnx.merge(target.graphdef, target.state)
    m = d.model
    used = select_draft_vocab(counts, 24)
    np.testing.assert_array_equal(np.asarray(m.embed_tokens.embedding[...]), np.asarray(tm.embed_tokens.embedding[...]))
    np.testing.assert_array_equal(np.asarray(m.lm_head.kernel[...]), np.asarray(tm.lm_head.kernel[...])[:, used])
    np.testing.assert_array_equal(d.t2d.nonzero()[0], used)
    out = target.forward(jnp.asarray([[1, 2, 3, 4, 5]]))
    logits = d.apply(jnp.asarray([[2, 3, 4, 5, 6]]), d.fuse(out.aux_hidden), jnp.arange(5)[None]).logits
    assert logits.shape == (1, 5, 24)
    assert logits.dtype == jnp.float32
    d.save(tmp_path / "d")
    same_arrays(d, load_drafter(tmp_path / "d"))
    full = new_drafter(target, mode="chain")
    assert full.config.draft_vocab_size == tc.vocab_size
    assert full.config.mask_token_id is None
    assert not full.d2t.any()
    with pytest.raises(TypeError, match="unknown flags"):
        new_drafter(target, norm_befor_fc=True)


def test_new_drafter_gemma_target(tmp_path):
    from peagle_jax.handles.target import load_target

    hf_tiny = _hf_tiny()
    hf_tiny.build("gemma3", tmp_path / "g")
    target = load_target(tmp_path / "g", dtype="float32", aux_layer_ids=(0, 1, 2))
    d = new_drafter(target)
    tm = nnx.merge(target.graphdef, target.state)
    emb = np.asarray(tm.embed_tokens.embedding[...])
    np.testing.assert_allclose(
        np.asarray(d.model.embed_tokens.embedding[...]), emb * target.config.embed_scale, rtol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(d.model.lm_head.kernel[...]), emb.T)  # tied
    assert d.config.hidden_act == "silu"
    assert d.config.mask_token_id == (
        target.config.pad_token_id if target.config.pad_token_id is not None else target.config.vocab_size - 1
    )


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_weight_gradient_equals_autodiff_of_the_formula(offset):
    """`layers.scale_rows` (the norm's custom weight gradient, a [1, rows] x [rows, H] product)
    against autodiff of the plain formula, for Llama's and Gemma's scaling."""
    from peagle_jax.models.layers import RMSNorm

    w = jax.random.normal(jax.random.PRNGKey(1), (16,))
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 5, 16))
    c = jax.random.normal(jax.random.PRNGKey(3), (2, 5, 16))

    def plain(w, x):
        y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        return jnp.sum(y * (offset + w if offset else w) * c)

    def ours(w, x):
        norm = RMSNorm(16, 1e-6, offset=offset)
        norm.weight = nnx.Param(w)
        return jnp.sum(norm(x) * c)

    for i in (0, 1):
        want, got = jax.grad(plain, argnums=i)(w, x), jax.grad(ours, argnums=i)(w, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert float(jnp.max(jnp.abs(want))) > 1e-2


def test_pick_rows_and_its_gradient_equal_the_plain_gather():
    """`layers.pick_rows` (rows from per-position values or one slot; custom gradient: a
    scatter-add and a [1, rows] x [rows, F] product) against autodiff of take + where, with
    positions read by several rows and by none, and with no positions at all."""
    from peagle_jax.models.layers import pick_rows

    per_pos = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 8))
    slot = jax.random.normal(jax.random.PRNGKey(2), (8,))
    source = jnp.asarray([[0, 3, 3, -1, 5, -1, 0], [-1, -1, 2, 2, 2, 1, -1]], jnp.int32)
    c = jax.random.normal(jax.random.PRNGKey(3), (2, 7, 8))

    def plain(per_pos, slot):
        rows = jnp.take_along_axis(per_pos, jnp.clip(source, 0)[..., None], axis=1)
        return jnp.sum(jnp.where((source >= 0)[..., None], rows, slot) * c)

    def ours(per_pos, slot):
        return jnp.sum(pick_rows(per_pos, slot, source) * c)

    np.testing.assert_allclose(ours(per_pos, slot), plain(per_pos, slot), rtol=1e-6)
    for i in (0, 1):
        want, got = jax.grad(plain, argnums=i)(per_pos, slot), jax.grad(ours, argnums=i)(per_pos, slot)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert float(jnp.max(jnp.abs(want))) > 1e-2
    none = jnp.full((2, 7), -1, jnp.int32)  # no positions: every row the slot
    d_slot = jax.grad(lambda s: jnp.sum(pick_rows(per_pos[:, :0], s, none) * c))(slot)
    np.testing.assert_allclose(np.asarray(d_slot), np.asarray(jnp.sum(c, axis=(0, 1))), rtol=1e-5)


def test_rows_with_a_source_equal_their_gathered_inputs():
    """`DrafterModel.__call__(source=...)` (layer 0 computed per position and for the mask slot,
    then picked per row) gives the logits and gradients of the same call with every row's
    token and hidden input written out; with no positions (tokens None) every row is the slot."""
    d = perturbed(BASE)
    tokens, aux, _ = inputs(BASE)
    source = jnp.asarray([[0, 1, 2, -1, 3, -1, 1, -1]], jnp.int32)
    positions = jnp.asarray([[0, 1, 2, 3, 3, 4, 1, 2]], jnp.int32)
    m = d.model

    def picked(state):
        m = nnx.merge(d.graphdef, state)
        return m(tokens, m.fuse(aux), positions, source=source).logits

    def written_out(state):
        m = nnx.merge(d.graphdef, state)
        real = source >= 0
        at = jnp.clip(source[0], 0)
        tok = jnp.where(real, tokens[:, at], m.config.mask_token_id)
        g = jnp.where(real[..., None], m.fuse(aux)[:, at], m.mask_g())
        return m(tok, g, positions).logits

    np.testing.assert_allclose(np.asarray(picked(d.state)), np.asarray(written_out(d.state)), rtol=1e-5, atol=1e-5)
    c = jax.random.normal(jax.random.PRNGKey(0), picked(d.state).shape)
    grads = [
        jax.jit(jax.grad(lambda st, f=f: jnp.sum(f(st) * c), allow_int=True))(d.state) for f in (picked, written_out)
    ]
    for (path, got), (_, want) in zip(nnx.to_flat_state(grads[0]), nnx.to_flat_state(grads[1])):
        if jnp.issubdtype(want[...].dtype, jnp.floating):
            np.testing.assert_allclose(
                np.asarray(got[...]), np.asarray(want[...]), rtol=1e-4, atol=1e-5, err_msg=str(path)
            )
    slot_only = m(None, None, positions, source=jnp.full_like(source, -1)).logits
    every_slot = m(jnp.full_like(source, m.config.mask_token_id), jnp.broadcast_to(m.mask_g(), (1, 8, H)), positions)
    np.testing.assert_allclose(np.asarray(slot_only), np.asarray(every_slot.logits), rtol=1e-5, atol=1e-5)


def test_cod_rows_through_the_slot_attention_equal_the_dense_rule():
    """`cod_rows_states(mask="kernels", chain_depth=K - 1)` (layer 0 attends the mask slot once
    per position: `kernels.slot_attention`) gives the logits and parameter gradients of the
    dense P-EAGLE mask over the same COD rows (two documents, padding rows, rows unsorted), for a
    two-layer head with q/k norms and sliding windows (tests/test_train_segments.py checks the
    trainer's plain head the same way)."""
    flags = dict(qk_norm=True, norm_before_residual=True, sliding_window=6, layer_types=("sliding_attention",) * 2)
    from kernels.layouts import cod_layout, pad_layout
    from kernels.mask_slot import check_layout
    from peagle_jax.models.eagle import cod_rows_states

    config = dataclasses.replace(BASE, max_position_embeddings=64, **flags)
    d = perturbed(config)
    length, k = 40, 5
    tokens, aux, _ = inputs(config, t=length)
    rng = np.random.default_rng(2)
    rows = pad_layout(*cod_layout(length, k, rng=rng, docs=2), 140)
    assert (rows[1] >= 1).sum() > 40  # deep rows of several depths
    order = rng.permutation(140)
    anchor, depth, doc = (jnp.asarray(x[order])[None] for x in rows)
    check_layout(anchor, depth, doc, length, k - 1)
    c = jax.random.normal(jax.random.PRNGKey(1), (1, 140, config.draft_vocab_size))

    def loss(state, mask):
        m = nnx.merge(d.graphdef, state)
        logits = cod_rows_states(m, tokens, aux, anchor, depth, doc, mask=mask, chain_depth=k - 1).logits
        return jnp.sum(jnp.where(doc[..., None] >= 0, logits, 0) * c), logits

    loss_and_grads = jax.jit(jax.value_and_grad(loss, has_aux=True, allow_int=True), static_argnums=1)
    (_, got), g_got = loss_and_grads(d.state, "kernels")
    (_, want), g_want = loss_and_grads(d.state, "dense")
    real = np.asarray(doc[0] >= 0)
    np.testing.assert_allclose(np.asarray(got)[0, real], np.asarray(want)[0, real], rtol=2e-5, atol=2e-5)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_got), nnx.to_flat_state(g_want)):
        if jnp.issubdtype(b[...].dtype, jnp.floating):
            scale = float(np.max(np.abs(b[...])))  # f32 sums in another order
            np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), atol=2e-6 * scale, err_msg=str(path))
