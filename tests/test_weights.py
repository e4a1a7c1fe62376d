"""Weights I/O: key maps, sharded checkpoints, export -> transformers reload, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import hf_tiny
import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import peagle_jax as pj
from peagle_jax.config.target_config import ConfigError, TargetConfig
from peagle_jax.models.registry import FAMILIES, key_map, target_config
from peagle_jax.sources.weights import WeightsError, abstract_model, load_params

torch = pytest.importorskip("torch")
AUX = (0, 1, 2)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _leaves(state):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state)}


def test_key_maps_cover_every_family():
    for family in FAMILIES:
        for tied in (True, False):
            cfg = TargetConfig(
                model_type=family,
                vocab_size=8,
                hidden_size=8,
                intermediate_size=8,
                num_layers=2,
                num_heads=2,
                num_kv_heads=1,
                head_dim=4,
                tie_word_embeddings=tied,
                qk_norm=family != "llama",
                sandwich_norms=family == "gemma3",
                norm_offset=1.0 if family == "gemma3" else 0.0,
                attention_bias=True,
                mlp_bias=True,
            )
            _, state = abstract_model(cfg)
            ours = {tuple(p) for p, _ in nnx.to_flat_state(state)}
            rows = key_map(cfg)
            assert {r[1] for r in rows} == ours
            assert len({r[0] for r in rows}) == len(rows)
            assert ("lm_head.weight" in {r[0] for r in rows}) == (not tied)


@pytest.mark.parametrize(
    "kind", ["llama-gqa2-tied-llama3", "llama-gqa4-untied-linear", "llama-bias", "qwen3", "gemma3"]
)
def test_export_reload_in_transformers(kind, built, tmp_path):
    """load -> export -> transformers from_pretrained: logits within 1e-5 of the original."""
    from transformers import AutoModelForCausalLM

    folder, hf = built(kind)
    target = pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)
    out = target.save(tmp_path / "export")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "generation_config.json"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    ids = hf_tiny.tokens(2, 10, seed=4)
    want, _ = hf_tiny.hf_run(hf, ids)
    got, _ = hf_tiny.hf_run(reloaded, ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # and back into JAX: the same parameters bit for bit
    again = pj.load_target(out, dtype="float32", aux_layer_ids=AUX)
    assert again.config == target.config
    a, b = _leaves(target.state), _leaves(again.state)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_export_refuses_existing_folder(built, tmp_path):
    folder, _ = built("llama-mha-untied")
    target = pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)
    dest = tmp_path / "out"
    target.save(dest)
    with pytest.raises(FileExistsError, match="out"):
        target.save(dest)
    target.save(dest, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_bf16_export_and_load(built, tmp_path):
    folder, _ = built("qwen3")
    target = pj.load_target(folder, dtype="bfloat16", aux_layer_ids=AUX)
    out = target.save(tmp_path / "bf16")
    tensors = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    f32 = pj.load_target(out, dtype="float32", aux_layer_ids=AUX)  # bf16 file -> f32 params, exact
    a, b = _leaves(target.state), _leaves(f32.state)
    assert all(b[k].dtype == np.float32 and np.array_equal(a[k].astype(np.float32), b[k]) for k in a)


def test_sharded_checkpoint(built, tmp_path):
    folder, hf = built("gemma3")
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="30KB")
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) >= 2
    cfg = target_config(folder)
    _, one = load_params(folder, cfg)
    _, many = load_params(tmp_path / "sharded", cfg)
    a, b = _leaves(one), _leaves(many)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)

    # a shard named in the index but missing on disk
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "sharded" / shard).unlink()
    with pytest.raises(WeightsError, match=shard):
        load_params(tmp_path / "sharded", cfg)


def test_ignored_buffers_and_duplicated_tied_head(built, tmp_path):
    folder, _ = built("llama-gqa2-tied-llama3")
    cfg = target_config(folder)
    f = _copy(folder, tmp_path / "extra")

    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()

    _rewrite(f, add)
    load_params(f, cfg)  # accepted

    def differ(t):
        t["lm_head.weight"] = t["lm_head.weight"] + 1

    _rewrite(f, differ)
    with pytest.raises(WeightsError, match=r"model\.safetensors.*'lm_head\.weight'.*tie_word_embeddings"):
        load_params(f, cfg)


def _missing(t):
    del t["model.layers.1.mlp.up_proj.weight"]


def _misshapen(t):
    t["model.layers.1.self_attn.k_proj.weight"] = np.zeros((3, 64), np.float32)


def _extra(t):
    t["model.layers.0.self_attn.mystery.weight"] = np.zeros(4, np.float32)


def _int_tensor(t):
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (_missing, r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
        (
            _misshapen,
            r"model\.safetensors: tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' "
            r"has shape \[3, 64\], expected \[32, 64\]",
        ),
        (_extra, r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn\.mystery\.weight'"),
        (_int_tensor, r"model\.safetensors: tensor 'model\.norm\.weight' has dtype I32"),
    ],
)
def test_bad_tensors(edit, pattern, built, tmp_path):
    folder, _ = built("llama-gqa2-tied-llama3")
    f = _copy(folder, tmp_path / "bad")
    _rewrite(f, edit)
    with pytest.raises(WeightsError, match=pattern):
        pj.load_target(f, dtype="float32", aux_layer_ids=AUX)


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda c: c.update(model_type="mistral"), r"config\.json: unknown model_type 'mistral'"),
        (
            lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}),
            r"config\.json key 'rope_parameters': unsupported rope type 'longrope'",
        ),
        (lambda c: c.pop("hidden_size"), r"config\.json: missing key 'hidden_size'"),
    ],
)
def test_bad_config(edit, pattern, built, tmp_path):
    folder, _ = built("llama-gqa2-tied-llama3")
    f = _copy(folder, tmp_path / "bad")
    hf_tiny.edit_config(f, edit)
    with pytest.raises(ConfigError, match=pattern):
        pj.load_target(f, dtype="float32", aux_layer_ids=AUX)


def test_bad_folders(built, tmp_path):
    with pytest.raises(WeightsError, match="nowhere: no such folder"):
        pj.load_target(tmp_path / "nowhere")
    folder, _ = built("llama-gqa2-tied-llama3")
    f = _copy(folder, tmp_path / "f")
    (f / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: unreadable config"):
        pj.load_target(f)
    (f / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config\.json: no such file"):
        pj.load_target(f)
    shutil.copy(folder / "config.json", f / "config.json")
    (f / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(WeightsError, match=r"model\.safetensors: unreadable safetensors"):
        pj.load_target(f, aux_layer_ids=AUX)
    (f / "model.safetensors").unlink()
    (f / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightsError, match=r"neither model\.safetensors.*pytorch_model\.bin"):
        pj.load_target(f, aux_layer_ids=AUX)
    with pytest.raises(ValueError, match="dtype"):
        pj.load_target(folder, dtype="float16", aux_layer_ids=AUX)


def test_load_does_not_initialise_randomly(built, monkeypatch):
    """The Decoder is only ever constructed abstractly (under nnx.eval_shape) at load."""
    from peagle_jax.models import decoder
    from peagle_jax.models.abstract import traced_network

    folder, _ = built("gemma3")
    traced_network.cache_clear()  # an earlier load of the same config would have traced it already
    seen = []
    real = decoder.Decoder.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        seen.append(type(self.embed_tokens.embedding[...]).__name__.endswith("Tracer"))  # abstract values

    monkeypatch.setattr(decoder.Decoder, "__init__", spy)
    target = pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)
    assert seen == [True]
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(target.state))
