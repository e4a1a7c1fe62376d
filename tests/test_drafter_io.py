"""Importing drafter folders built by hand in the vLLM-native and speculators layouts
(docs/method.md section 6), clear errors on bad input, and what the exports hold."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from paths import VECTORS
from safetensors.numpy import save_file

from peagle_jax.config.target_config import ConfigError
from peagle_jax.formats.checkpoints import (
    DrafterIOError,
    check_tensors,
    checkpoint_tensors,
    detect_format,
    export_speculators,
    export_vllm,
    read_drafter,
    read_vllm_config,
    vllm_tensors,
)
from peagle_jax.handles.drafter import load_drafter

V, H, HEADS, KV, HD, INTER, N = 48, 32, 4, 2, 8, 40, 2
GOLDEN = VECTORS / "drafter-speculators"


def hand_tensors(layer0="midlayer", bias=False, vd=V, seed=0, parallel=True):
    """Every tensor of section 6, written out independently of peagle_jax's key table."""
    rng = np.random.default_rng(seed)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    t = {"embed_tokens.weight": r(V, H), "fc.weight": r(H, 3 * H), "norm.weight": 1 + r(H), "lm_head.weight": r(vd, H)}
    for i in range(N):
        p = f"{layer0}." if i == 0 else f"layers.{i}."
        inp = 2 * H if i == 0 else H
        t.update(
            {
                p + "input_layernorm.weight": 1 + r(H),
                p + "post_attention_layernorm.weight": 1 + r(H),
                p + "self_attn.q_proj.weight": r(HEADS * HD, inp),
                p + "self_attn.k_proj.weight": r(KV * HD, inp),
                p + "self_attn.v_proj.weight": r(KV * HD, inp),
                p + "self_attn.o_proj.weight": r(H, HEADS * HD),
                p + "mlp.gate_proj.weight": r(INTER, H),
                p + "mlp.up_proj.weight": r(INTER, H),
                p + "mlp.down_proj.weight": r(H, INTER),
            }
        )
        if i == 0:
            t[p + "hidden_norm.weight"] = 1 + r(H)
        if bias:
            for q, n in (("q", HEADS * HD), ("k", KV * HD), ("v", KV * HD), ("o", H)):
                t[p + f"self_attn.{q}_proj.bias"] = r(n)
    used = np.sort(rng.choice(V, vd, replace=False)) if vd < V else np.arange(V)
    t["d2t"] = (used - np.arange(vd)).astype(np.int64)
    t2d = np.zeros(V, bool)
    t2d[used] = True
    t["t2d"] = t2d
    if parallel:
        t["mask_hidden"] = rng.standard_normal((1, 1, 3 * H)).astype(np.float32)
    return t


def vllm_config(vd=V, bias=False, **extra):
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_hidden_layers": N,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "vocab_size": V,
        "draft_vocab_size": vd,
        "target_hidden_size": H,
        "norm_before_residual": False,
        "attention_bias": bias,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
        "pard_token": V - 2,
    }
    cfg.update(extra)
    return cfg


def write(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def check_params(d, t, layer0):
    m = d.model
    np.testing.assert_array_equal(np.asarray(m.embed_tokens.embedding[...]), t["embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(m.fc.kernel[...]), t["fc.weight"].T)
    np.testing.assert_array_equal(
        np.asarray(m.layers[0].self_attn.k_proj.kernel[...]), t[f"{layer0}.self_attn.k_proj.weight"].T
    )
    np.testing.assert_array_equal(np.asarray(m.layers[0].hidden_norm.weight[...]), t[f"{layer0}.hidden_norm.weight"])
    np.testing.assert_array_equal(
        np.asarray(m.layers[1].mlp.down_proj.kernel[...]), t["layers.1.mlp.down_proj.weight"].T
    )
    np.testing.assert_array_equal(np.asarray(m.lm_head.kernel[...]), t["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(m.mask_hidden[...]), t["mask_hidden"])
    np.testing.assert_array_equal(d.d2t, t["d2t"])
    np.testing.assert_array_equal(d.t2d, t["t2d"])


def logits(d, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, V, (1, 6)), jnp.int32)
    aux = jnp.asarray(rng.standard_normal((1, 6, 3 * H)), jnp.float32)
    return np.asarray(d.apply(tokens, d.fuse(aux), jnp.arange(6)[None]).logits)


# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer0", ["midlayer", "layers.0"])
def test_vllm_layouts(tmp_path, layer0):
    t = hand_tensors(layer0, vd=20)
    d = load_drafter(write(tmp_path / layer0, vllm_config(vd=20), t))
    assert detect_format(tmp_path / layer0) == "vllm"
    c = d.config
    assert c.mode == "parallel"
    assert c.mask_token_id == V - 2
    assert c.aux_layer_ids == (1, 3, 5)
    assert (c.draft_vocab_size, c.rms_norm_eps, c.rope.type, c.rope.factor) == (20, 1e-5, "llama3", 8.0)
    assert c.rope.original_max_position_embeddings == 64
    assert c.max_position_embeddings == 256
    check_params(d, t, layer0)


def test_vllm_both_namings_give_the_same_head(tmp_path):
    mid = load_drafter(write(tmp_path / "a", vllm_config(), hand_tensors("midlayer")))
    lay = load_drafter(write(tmp_path / "b", vllm_config(), hand_tensors("layers.0")))
    np.testing.assert_array_equal(logits(mid), logits(lay))


def test_vllm_attention_bias(tmp_path):
    t = hand_tensors(bias=True)
    d = load_drafter(write(tmp_path / "bias", vllm_config(bias=True), t))
    assert d.config.attention_bias
    m = d.model
    for layer, key in ((0, "midlayer.self_attn.q_proj.bias"), (1, "layers.1.self_attn.o_proj.bias")):
        proj = m.layers[layer].self_attn.q_proj if ".q_proj" in key else m.layers[layer].self_attn.o_proj
        np.testing.assert_array_equal(np.asarray(proj.bias[...]), t[key])
    no_bias = {k: v for k, v in t.items() if not k.endswith(".bias")}
    d0 = load_drafter(write(tmp_path / "nobias", vllm_config(), no_bias))
    assert np.abs(logits(d) - logits(d0)).max() > 1e-4


def test_vllm_variants(tmp_path):
    # top-level aux ids and mask id, norm_before_fc inside eagle_config, full vocab without d2t/t2d
    cfg = vllm_config(
        eagle_config={"use_aux_hidden_state": True, "norm_before_fc": True},
        eagle_aux_hidden_state_layer_ids=[0, 2, 4],
        mask_token_id=7,
        pard_token=None,
    )
    t = hand_tensors()
    t["input_norm.weight"] = np.ones(3 * H, np.float32)
    del t["d2t"], t["t2d"]
    d = load_drafter(write(tmp_path / "v", cfg, t))
    assert d.config.aux_layer_ids == (0, 2, 4)
    assert d.config.mask_token_id == 7
    assert d.config.norm_before_fc
    assert not d.d2t.any()
    assert d.t2d.all()
    # no mask id and no mask_hidden: an EAGLE-3 chain head
    chain = {k: v for k, v in hand_tensors().items() if k != "mask_hidden"}
    d = load_drafter(write(tmp_path / "chain", vllm_config(pard_token=None), chain))
    assert d.config.mode == "chain"
    assert d.config.mask_token_id is None


def test_golden_speculators_exports(tmp_path):
    d = load_drafter(GOLDEN)
    assert detect_format(GOLDEN) == "speculators"
    for name, export in (("vllm", export_vllm), ("spec", export_speculators)):
        back = load_drafter(export(d, tmp_path / name, dtype="float32"))
        assert back.config == d.config, name
        a, b = d.arrays(), back.arrays()
        assert all(np.array_equal(a[k], b[k]) for k in a), name
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle"
    assert cfg["architectures"] == ["PEagleSpeculator"]
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "../target", "architectures": ["LlamaForCausalLM"]}
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert cfg["mask_token_id"] == 255
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2


def test_speculators_eagle3_defaults(tmp_path):
    """An eagle3 speculators config without norm_before_residual: vLLM reads it as true."""
    cfg = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": V,
        "transformer_layer_config": {
            k: v
            for k, v in vllm_config().items()
            if k
            in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "rms_norm_eps",
                "vocab_size",
                "max_position_embeddings",
            )
        }
        | {"model_type": "llama"},
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        },
    }
    t = {k: v for k, v in hand_tensors("layers.0").items() if k not in ("mask_hidden", "d2t", "t2d")}
    d = load_drafter(write(tmp_path / "e3", cfg, t))
    assert d.config.mode == "chain"
    assert d.config.norm_before_residual
    assert d.config.k_train == 3
    # an EAGLE-3 head that shares the target's embeddings
    del t["embed_tokens.weight"]
    write(tmp_path / "e3-noembed", cfg, t)
    with pytest.raises(DrafterIOError, match="target="):
        load_drafter(tmp_path / "e3-noembed")

    emb = np.random.default_rng(5).standard_normal((V, H)).astype(np.float32)
    target = SimpleNamespace(embedding_arrays=lambda: (emb, emb))  # what load_drafter uses of a Target
    d = load_drafter(tmp_path / "e3-noembed", target=target)
    np.testing.assert_array_equal(np.asarray(d.model.embed_tokens.embedding[...]), emb)


# ---------------------------------------------------------------------------------------
def _bad(tmp_path, *, config=None, drop=(), change=None, name="bad"):
    t = hand_tensors(vd=20)
    for k in drop:
        del t[k]
    if change:
        t.update(change)
    return write(tmp_path / name, config or vllm_config(vd=20), t)


def test_error_missing_key(tmp_path):
    f = _bad(tmp_path, drop=["layers.1.mlp.up_proj.weight"])
    with pytest.raises(DrafterIOError, match=r"model\.safetensors.*missing tensor 'layers\.1\.mlp\.up_proj\.weight'"):
        load_drafter(f)


def test_error_wrong_shape(tmp_path):
    f = _bad(tmp_path, change={"fc.weight": np.zeros((H, 3 * H + 1), np.float32)})
    msg = r"model\.safetensors: tensor 'fc\.weight' has shape \[32, 97\], expected \[32, 96\]"
    with pytest.raises(DrafterIOError, match=msg):
        load_drafter(f)


def test_error_missing_mask_hidden(tmp_path):
    f = _bad(tmp_path, drop=["mask_hidden"])
    with pytest.raises(DrafterIOError, match=r"model\.safetensors: missing tensor 'mask_hidden'.*parallel"):
        load_drafter(f)


def test_error_missing_embed_tokens(tmp_path):
    f = _bad(tmp_path, drop=["embed_tokens.weight"])
    msg = r"model\.safetensors: missing tensor 'embed_tokens\.weight'.*mask-token row"
    with pytest.raises(DrafterIOError, match=msg):
        load_drafter(f)


def test_error_unknown_architecture(tmp_path):
    f = _bad(tmp_path, config=vllm_config(vd=20, architectures=["LlamaForCausalLM"]))
    with pytest.raises(ConfigError, match=r"config\.json: key 'architectures' is \['LlamaForCausalLM'\]"):
        load_drafter(f)
    f = _bad(tmp_path, config={"speculators_model_type": "medusa"}, name="spec")
    with pytest.raises(ConfigError, match=r"config\.json: key 'speculators_model_type' is 'medusa'"):
        load_drafter(f)


def test_error_truncated_safetensors(tmp_path):
    f = _bad(tmp_path)
    data = (f / "model.safetensors").read_bytes()
    (f / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DrafterIOError, match=r"model\.safetensors: unreadable safetensors file"):
        load_drafter(f)


def test_error_other_bad_input(tmp_path):
    f = _bad(tmp_path, change={"extra.weight": np.zeros(3, np.float32)}, name="extra")
    with pytest.raises(DrafterIOError, match="unexpected tensor 'extra.weight'"):
        load_drafter(f)
    t2d = np.zeros(V, bool)
    t2d[:20] = True
    f = _bad(tmp_path, change={"t2d": t2d}, name="t2d")
    with pytest.raises(DrafterIOError, match="'t2d' does not match 'd2t'"):
        load_drafter(f)
    f = _bad(tmp_path, change={"d2t": np.zeros(20, np.float32)}, name="d2t")
    with pytest.raises(DrafterIOError, match="'d2t' has dtype float32"):
        load_drafter(f)
    f = _bad(tmp_path, change={"layers.0.input_layernorm.weight": np.ones(H, np.float32)}, name="both")
    with pytest.raises(DrafterIOError, match="both 'midlayer"):
        load_drafter(f)
    cfg = vllm_config(vd=20)
    del cfg["hidden_size"]
    with pytest.raises(ConfigError, match=r"config\.json: missing key 'hidden_size'"):
        load_drafter(_bad(tmp_path, config=cfg, name="nohidden"))
    spec = {"speculators_model_type": "peagle", "transformer_layer_config": {"model_type": "llama"}}
    with pytest.raises(ConfigError, match="missing key 'hidden_size'"):
        load_drafter(_bad(tmp_path, config=spec, name="spec1"))
    spec["transformer_layer_config"] = json.loads(json.dumps(vllm_config()))
    with pytest.raises(ConfigError, match="missing key 'mask_token_id'"):
        load_drafter(_bad(tmp_path, config=spec, name="spec2"))
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------
# the import keeps the file's dtype; the shared tensor check; full-vocabulary exports
def test_import_keeps_the_file_dtype(tmp_path):
    """A bf16 file stays bf16 in host memory (a released head is 3.6 GB in bf16, twice that in f32);
    the handle still defaults to float32."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    t = {k: v.astype(bf16) if v.dtype == np.float32 else v for k, v in hand_tensors(vd=20).items()}
    config, arrays, dtype = read_drafter(write(tmp_path / "bf16", vllm_config(vd=20), t))
    assert dtype == "float32"
    assert arrays[("fc", "kernel")].dtype == bf16
    assert arrays[("d2t",)].dtype == np.int32
    np.testing.assert_array_equal(arrays[("fc", "kernel")], t["fc.weight"].T)
    d = load_drafter(tmp_path / "bf16")
    assert d.dtype == np.float32
    np.testing.assert_array_equal(d.arrays()[("fc", "kernel")], t["fc.weight"].T.astype(np.float32))


def test_check_tensors_lists_every_fault(tmp_path):
    """The importer and the lint share one check; it collects every fault, the importer raises the first."""
    from peagle_jax.sources.weights import Checkpoint

    t = hand_tensors(vd=20)
    t["fc.weight"] = t["fc.weight"][:, :-1].copy()
    t["norm.weight"] = t["norm.weight"].astype(np.int32)
    t["mask_hidden"] = t["mask_hidden"].reshape(3 * H)
    del t["layers.1.mlp.up_proj.weight"]
    t["extra.weight"] = np.zeros(2, np.float32)
    folder = write(tmp_path / "bad", vllm_config(vd=20), t)
    chk = check_tensors(Checkpoint(folder), read_vllm_config(vllm_config(vd=20), "config.json"))
    assert chk.layer0 == "midlayer."
    assert chk.extra == ["extra.weight"]
    assert chk.reshaped == ["mask_hidden"]
    assert list(chk.missing) == ["layers.1.mlp.up_proj.weight"]
    assert len(chk.errors) == 2
    assert "'fc.weight' has shape" in chk.errors[0]
    assert "I32" in chk.errors[1]
    with pytest.raises(DrafterIOError, match="'fc.weight' has shape"):
        load_drafter(folder)


def small_head(vd: int):
    """(config, arrays) of a random head of this file's shapes; draft vocabulary: every other id."""
    from peagle_jax.models.eagle import init_arrays

    config = read_vllm_config(vllm_config(vd=vd), "config.json")
    used = np.arange(V) if vd == V else np.arange(0, 2 * vd, 2)
    return config, init_arrays(config, 0, {("d2t",): (used - np.arange(vd)).astype(np.int32)})


def test_full_vocabulary_exports_carry_no_id_map():
    """vLLM 0.33 refuses d2t in a full-vocabulary head (it creates no draft_id_to_target_id)."""
    config, arrays = small_head(V)
    assert not {"d2t", "t2d"} & set(vllm_tensors(config, arrays))
    assert not {"d2t", "t2d"} & set(checkpoint_tensors(config, arrays))
    assert {"d2t", "t2d"} <= set(vllm_tensors(*small_head(20)))
    arrays[("d2t",)] = (np.roll(np.arange(V), 1) - np.arange(V)).astype(np.int32)  # a permutation: no identity
    with pytest.raises(DrafterIOError, match="non-zero d2t"):
        checkpoint_tensors(config, arrays)


def test_speculators_aux_ids_default_to_the_verifiers(tmp_path):
    """A speculators head without aux ids takes its verifier's defaults, as speculators and vLLM do."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target/config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 12,
                "hidden_size": H,
                "vocab_size": V,
                "max_position_embeddings": 256,
            }
        )
    )
    cfg = json.loads((GOLDEN / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg["speculators_config"]["verifier"]["name_or_path"] = "../target"
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").symlink_to(GOLDEN / "model.safetensors")
    config, _, _ = read_drafter(folder)
    assert config.aux_layer_ids == (2, 6, 9)
    cfg["speculators_config"]["verifier"]["name_or_path"] = "org/elsewhere"
    (folder / "config.json").write_text(json.dumps(cfg))
    assert read_drafter(folder)[0].aux_layer_ids is None


def test_a_heads_shapes_are_traced_once_and_each_caller_fills_its_own(monkeypatch):
    """abstract_drafter traces the network once per config and dtype (loading, saving and
    checking a head each ask for its shapes); a state one caller fills leaves the next one's as
    shapes, and another dtype is traced apart."""
    import jax
    from head_folders import random_drafter

    from peagle_jax.models import eagle
    from peagle_jax.models.abstract import traced_network
    from peagle_jax.models.eagle import abstract_drafter, flat_state

    config = random_drafter().config
    traced_network.cache_clear()
    built = []
    real = eagle.DrafterModel.__init__
    monkeypatch.setattr(eagle.DrafterModel, "__init__", lambda self, *a, **k: (built.append(1), real(self, *a, **k)))
    _, first = abstract_drafter(config)
    path, var = next((p, v) for p, v in flat_state(first).items() if v.dtype == jnp.float32)
    var.value = jnp.zeros(var.shape, var.dtype)  # filled in place, as a loader may
    graphdef, second = abstract_drafter(config)
    assert built == [1]
    assert isinstance(flat_state(second)[path].value, jax.ShapeDtypeStruct)
    assert flat_state(second)[path].shape == var.shape and graphdef == abstract_drafter(config)[0]
    _, bf16 = abstract_drafter(config, "bfloat16")
    assert built == [1, 1] and flat_state(bf16)[path].dtype == jnp.bfloat16
