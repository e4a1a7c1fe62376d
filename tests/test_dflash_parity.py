"""DFlash against its reference: speculators 0.9.0's PyTorch `DFlashDraftModel` (eager
attention, f32, CPU) and our `DFlashModel` on the same random weights and inputs give the same
draft logits over the same anchored blocks, for a tiny head and a Gemma-shaped one (head_dim
256, one KV head), full vocabulary and a draft vocabulary.

speculators picks its anchors at random inside `forward`: `select_anchors` is replaced by one
returning ours. Its default loss needs Triton, so the eager KL is passed in.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.speculators, pytest.mark.filterwarnings("ignore::FutureWarning")]

torch = pytest.importorskip("torch")
pytest.importorskip("speculators", exc_type=ImportError)

import jax.numpy as jnp  # noqa: E402
from speculators.models.dflash import core as dflash_core  # noqa: E402
from speculators.models.dflash.config import DFlashSpeculatorConfig  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from peagle_jax.config.drafter_config import DrafterConfig  # noqa: E402
from peagle_jax.config.target_config import RopeConfig  # noqa: E402
from peagle_jax.handles.drafter import Drafter  # noqa: E402
from peagle_jax.models.dflash import block_rows_states  # noqa: E402

TOL = 1e-5
L = 24
ANCHORS = np.array([0, 3, 4, 9, 13, 15])  # sorted, < L - block_size; 0: a block with no context
CASES = {
    "tiny": dict(hidden=32, heads=4, kv=2, head_dim=8, inter=48, layers=2, vocab=64, vd=64, aux=3, block=4),
    "tiny-Vd<V": dict(hidden=32, heads=4, kv=2, head_dim=8, inter=48, layers=1, vocab=64, vd=40, aux=2, block=5),
    "gemma-shaped": dict(
        hidden=640, heads=4, kv=1, head_dim=256, inter=256, layers=2, vocab=512, vd=512, aux=2, block=8
    ),
}


def speculators_model(c: dict, seed: int = 0):
    tl = Qwen3Config(
        hidden_size=c["hidden"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv"],
        head_dim=c["head_dim"],
        intermediate_size=c["inter"],
        num_hidden_layers=c["layers"],
        vocab_size=c["vocab"],
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        rope_theta=10000.0,
    )
    tl._attn_implementation = "eager"
    cfg = DFlashSpeculatorConfig(
        transformer_layer_config=tl,
        draft_vocab_size=c["vd"],
        block_size=c["block"],
        aux_hidden_state_layer_ids=list(range(1, c["aux"] + 1)),
        mask_token_id=c["vocab"] - 2,
    )
    torch.manual_seed(seed)
    model = dflash_core.DFlashDraftModel(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():  # not the buffers: RoPE's inv_freq is one
            if name.endswith("norm.weight"):  # around one, so a (1 + w) mix-up shows
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(torch.randn(t.shape, generator=gen) / np.sqrt(t.shape[-1]))
        if c["vd"] < c["vocab"]:
            used = torch.sort(torch.randperm(c["vocab"], generator=gen)[: c["vd"]]).values
            model.d2t.copy_(used - torch.arange(c["vd"]))
            model.t2d.zero_()
            model.t2d[used] = True
    return model


def our_drafter(c: dict, model) -> Drafter:
    cfg = DrafterConfig(
        hidden_size=c["hidden"],
        target_hidden_size=c["hidden"],
        num_layers=c["layers"],
        num_heads=c["heads"],
        num_kv_heads=c["kv"],
        head_dim=c["head_dim"],
        intermediate_size=c["inter"],
        vocab_size=c["vocab"],
        draft_vocab_size=c["vd"],
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=128,
        mode="dflash",
        mask_token_id=c["vocab"] - 2,
        aux_layer_ids=tuple(range(1, c["aux"] + 1)),
        qk_norm=True,
        block_size=c["block"],
    )
    arrays = {}
    for name, t in model.state_dict().items():
        if name.startswith("verifier_") or name == "t2d":
            continue
        parts = tuple(int(p) if p.isdigit() else p for p in name.split("."))
        a = t.detach().numpy()
        if name == "d2t":
            arrays[("d2t",)] = a.astype(np.int32) if a is not None else None
        elif name == "embed_tokens.weight":
            arrays[("embed_tokens", "embedding")] = a
        elif parts[-1] == "weight" and "norm" not in parts[-2]:
            arrays[(*parts[:-1], "kernel")] = a.T
        else:
            arrays[parts] = a
    if ("d2t",) not in arrays:
        arrays[("d2t",)] = np.zeros((c["vd"],), np.int32)
    return Drafter.from_arrays(cfg, arrays)


def inputs(c: dict, seed: int = 1):
    rng = np.random.default_rng(seed)
    aux = rng.standard_normal((L, c["aux"] * c["hidden"])).astype(np.float32)
    ids = rng.integers(0, c["vocab"] - 2, L)
    return aux, ids


def speculators_logits(model, c, aux, ids, monkeypatch):
    n = len(ANCHORS)
    monkeypatch.setattr(
        dflash_core, "select_anchors", lambda *a, **k: (torch.as_tensor(ANCHORS), torch.ones(n, dtype=torch.bool))
    )
    monkeypatch.setattr(dflash_core, "compute_metrics", lambda *a, **k: (torch.zeros(()), {}))
    captured = {}
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: captured.__setitem__("logits", out))
    try:
        with torch.no_grad():
            model(
                hidden_states=torch.as_tensor(aux)[None],
                input_ids=torch.as_tensor(ids)[None],
                loss_mask=torch.ones(1, L),
                verifier_last_hidden_states=torch.zeros(1, L, c["hidden"]),
                document_ids=torch.zeros(1, L, dtype=torch.long),
                max_anchors=n,
            )
    finally:
        hook.remove()
    return captured["logits"][0].numpy()


def our_logits(drafter: Drafter, aux, ids, mask: str = "dense") -> np.ndarray:
    """Our head's logits at every block row of ANCHORS over one packed sequence of L tokens."""
    out = block_rows_states(
        drafter.model,
        jnp.asarray(ids)[None],
        jnp.asarray(aux)[None],
        jnp.arange(L)[None],
        jnp.zeros((1, L), jnp.int32),
        jnp.asarray(ANCHORS)[None],
        jnp.ones((1, len(ANCHORS)), bool),
        mask=mask,
    )
    return np.asarray(out.logits[0])


@pytest.mark.parametrize("mask", ["dense", "kernels"])
@pytest.mark.parametrize("case", list(CASES))
def test_dflash_logits_equal_speculators(case, mask, monkeypatch):
    c = CASES[case]
    model = speculators_model(c)
    drafter = our_drafter(c, model)
    aux, ids = inputs(c)
    want = speculators_logits(model, c, aux, ids, monkeypatch)
    got = our_logits(drafter, aux, ids, mask)
    assert got.shape == want.shape == (len(ANCHORS) * c["block"], c["vd"])
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < TOL, f"{case}/{mask}: max relative difference {err:.2e}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_rule_equals_speculators_mask(seed):
    """`AttentionSpec.block` over packed documents and padding blocks is speculators'
    `create_anchor_block_mask_mod`, key for key (context strictly before the anchor, own
    document only, own block bidirectional, no other block)."""
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from torch.nn.attention.flex_attention import create_mask

    import kernels

    rng = np.random.default_rng(seed)
    length, bs, n = 40, 4, 7
    doc = np.sort(rng.integers(0, 3, length))
    doc[-3:] = -1  # padding at the end of the packed row
    anchors = np.sort(rng.choice(length - bs, n, replace=False))
    mod, q_len, kv_len = create_anchor_block_mask_mod(torch.as_tensor(doc), length, torch.as_tensor(anchors), bs)
    want = create_mask(mod, None, None, q_len, kv_len, device="cpu")[0, 0].numpy()
    block_doc = np.where(doc[anchors] >= 0, doc[anchors], -1)
    spec = kernels.AttentionSpec.block(anchors, block_doc, np.arange(length), doc, block_size=bs)
    got = np.asarray(spec.dense_mask()[0])
    assert got.shape == want.shape == (n * bs, length + n * bs)
    assert want.any(axis=1).all()  # every row sees something: a vacuous comparison would not
    np.testing.assert_array_equal(got, want)


def test_block_attention_kernels_equal_dense():
    """The blockwise kernels compute the block rule from metadata alone, equal to the dense mask
    (two documents, a padding block, a block at position 0 with no context)."""
    import kernels

    rng = np.random.default_rng(3)
    length, bs, heads, kv_heads, dim = 48, 8, 4, 2, 16
    doc = np.array([0] * 20 + [1] * 28)
    anchors = np.array([[0, 5, 12, 20, 30, 39]])
    block_doc = np.where(np.arange(6) == 4, -1, doc[anchors])  # block 4 is padding
    spec = kernels.AttentionSpec.block(anchors, block_doc, np.arange(length)[None], doc[None], block_size=bs)
    q = jnp.asarray(rng.standard_normal((1, 6 * bs, heads, dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, length + 6 * bs, kv_heads, dim)), jnp.float32) for _ in range(2))
    dense = kernels.attention(q, k, v, spec, backend="dense")
    blockwise = kernels.attention(q, k, v, spec, backend="auto")
    real = np.repeat(block_doc[0] >= 0, bs)
    np.testing.assert_allclose(np.asarray(blockwise)[0, real], np.asarray(dense)[0, real], rtol=1e-5, atol=1e-6)
