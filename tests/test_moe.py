"""MoE target families (Qwen3-MoE, GPT-OSS) against transformers (torch CPU, float32, eager).

Logits within 1e-4 and aux states equal to HF `hidden_states` entries on configs whose routing
is not trivial (3 of 8 experts per token, every expert used: asserted through HF's own
routers); cached decode = full forward; ragged batches = per-row runs; the three grouped
products agree (and `ragged_dot` has a gradient); YaRN = transformers' `_compute_yarn_parameters`;
MXFP4 checkpoints load bit for bit as transformers dequantises them; greedy speculative
decoding is lossless in both modes; the export round trip; bad input named in one line.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import hf_tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_env
from flax import nnx
from safetensors.numpy import load_file, save_file

import peagle_jax as pj
from peagle_jax.config.target_config import ConfigError, RopeConfig
from peagle_jax.engine import SpeculativeDecoder
from peagle_jax.models import moe as moe_mod
from peagle_jax.models.registry import hf_config, target_config
from peagle_jax.runtime.sharding import make_mesh, spec_for
from peagle_jax.sources.weights import WeightsError, dequantize_mxfp4

torch = pytest.importorskip("torch")


ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "tests" / "programs"
AUX = (0, 1, 2)
KINDS = ("qwen3_moe", "gpt_oss")


def _close(got, want, tol, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bound = tol * max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def loaded(built):
    cache = {}

    def get(kind):
        if kind not in cache:
            folder, hf = built(kind)
            cache[kind] = (folder, hf, pj.load_target(folder, dtype="float32", aux_layer_ids=AUX))
        return cache[kind]

    return get


def _hf_routes(hf, ids) -> dict[int, np.ndarray]:
    """Expert ids [N, k] each HF MoE layer chose, captured from its router module."""
    routes, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        router = getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None)
        if router is None or not hasattr(router, "top_k"):
            continue
        hooks.append(router.register_forward_hook(lambda m, a, out, i=i: routes.__setitem__(i, out[2].numpy())))
    hf_tiny.hf_run(hf, ids)
    for h in hooks:
        h.remove()
    return routes


@pytest.mark.parametrize("kind", KINDS)
def test_matches_transformers_with_real_routing(kind, loaded):
    folder, hf, target = loaded(kind)
    cfg = target.config
    ids = hf_tiny.tokens(2, 12, seed=1)  # 12 > the gpt_oss sliding window (4)
    logits, hidden_states = hf_tiny.hf_run(hf, ids)
    out = target.forward(ids)
    np.testing.assert_allclose(np.asarray(out.logits), logits, rtol=0, atol=1e-4)
    aux = np.asarray(out.aux_hidden).reshape(2, 12, 3, -1)
    for j, layer in enumerate(AUX):
        _close(aux[:, :, j], hidden_states[layer], 1e-5, f"aux id {layer}")
    _close(out.hidden, hidden_states[-1], 1e-5, "final-norm hidden")

    routes = _hf_routes(hf, ids)
    want_moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    assert sorted(routes) == want_moe
    assert want_moe
    if kind == "qwen3_moe":
        assert cfg.mlp_types == ("moe", "dense", "moe")  # mlp_only_layers=[1]
    else:
        assert cfg.layer_types[0] == "sliding_attention"
        assert cfg.sliding_window == hf_tiny.GPT_OSS_WINDOW
    for i, r in routes.items():
        assert r.shape == (24, hf_tiny.TOP_K)
        assert hf_tiny.TOP_K > 1
        assert set(r.ravel().tolist()) == set(range(hf_tiny.EXPERTS)), f"layer {i}: not every expert used"
        assert all(len(set(row)) == hf_tiny.TOP_K for row in r.tolist())


@pytest.mark.parametrize("kind", KINDS)
def test_cached_decode_and_ragged_batch(kind, loaded):
    """Prefill 7, two 1-token steps, a 4-token extension, one more step = transformers' full
    forward (logits and aux states); right-padded rows (position -1) = their own runs. The ragged
    batch reuses the prefill's shapes (one compilation less)."""
    _, hf, target = loaded(kind)
    ids = hf_tiny.tokens(2, 14, seed=2)
    logits, hidden_states = hf_tiny.hf_run(hf, ids)
    cache = target.init_cache(2, 24)
    start = 0
    for n in (7, 1, 1, 4, 1):
        pos = np.broadcast_to(np.arange(start, start + n), (2, n))
        out = target.apply(ids[:, start : start + n], pos, cache)
        cache = out.cache
        sl = slice(start, start + n)
        np.testing.assert_allclose(np.asarray(out.logits), logits[:, sl], rtol=0, atol=1e-4)
        aux = np.asarray(out.aux_hidden).reshape(2, n, 3, -1)
        for j, layer in enumerate(AUX):
            _close(aux[:, :, j], hidden_states[layer][:, sl], 1e-5, f"aux {layer} at {start}")
        start += n

    lengths = [4, 7]
    ids = hf_tiny.tokens(2, 7, seed=3)
    pos = np.where(np.arange(7)[None] < np.array(lengths)[:, None], np.arange(7)[None], -1)
    cached = target.apply(ids, pos, target.init_cache(2, 24))
    for b, n in enumerate(lengths):
        logits, hs = hf_tiny.hf_run(hf, ids[b : b + 1, :n])
        np.testing.assert_allclose(np.asarray(cached.logits[b, :n]), logits[0], atol=1e-4, rtol=0)
        _close(np.asarray(cached.aux_hidden[b, :n]).reshape(n, 3, -1)[:, 2], hs[2][0], 1e-5, f"row {b}")


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_products_agree_and_ragged_dot_has_a_gradient(kind, loaded):
    """ "ragged" (lax.ragged_dot), "blocks" (sorted blocks) and "dense" (all experts) agree; the
    gradients through ragged_dot equal the dense ones (GPT-OSS: interleaved gate/up, biases)."""
    _, _, target = loaded(kind)
    layer = target.model.layers[0].mlp
    graphdef, state = nnx.split(layer)
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 40, hf_tiny.HIDDEN), jnp.float32)

    @functools.partial(jax.jit, static_argnums=1)
    def run(state, impl):
        return nnx.merge(graphdef, state)(x, impl=impl)

    outs = {impl: np.asarray(run(state, impl)) for impl in ("ragged", "blocks", "dense")}
    assert np.abs(outs["dense"]).max() > 0.1
    for impl in ("ragged", "blocks"):
        np.testing.assert_allclose(outs[impl], outs["dense"], atol=2e-5, rtol=0, err_msg=impl)
    assert moe_mod.resolve_impl("auto") == "blocks"  # CPU: jax's ragged_dot is a masked dense product here
    counts = np.asarray(moe_mod.expert_counts(layer, x))
    assert counts.sum() == 120 * hf_tiny.TOP_K
    assert (counts > 0).all()

    if kind != "gpt_oss":
        return

    def loss(state, impl):
        return jnp.sum(run(state, impl) ** 2)

    grads = {impl: jax.grad(loss)(state, impl) for impl in ("ragged", "dense")}
    for name in ("down_proj", "gate_up_proj", "gate_up_proj_bias"):
        g_ragged, g_dense = (np.asarray(grads[i]["experts"][name][...]) for i in ("ragged", "dense"))
        assert np.abs(g_ragged).max() > 0
        np.testing.assert_allclose(g_ragged, g_dense, atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize(
    "params",
    [
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096, truncate=False),
        dict(factor=4.0, original_max_position_embeddings=64),  # truncate defaults to True
        dict(factor=8.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0),
        dict(factor=8.0, original_max_position_embeddings=64, attention_factor=1.25),
    ],
)
def test_yarn_matches_transformers(params):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_params = dict(rope_type="yarn", rope_theta=150000.0, **params)
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=1, head_dim=64, rope_parameters=rope_params, max_position_embeddings=256
    )
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = RopeConfig.from_dict(rope_params, 10000.0, "test")
    np.testing.assert_allclose(ours.inv_freq(64), inv.numpy(), rtol=2e-7, atol=0)
    assert ours.attention_scaling() == pytest.approx(scale, rel=1e-12)
    assert RopeConfig.from_dict(ours.to_hf(), 1.0, "again") == ours


def _random_mxfp4(shape_out_in: tuple, rng) -> tuple[np.ndarray, np.ndarray]:
    """Blocks [E, out, in/32, 16] and scales [E, out, in/32] as the released files hold them."""
    e, out, fin = shape_out_in
    blocks = rng.integers(0, 256, size=(e, out, fin // 32, 16), dtype=np.uint8)
    scales = rng.integers(116, 124, size=(e, out, fin // 32), dtype=np.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """A tiny GPT-OSS (hidden 64, experts width 32: both multiples of 32) whose expert stacks are
    MXFP4 in the released layout; the torch model holds transformers' own dequantisation."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    hf = hf_tiny.build("gpt_oss", folder)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    rng = np.random.default_rng(7)
    e, h, i = hf_tiny.EXPERTS, hf_tiny.HIDDEN, hf_tiny.MOE_INTER
    with torch.no_grad():
        for layer in range(hf_tiny.LAYERS):
            experts = hf.model.layers[layer].mlp.experts
            for name, (out, fin) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
                key = f"model.layers.{layer}.mlp.experts.{name}"
                blocks, scales = _random_mxfp4((e, out, fin), rng)
                deq = convert_moe_packed_tensors(
                    torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
                )
                assert tuple(deq.shape) == tuple(getattr(experts, name).shape) == (e, fin, out)
                getattr(experts, name).copy_(deq)
                del tensors[key]
                tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, str(path), metadata={"format": "pt"})
    hf_tiny.edit_config(folder, lambda c: c.update(quantization_config={"quant_method": "mxfp4"}))
    return folder, hf


def test_mxfp4_checkpoint_loads_as_transformers_dequantises_it(mxfp4_folder):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder, hf = mxfp4_folder
    target = pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)
    for layer in range(hf_tiny.LAYERS):
        experts = hf.model.layers[layer].mlp.experts
        ours = target.model.layers[layer].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            want = getattr(experts, name).detach().numpy()
            got = np.asarray(getattr(ours, name)[...])
            assert np.array_equal(got, want), (layer, name)  # bit for bit
    ids = hf_tiny.tokens(2, 10, seed=5)
    logits, _ = hf_tiny.hf_run(hf, ids)
    np.testing.assert_allclose(np.asarray(target.forward(ids).logits), logits, rtol=0, atol=1e-4)

    # bfloat16: the e2m1 values times powers of two are exact there too
    rng = np.random.default_rng(1)
    blocks, scales = _random_mxfp4((2, 8, 64), rng)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
    got = dequantize_mxfp4(blocks, scales, jnp.bfloat16)
    assert np.array_equal(np.asarray(got, np.float32), want.float().numpy())


def test_mxfp4_bad_shapes_are_named(mxfp4_folder, tmp_path):
    folder, _ = mxfp4_folder
    key = "model.layers.1.mlp.experts.down_proj"
    for suffix, bad in (
        ("_blocks", lambda a: a[..., :8]),
        ("_scales", lambda a: a[:, :-1]),
        ("_scales", lambda a: a.astype(np.float32)),
    ):
        dst = tmp_path / f"bad{suffix}{bad.__hash__()}"
        dst.mkdir()
        (dst / "config.json").write_text((folder / "config.json").read_text())
        tensors = load_file(str(folder / "model.safetensors"))
        tensors[key + suffix] = np.ascontiguousarray(bad(tensors[key + suffix]))
        save_file(tensors, str(dst / "model.safetensors"))
        with pytest.raises(WeightsError, match=f"MXFP4 tensor '{key}{suffix}' has (shape|dtype)") as err:
            pj.load_target(dst, dtype="float32", aux_layer_ids=AUX)
        assert "\n" not in str(err.value)


def _lossless(target, cases):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, hf_tiny.VOCAB, size=int(n)).tolist() for n in (3, 11, 7)]
    new = 12
    plain = SpeculativeDecoder(target, mode="none").generate(prompts, max_new_tokens=new)
    for mode, k in cases:
        drafter = pj.new_drafter(target, num_layers=1, mode=mode, seed=3)
        res = SpeculativeDecoder(target, drafter, k=k, mode=mode).generate(prompts, max_new_tokens=new)
        assert res.tokens == plain.tokens, (target.config.model_type, mode, k)
        assert 1.0 <= res.stats["acceptance_length"] <= k + 1


# each (mode, K) costs ~10 s of compilation here: the default run takes one per family, the
# `slow` one the whole matrix (both modes x K = 1, 3, 7 x both families)
@pytest.mark.parametrize("kind,mode,k", [("gpt_oss", "parallel", 3), ("qwen3_moe", "chain", 7)])
def test_lossless_greedy_speculative(kind, mode, k, loaded):
    _lossless(loaded(kind)[2], [(mode, k)])


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_lossless_greedy_speculative_full_matrix(kind, loaded):
    _lossless(loaded(kind)[2], [(mode, k) for mode in ("parallel", "chain") for k in (1, 3, 7)])


@pytest.mark.parametrize("kind", KINDS)
def test_export_reload_in_transformers(kind, loaded, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, hf, target = loaded(kind)
    out = target.save(tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    ids = hf_tiny.tokens(2, 10, seed=4)
    np.testing.assert_allclose(hf_tiny.hf_run(reloaded, ids)[0], hf_tiny.hf_run(hf, ids)[0], rtol=0, atol=1e-5)
    again = pj.load_target(out, dtype="float32", aux_layer_ids=AUX)
    assert again.config == target.config == target_config(hf_config(target.config))
    for a, b in zip(jax.tree.leaves(again.state), jax.tree.leaves(target.state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "kind,key",
    [
        ("qwen3_moe", "model.layers.2.mlp.gate.weight"),
        ("qwen3_moe", "model.layers.0.mlp.experts.5.down_proj.weight"),
        ("gpt_oss", "model.layers.1.mlp.router.weight"),
        ("gpt_oss", "model.layers.2.mlp.experts.gate_up_proj"),
        ("gpt_oss", "model.layers.0.self_attn.sinks"),
    ],
)
def test_missing_router_or_expert_tensor_is_named(kind, key, loaded, tmp_path):
    folder, _, _ = loaded(kind)
    dst = tmp_path / "broken"
    dst.mkdir()
    (dst / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors[key]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(WeightsError, match=f"missing tensor '{key}'"):
        pj.load_target(dst, dtype="float32", aux_layer_ids=AUX)


@pytest.mark.parametrize("kind,field", [("qwen3_moe", "num_experts_per_tok"), ("gpt_oss", "num_experts_per_tok")])
def test_top_k_above_the_experts_is_refused(kind, field, loaded):
    folder, _, _ = loaded(kind)
    raw = json.loads((folder / "config.json").read_text())
    raw[field] = hf_tiny.EXPERTS + 1
    with pytest.raises(ConfigError, match=rf"num_experts_per_tok {hf_tiny.EXPERTS + 1} must be in \[1, num_experts"):
        target_config(raw)


def test_expert_parallel_rule():
    mesh = make_mesh(tensor=1, fsdp=1, devices=jax.devices()[:1])
    assert spec_for("layers/0/mlp/experts/gate_up_proj", (32, 64, 128), mesh) == jax.sharding.PartitionSpec(
        "fsdp", None, "tensor"
    )
    assert spec_for("layers/0/mlp/experts/down_proj", (32, 64, 64), mesh) == jax.sharding.PartitionSpec(
        "fsdp", "tensor", None
    )
    assert spec_for("layers/0/mlp/experts/down_proj_bias", (32, 64), mesh) == jax.sharding.PartitionSpec("fsdp", None)


@pytest.mark.slow
def test_expert_parallel_engine_equals_single_device(loaded):
    """8 simulated devices (fsdp 2 x tensor 4): the expert stacks really spread, same logits and tokens."""

    folder, _, _ = loaded("gpt_oss")
    out = xla_env.run_program(PROGRAMS / "moe_sharded.py", folder, devices=8)
    assert out["expert_shards_False"] == 1
    assert out["expert_shards_True"] == 8
    np.testing.assert_allclose(np.asarray(out["logits_True"]), np.asarray(out["logits_False"]), atol=1e-5, rtol=0)
    assert out["tokens_True"] == out["tokens_False"]


def test_a_sharded_train_step_routes_each_devices_tokens_on_that_device(built):
    """8 sequences on 8 devices (fsdp): each device sorts its own (token, expert) pairs. One sort
    over every sequence put all 8 sequences' pairs on every device: a Qwen3-30B-A3B step at 4,096
    tokens on 8 H100s planned 130 GiB of temporaries a device, 7 times a single H100's for one sequence."""
    folder, _ = built("qwen3_moe_4")
    got = xla_env.run_program(PROGRAMS / "target_rows_on_mesh.py", folder, devices=8)
    assert got["moe_global_pairs"] == 0 and got["moe_device_pairs"] > 0, got
    assert got["global_rows"] == 0, got  # its dense layer too
    assert got["moe_rows_sharded_max_diff"] == 0.0, got  # the same states as one global sort
