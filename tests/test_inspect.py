"""The checkpoint lint (`peagle-convert inspect`, `peagle_jax.formats.inspect`): one test per problem it
reports, the facts it shares with the importer, and the vLLM serve command. Tiny shapes, CPU only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from head_folders import (
    BF16,
    MASK_KEYS,
    H,
    V,
    hand_tensors,
    one_error_line,
    random_drafter,
    run,
    speculators_cfg,
    vllm_config,
    write_folder,
    write_target_config,
)
from safetensors.numpy import load_file, save_file

from peagle_jax.formats import SERVE_K, inspect_folder, serve_command, serve_k
from peagle_jax.formats.checkpoints import checkpoint_key, export_speculators, export_vllm, key_map
from peagle_jax.handles.drafter import Drafter, load_drafter


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """(folder, drafter): a 2-layer P-EAGLE head, draft vocab 40 of 64, saved as our checkpoint."""
    d = random_drafter()
    folder = tmp_path_factory.mktemp("own") / "ckpt"
    d.save(folder)
    return folder, d


def inspect_json(capsys, folder, *extra):
    rc, out, err = run(capsys, "inspect", folder, "--json", "--vllm-version", "0.33", *extra)
    assert err == "", err
    return rc, json.loads(out)


def problems_of(capsys, folder, *extra) -> str:
    rc, report = inspect_json(capsys, folder, *extra)
    assert rc == 1
    assert report["problems"]
    rc_text, text, _ = run(capsys, "inspect", folder, "--vllm-version", "0.33", *extra)
    assert rc_text == 1
    assert "problem(s)" in text
    return " | ".join(report["problems"])


def test_inspect_clean_folder_reports_what_it_is(tmp_path, capsys):
    src = write_folder(tmp_path / "h", vllm_config(vd=40, peagle_jax={"k_train": 10}), hand_tensors(vd=40))
    rc, r = inspect_json(capsys, src)
    assert rc == 0
    assert r["problems"] == []
    assert r["warnings"] == []
    assert (r["format"], r["mode"], r["num_layers"], r["vocab_size"], r["draft_vocab_size"]) == (
        "vllm",
        "parallel",
        2,
        V,
        40,
    )
    assert r["mask_token_id"] == V - 3
    assert r["mask_token_keys"] == sorted(MASK_KEYS)
    assert r["aux_layer_ids"] == [1, 3, 5]
    assert r["k_hints"] == {"k_train": 10}
    assert r["layer0_prefix"] == "midlayer."
    rc, text, _ = run(capsys, "inspect", src, "--vllm-version", "0.33")
    assert rc == 0
    assert "OK: no problems" in text
    assert "num_speculative_tokens <= 10" in text


def test_inspect_missing_mask_hidden(tmp_path, capsys):
    src = write_folder(tmp_path / "h", vllm_config(), hand_tensors(mask_hidden=False))
    assert "missing tensor 'mask_hidden'" in problems_of(capsys, src)
    rc, _, err = run(capsys, "import", src, tmp_path / "o")  # import refuses it too
    assert rc == 1
    assert "'mask_hidden'" in one_error_line(err)


def test_inspect_missing_embed_tokens(tmp_path, capsys):
    src = write_folder(tmp_path / "h", vllm_config(), hand_tensors(embed=False))
    assert "missing tensor 'embed_tokens.weight'" in problems_of(capsys, src)


def test_inspect_hidden_differs_from_target_hidden(tmp_path, capsys):
    src = write_folder(tmp_path / "h", vllm_config(ht=24), hand_tensors(ht=24))
    p = problems_of(capsys, src)
    assert "hidden_size 32 != target_hidden_size 24" in p
    assert "shape" not in p  # the shapes themselves are fine


def test_inspect_not_three_aux_layers(tmp_path, capsys):
    src = write_folder(tmp_path / "h", vllm_config(aux=(1, 2, 4, 6)), hand_tensors(n_aux=4))
    assert "lists 4 layers" in problems_of(capsys, src)


def test_inspect_mask_id_out_of_range(tmp_path, capsys):
    src = write_folder(tmp_path / "h", vllm_config(mask_id=V + 5), hand_tensors())
    assert f"mask token id {V + 5}" in problems_of(capsys, src)


def test_inspect_max_position_below_target(tmp_path, capsys):
    src = write_folder(tmp_path / "h", vllm_config(), hand_tensors())
    tgt = write_target_config(tmp_path / "target", max_position_embeddings=4096)
    assert run(capsys, "inspect", src, "--vllm-version", "0.33")[0] == 0  # no target known: nothing to compare
    p = problems_of(capsys, src, "--target", tgt)
    assert "max_position_embeddings 64 < the target's 4096" in p


def test_inspect_max_position_below_speculators_verifier(tmp_path, capsys):
    """The target found through the speculators verifier path (relative to the folder)."""
    write_target_config(tmp_path / "target", max_position_embeddings=4096)
    src = write_folder(tmp_path / "h", speculators_cfg(verifier="../target"), hand_tensors(layer0="layers.0."))
    p = problems_of(capsys, src)
    assert "max_position_embeddings 64 < the target's 4096" in p
    _, r = inspect_json(capsys, src)
    assert r["target"]["path"] == str((tmp_path / "target").resolve())


def test_inspect_target_mismatches(tmp_path, capsys):
    src = write_folder(tmp_path / "h", vllm_config(aux=(1, 3, 9)), hand_tensors())
    tgt = write_target_config(
        tmp_path / "t", hidden_size=48, vocab_size=128, num_hidden_layers=8, max_position_embeddings=64
    )
    p = problems_of(capsys, src, "--target", tgt)
    assert "target_hidden_size 32 != the target's hidden_size 48" in p
    assert "vocab_size 64 != the target's vocab_size 128" in p
    assert "outside the target's 8 layers" in p


def test_inspect_shape_and_key_problems(tmp_path, capsys):
    t = hand_tensors(vd=40)
    t["lm_head.weight"] = t["lm_head.weight"][:30]
    t["extra.weight"] = np.zeros(3, np.float32)
    del t["layers.1.mlp.up_proj.weight"]
    src = write_folder(tmp_path / "h", vllm_config(vd=40), t)
    p = problems_of(capsys, src)
    assert "'lm_head.weight' has shape [30, 32], expected [40, 32]" in p
    assert "missing tensor 'layers.1.mlp.up_proj.weight'" in p
    assert "'extra.weight'" in p


def test_inspect_warns_on_partial_mask_keys(tmp_path, capsys):
    src = write_folder(tmp_path / "h", vllm_config(mask_keys=("mask_token_id",), aux=None), hand_tensors())
    rc, r = inspect_json(capsys, src)
    assert rc == 0
    assert any("different vLLM releases" in w for w in r["warnings"])
    assert any("falls back to (2, L//2, L-3)" in w for w in r["warnings"])


def test_inspect_own_checkpoint(own, capsys):
    src, _ = own
    rc, r = inspect_json(capsys, src)
    assert rc == 0
    assert r["format"] == "own"
    assert r["draft_vocab_size"] == 40
    assert r["k_hints"] == {"k_train": 6}


# ---------------------------------------------------------------------------------------
# non-finite weights: vLLM loads them and drafts from NaN logits
@pytest.mark.parametrize("fmt", ["vllm", "speculators-bf16"])
def test_inspect_reports_non_finite_weights(fmt, tmp_path, capsys):
    """Each tensor with NaN / Inf values is a problem naming it and the count (float32 and bf16)."""
    if fmt == "vllm":
        cfg, t = vllm_config(vd=40), hand_tensors(vd=40)
    else:
        cfg, t = speculators_cfg(vd=40), hand_tensors(vd=40, layer0="layers.0.", dtype=BF16)
    t["fc.weight"][0, :2] = np.nan
    t["norm.weight"][3] = -np.inf
    src = write_folder(tmp_path / "h", cfg, t)
    p = problems_of(capsys, src)
    assert "tensor 'fc.weight' holds 2 non-finite values (2 NaN, 0 Inf) of 3072" in p
    assert "tensor 'norm.weight' holds 1 non-finite value (0 NaN, 1 Inf) of 32" in p
    assert p.count("non-finite") == 2


def test_inspect_reports_non_finite_weights_of_our_checkpoint(tmp_path, capsys):
    """Our checkpoint's state is restored and checked too, and export refuses such a head."""
    d = random_drafter()
    arrays = d.arrays()
    arrays["fc", "kernel"] = arrays["fc", "kernel"].copy()
    arrays["fc", "kernel"][1, :3] = [np.nan, np.inf, np.nan]
    folder = Drafter.from_arrays(d.config, arrays).save(tmp_path / "ckpt", allow_non_finite=True)  # save refuses it
    p = problems_of(capsys, folder)
    assert f"{folder / 'state'}: tensor 'fc.kernel' holds 3 non-finite values (2 NaN, 1 Inf) of 3072" in p
    rc, _, err = run(capsys, "export", folder, tmp_path / "out", "--format", "vllm")
    assert rc == 1
    assert "'fc.weight' holds 3 non-finite values" in one_error_line(err)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------
# a head without aux ids: vLLM falls back to the target's default aux layers
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_missing_aux_key_is_a_warning(fmt, tmp_path, capsys):
    """A head whose config has no aux-layer key loads with aux_layer_ids=None, and vLLM then uses
    the target's defaults: inspect (and the export that runs it) must say so."""
    d = random_drafter(aux_layer_ids=None)
    d.save(tmp_path / "own")
    rc, r = inspect_json(capsys, tmp_path / "own")
    assert rc == 0
    assert any("vLLM falls back to (2, L//2, L-3)" in w for w in r["warnings"])
    rc, _, err = run(capsys, "export", tmp_path / "own", tmp_path / "x", "--format", fmt)
    assert rc == 0
    assert "warning: no eagle_aux_hidden_state_layer_ids" in err
    cfg = json.loads((tmp_path / "x/config.json").read_text())
    assert cfg.get("eagle_aux_hidden_state_layer_ids") is None
    assert "eagle_aux_hidden_state_layer_ids" not in cfg.get("eagle_config", {})
    rc, r = inspect_json(capsys, tmp_path / "x")
    assert rc == 0
    assert r["aux_layer_ids"] is None
    assert any(w.startswith("no eagle_aux_hidden_state_layer_ids: vLLM falls back") for w in r["warnings"])
    assert load_drafter(tmp_path / "x").config.aux_layer_ids is None


# ---------------------------------------------------------------------------------------
# what vLLM 0.33 refuses or silently gets wrong
def test_id_maps_in_a_full_vocabulary_head(tmp_path, capsys):
    t = hand_tensors()  # Vd == V: no d2t / t2d
    src = write_folder(tmp_path / "ok", vllm_config(), t)
    assert inspect_json(capsys, src)[0] == 0
    t.update(d2t=np.zeros(V, np.int64), t2d=np.ones(V, bool))
    p = problems_of(capsys, write_folder(tmp_path / "maps", vllm_config(), t))
    assert "['d2t', 't2d'] in a full-vocabulary head" in p
    assert "draft_id_to_target_id" in p


def fc_norm_folder(tmp_path: Path, name: str, **flags) -> Path:
    """A speculators peagle folder of an fc_norm head; `flags` set the config's fc_norm keys:
    top=..., layer=... (absent = not written)."""
    cfg = speculators_cfg()
    if "top" in flags:
        cfg["fc_norm"] = flags["top"]
    if "layer" in flags:
        cfg["transformer_layer_config"]["fc_norm"] = flags["layer"]
    t = hand_tensors(layer0="layers.0.")
    t.update({f"fc_norm.{j}.weight": np.ones(H, np.float32) for j in range(3)})
    return write_folder(tmp_path / name, cfg, t)


def test_speculators_layer_flags_only_at_the_top_level(tmp_path, capsys):
    rc, r = inspect_json(capsys, fc_norm_folder(tmp_path, "both", top=True, layer=True))
    assert rc == 0, r["problems"]
    assert inspect_json(capsys, fc_norm_folder(tmp_path, "layer", layer=True))[0] == 0
    p = problems_of(capsys, fc_norm_folder(tmp_path, "top", top=True))
    assert "'fc_norm' is true only at the top level" in p
    assert "transformer_layer_config" in p
    p = problems_of(capsys, fc_norm_folder(tmp_path, "differ", top=True, layer=False))
    assert "key 'fc_norm' is True at the top level but False in 'transformer_layer_config'" in p
    # the importer reads both places the same way
    assert load_drafter(tmp_path / "top").config.fc_norm
    assert load_drafter(tmp_path / "layer").config.fc_norm
    with pytest.raises(ValueError, match=r"config\.json: key 'fc_norm' is True at the top level but False"):
        load_drafter(tmp_path / "differ")


@pytest.mark.parametrize(
    "name, local",
    [("../target", True), ("/abs/target", True), ("./target", True), ("org/target", False), ("target", False)],
)
def test_speculators_verifier_should_be_a_hub_id(name, local, tmp_path, capsys):
    """`vllm serve SPEC_DIR` resolves the target from verifier.name_or_path: a hub id, not a path."""
    src = write_folder(tmp_path / "h", speculators_cfg(verifier=name), hand_tensors(layer0="layers.0."))
    rc, r = inspect_json(capsys, src)
    assert rc == 0
    assert any("is a local path" in w for w in r["warnings"]) == local


def test_serve_command():
    spec = {"method": "eagle3", "model": "/h", "num_speculative_tokens": 5, "parallel_drafting": True}
    assert serve_command("/h", "parallel", 5) == f"vllm serve TARGET --speculative-config '{json.dumps(spec)}'"
    assert serve_command("/h", "parallel", 5, "llama", "org/t").startswith("vllm serve org/t ")
    chain = serve_command("/h", "chain", 3, "qwen3")
    assert '"parallel_drafting"' not in chain
    assert '"num_speculative_tokens": 3' in chain
    assert serve_command("/h", "parallel", 8, "gemma3").endswith("' --model-impl transformers")
    assert (serve_k(None), serve_k(3), serve_k(10), serve_k("x")) == (SERVE_K, 3, SERVE_K, SERVE_K) == (7, 3, 7, 7)


def test_target_without_aux_capture_is_noted(tmp_path, capsys):
    src = write_folder(tmp_path / "h", vllm_config(), hand_tensors())
    llama = write_target_config(tmp_path / "llama", max_position_embeddings=64)
    gemma = write_target_config(
        tmp_path / "gemma", architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", max_position_embeddings=64
    )
    _, r = inspect_json(capsys, src, "--target", llama)
    assert not any("model-impl" in n for n in r["notes"])
    assert r["serve"].startswith(f"vllm serve {llama} ")
    rc, r = inspect_json(capsys, src, "--target", gemma)
    assert rc == 0
    assert r["target_family"] == "gemma3"
    assert any("native gemma3 model does not capture aux hidden states" in n for n in r["notes"])
    assert r["serve"].endswith(" --model-impl transformers")


def head_folders_of_every_kind(tmp_path: Path):
    """(folder, config, layer-0 prefix) of heads whose key tables hold every kind of row."""
    a = random_drafter(vd=40, attention_bias=True, fc_norm=True)
    b = random_drafter(vd=40, qk_norm=True, norm_before_fc=True, norm_output=True)
    yield export_vllm(a, tmp_path / "a", dtype="float32"), a.config, "midlayer."
    yield export_speculators(b, tmp_path / "b", dtype="float32"), b.config, "layers.0."


def test_every_tensor_of_the_config_is_required(tmp_path):
    """vLLM's EAGLE-3 loader keeps the random init of a tensor the checkpoint lacks (its check for
    unloaded weights does not run): inspect must miss none. Each key of `key_map` is dropped in turn.
    (A chain head may omit embed_tokens: vLLM then shares the target's.)"""
    for folder, cfg, layer0 in head_folders_of_every_kind(tmp_path):
        tensors = load_file(str(folder / "model.safetensors"))
        keys = {checkpoint_key(k, layer0) for k, _, _ in key_map(cfg)}
        assert set(tensors) == keys | {"t2d"}, set(tensors) ^ (keys | {"t2d"})
        assert inspect_folder(folder)["problems"] == []
        for key in sorted(keys):
            case = tmp_path / "case"
            shutil.rmtree(case, ignore_errors=True)
            shutil.copytree(folder, case)
            save_file({k: v for k, v in tensors.items() if k != key}, str(case / "model.safetensors"))
            problems = inspect_folder(case)["problems"]
            assert any(f"missing tensor {key!r}" in p for p in problems), (key, problems)
