"""`new_drafter(init_layer=N)` (peagle_jax/handles/drafter_init.py): a head's first layer started from a
target decoder layer. On a Llama target the started layer, its embedding half of q / k / v set to
zero, computes exactly what the target layer computes on the same states; on Gemma 3 and Qwen3 the
carried arrays are the target's (Gemma's norms as effective scales, the pre-MLP norm its
pre_feedforward_layernorm); what is not carried keeps the random start; bad layers fail in one line."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import peagle_jax as pj
from train.flags import parse_args

ATTN = ("q_proj", "k_proj", "v_proj")


@pytest.fixture(scope="module")
def targets(built):
    return {kind: pj.load_target(built(kind)[0], dtype="float32") for kind in ("llama-mha-untied", "gemma3", "qwen3")}


def host(variable) -> np.ndarray:
    return np.asarray(variable[...], np.float32)


@pytest.mark.parametrize("layer", [1, -1])
def test_a_llama_head_from_a_target_layer_computes_that_layer(targets, layer):
    target = targets["llama-mha-untied"]
    h = target.config.hidden_size
    arrays = {
        k: np.array(v) for k, v in pj.new_drafter(target, num_layers=1, init_layer=layer, seed=3).arrays().items()
    }
    for proj in ATTN:  # the embedding's half reads nothing: layer 0 sees the fused state alone
        arrays[("layers", 0, "self_attn", proj, "kernel")][:h] = 0.0
    head = pj.Drafter.from_arrays(pj.new_drafter(target, num_layers=1).config, arrays, "float32")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 9, h)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    want, _ = target.model.layers[layer % target.config.num_layers](x, positions)
    got, _ = head.model.layers[0](x, positions, embeds=jnp.zeros_like(x))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    random_head = pj.new_drafter(target, num_layers=1, seed=3).model.layers[0]
    assert np.max(np.abs(np.asarray(random_head(x, positions, embeds=jnp.zeros_like(x))[0]) - np.asarray(want))) > 0.1


@pytest.mark.parametrize("kind,qk_norm", [("gemma3", True), ("qwen3", True), ("qwen3", False)])
def test_the_carried_arrays_are_the_target_layers(targets, kind, qk_norm):
    target = targets[kind]
    h, offset = target.config.hidden_size, target.config.norm_offset
    fresh = pj.new_drafter(target, num_layers=1, seed=5, qk_norm=qk_norm).arrays()
    got = pj.new_drafter(target, num_layers=1, seed=5, qk_norm=qk_norm, init_layer=-2).arrays()
    src = target.state["layers"][target.config.num_layers - 2]
    for proj in ATTN:
        path = ("layers", 0, "self_attn", proj, "kernel")
        np.testing.assert_array_equal(got[path][h:], host(src["self_attn"][proj]["kernel"]))
        np.testing.assert_array_equal(got[path][:h], fresh[path][:h])  # the embedding's half: random as before
    np.testing.assert_array_equal(
        got[("layers", 0, "self_attn", "o_proj", "kernel")], host(src["self_attn"]["o_proj"]["kernel"])
    )
    for name in ("gate_proj", "up_proj", "down_proj"):
        np.testing.assert_array_equal(got[("layers", 0, "mlp", name, "kernel")], host(src["mlp"][name]["kernel"]))
    pre_mlp = "pre_feedforward_layernorm" if kind == "gemma3" else "post_attention_layernorm"
    norms = {"hidden_norm": "input_layernorm", "post_attention_layernorm": pre_mlp}
    for mine, theirs in norms.items():
        np.testing.assert_allclose(got[("layers", 0, mine, "weight")], host(src[theirs]["weight"]) + offset)
    qk = ("layers", 0, "self_attn", "q_norm", "weight")
    assert (qk in got) == qk_norm
    if qk_norm:
        np.testing.assert_allclose(got[qk], host(src["self_attn"]["q_norm"]["weight"]) + offset)
    for path in (("fc", "kernel"), ("layers", 0, "input_layernorm", "weight"), ("mask_hidden",)):
        np.testing.assert_array_equal(got[path], fresh[path])  # not carried


def test_bad_layers_fail_in_one_line(targets, tmp_path):
    target = targets["qwen3"]
    n = target.config.num_layers
    with pytest.raises(ValueError, match=rf"init_layer={n}: the target has {n} layers"):
        pj.new_drafter(target, num_layers=1, init_layer=n)
    with pytest.raises(ValueError, match="DFlash"):
        pj.new_drafter(target, num_layers=1, mode="dflash", init_layer=0)
    from train.trainer import TrainError, check_target

    cfg = parse_args(["--preset", "tiny", "--out", str(tmp_path), "--model.init_layer", str(-n - 1)])
    with pytest.raises(TrainError, match=rf"model.init_layer={-n - 1}: .* has {n} layers \(valid: {-n} .. {n - 1}\)"):
        check_target(cfg, target, "the target")
