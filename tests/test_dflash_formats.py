"""DFlash heads in the two checkpoint formats (peagle_jax.formats.checkpoints, head_config_dflash): bit-exact
round trips (vLLM native / z-lab and speculators; full and draft vocabulary; float32 and bf16),
the aux-id offset (z-lab target_layer_ids = ours - 1), a checkpoint written by speculators' own
DFlashDraftModel.save_pretrained importing with the same logits, speculators loading our export,
the lint's DFlash rules, the serve command and one-line errors for bad configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.target_config import ConfigError, RopeConfig
from peagle_jax.formats import (
    DrafterIOError,
    detect_format,
    export_speculators,
    export_vllm,
    format_report,
    inspect_folder,
    read_drafter,
    serve_command,
)
from peagle_jax.handles.drafter import Drafter, load_drafter

V, H, VD = 64, 32, 40
AUX = (2, 5, 7)


def dflash_config(vd: int = V, aux=AUX, block: int = 4, layers: int = 2) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=H,
        target_hidden_size=H,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=V,
        draft_vocab_size=vd,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=128,
        mode="dflash",
        mask_token_id=V - 2,
        aux_layer_ids=aux,
        qk_norm=True,
        block_size=block,
    )


def head(vd: int = V, **kw) -> Drafter:
    ids = None if vd == V else np.sort(np.random.default_rng(3).choice(V, vd, replace=False))
    return Drafter.random(dflash_config(vd, **kw), seed=1, draft_ids=ids)


def target_of(drafter: Drafter):
    """The target weights a DFlash head was built on: (embedding, lm_head [V, H]); a draft
    vocabulary's rows outside it are random."""
    a = drafter.arrays()
    full = np.random.default_rng(5).standard_normal((V, H)).astype(np.float32)
    full[np.arange(drafter.config.draft_vocab_size) + drafter.d2t] = a[("lm_head", "kernel")].T
    return lambda: (a[("embed_tokens", "embedding")], full)


EXPORTS = {"vllm": export_vllm, "speculators": export_speculators}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vd", [V, VD])
@pytest.mark.parametrize("fmt", list(EXPORTS))
def test_round_trip_bit_exact(fmt, vd, dtype, tmp_path):
    d = head(vd)
    EXPORTS[fmt](d, tmp_path / "h", dtype)
    assert detect_format(tmp_path / "h") == fmt
    keys = set(load_file(tmp_path / "h" / "model.safetensors"))
    shared = set()  # what speculators leaves to the target: embed_tokens always, a full-vocab lm_head
    if fmt == "speculators":
        shared = {"embed_tokens.weight"} | ({"lm_head.weight"} if vd == V else set())
    assert not shared & keys and len(keys) > 10
    assert ({"d2t", "t2d"} <= keys) == (vd < V) and ("d2t" in keys) == (vd < V)
    cfg, got, _ = read_drafter(tmp_path / "h", target_weights=target_of(d))
    assert cfg == d.config
    want = d.arrays()
    assert set(got) == set(want)
    for path, arr in want.items():
        key = "embed_tokens.weight" if path[0] == "embed_tokens" else "lm_head.weight" if path[0] == "lm_head" else ""
        expect = arr if arr.dtype.kind == "i" or key in shared or dtype == "float32" else arr.astype(ml_dtypes.bfloat16)
        assert got[path].dtype == expect.dtype, path
        assert np.array_equal(got[path], expect), path


def test_aux_id_offset_both_ways(tmp_path):
    d = head()
    export_vllm(d, tmp_path / "v", "float32")
    raw = json.loads((tmp_path / "v" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 4
    assert raw["dflash_config"] == {"mask_token_id": V - 2, "target_layer_ids": [i - 1 for i in AUX], "causal": False}
    assert raw["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    # a z-lab config: no eagle ids, block_size inside dflash_config -> ours = target_layer_ids + 1
    del raw["eagle_aux_hidden_state_layer_ids"], raw["block_size"]
    raw["dflash_config"]["block_size"] = 4
    (tmp_path / "v" / "config.json").write_text(json.dumps(raw))
    cfg, _, _ = read_drafter(tmp_path / "v")
    assert cfg.aux_layer_ids == AUX and cfg.block_size == 4
    export_speculators(d, tmp_path / "s", "float32")
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    assert spec["aux_hidden_state_layer_ids"] == list(AUX) and spec["speculators_model_type"] == "dflash"
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["architectures"] == ["DFlashSpeculator"] and spec["transformer_layer_config"]["model_type"] == "qwen3"


def test_aux_id_zero_has_no_zlab_form(tmp_path):
    with pytest.raises(ConfigError, match="aux layer id 0"):
        export_vllm(head(aux=(0, 3)), tmp_path / "v")


def test_missing_target_tensors_need_the_target(tmp_path):
    export_speculators(head(), tmp_path / "s", "float32")
    with pytest.raises(DrafterIOError) as err:
        read_drafter(tmp_path / "s")
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path / "s") in msg and "'embed_tokens.weight'" in msg and "target" in msg


def test_load_drafter_takes_target_embeddings(tmp_path):
    """A draft-vocabulary speculators head ships its lm_head: load_drafter's target embeddings fill
    the rest."""
    d = head(VD)
    export_speculators(d, tmp_path / "s", "float32")
    emb = d.arrays()[("embed_tokens", "embedding")]
    target = SimpleNamespace(embedding_arrays=lambda scaled=True: (emb, None))
    loaded = load_drafter(tmp_path / "s", target=target)
    assert loaded.config == d.config
    for path, arr in d.arrays().items():
        assert np.array_equal(loaded.arrays()[path], arr), path


def _set_config(folder: Path, edit) -> Path:
    raw = json.loads((folder / "config.json").read_text())
    edit(raw)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


BAD_SPECULATORS = {
    "block_size 1": (lambda r: r.update(block_size=1), "key 'block_size' must be an int >= 2"),
    "no block_size": (lambda r: r.pop("block_size"), "missing key 'block_size'"),
    "no mask id": (lambda r: r.pop("mask_token_id"), "missing key 'mask_token_id'"),
    "mask id outside": (lambda r: r.update(mask_token_id=V), "mask_token_id must be a token id"),
    "no aux ids": (lambda r: r.pop("aux_hidden_state_layer_ids"), "missing key 'aux_hidden_state_layer_ids'"),
    "aux ids repeat": (lambda r: r.update(aux_hidden_state_layer_ids=[2, 2, 7]), "aux_hidden_state_layer_ids"),
    "hidden != target": (lambda r: r.update(target_hidden_size=2 * H), "key 'target_hidden_size' is 64"),
    "sample_from_anchor": (lambda r: r.update(sample_from_anchor=True), "key 'sample_from_anchor' is true"),
    "causality not bool": (
        lambda r: r.update(sliding_window_non_causal=None),
        "key 'sliding_window_non_causal' must be true or false, got None",
    ),
}
BAD_VLLM = {
    "no target_layer_ids": (
        lambda r: (r.pop("eagle_aux_hidden_state_layer_ids"), r["dflash_config"].pop("target_layer_ids")),
        "missing key 'dflash_config.target_layer_ids'",
    ),
    "ids disagree": (
        lambda r: r["dflash_config"].update(target_layer_ids=list(AUX)),
        "is not 'dflash_config.target_layer_ids'",
    ),
    "no mask id": (lambda r: r["dflash_config"].pop("mask_token_id"), "missing key 'dflash_config.mask_token_id'"),
    "block sizes disagree": (lambda r: r["dflash_config"].update(block_size=8), "the block size keys disagree"),
    "causal not bool": (
        lambda r: r["dflash_config"].update(causal="no"),
        "key 'dflash_config.causal' must be true or false, got 'no'",
    ),
}


@pytest.mark.parametrize("fmt, case", [("speculators", c) for c in BAD_SPECULATORS] + [("vllm", c) for c in BAD_VLLM])
def test_bad_configs_one_line_errors(fmt, case, tmp_path):
    edit, text = (BAD_SPECULATORS if fmt == "speculators" else BAD_VLLM)[case]
    d = head()
    folder = _set_config(EXPORTS[fmt](d, tmp_path / "h", "float32"), edit)
    with pytest.raises(ConfigError) as err:
        read_drafter(folder, target_weights=target_of(d))
    msg = str(err.value)
    assert "\n" not in msg and str(folder / "config.json") in msg and text in msg, msg


@pytest.mark.parametrize("vd", [V, VD])
@pytest.mark.parametrize("fmt", list(EXPORTS))
def test_exports_pass_inspect(fmt, vd, tmp_path):
    folder = EXPORTS[fmt](head(vd), tmp_path / "h")
    report = inspect_folder(folder)
    assert report["problems"] == [], report["problems"]
    assert report["mode"] == "dflash" and report["block_size"] == 4 and report["aux_layer_ids"] == list(AUX)
    assert json.loads(report["serve"].split("'")[1]) == {
        "method": "dflash",
        "model": str(folder),
        "num_speculative_tokens": 3,
    }
    assert "4 (3 drafts per pass)" in format_report(report)


def _drop_tensor(folder: Path, key: str) -> None:
    tensors = load_file(folder / "model.safetensors")
    del tensors[key]
    save_file(tensors, folder / "model.safetensors")


def _four_context_layers(raw: dict) -> None:
    if "dflash_config" in raw:
        raw["dflash_config"]["target_layer_ids"] = [1, 4, 6, 8]
        raw["eagle_aux_hidden_state_layer_ids"] = [2, 5, 7, 9]
    else:
        raw["aux_hidden_state_layer_ids"] = [2, 5, 7, 9]


@pytest.mark.parametrize("fmt", list(EXPORTS))
def test_inspect_flags_broken_heads(fmt, tmp_path):
    folder = EXPORTS[fmt](head(VD), tmp_path / "h")
    _drop_tensor(folder, "layers.1.mlp.up_proj.weight")
    assert any("'layers.1.mlp.up_proj.weight'" in p for p in inspect_folder(folder)["problems"])
    shutil.rmtree(folder)
    folder = EXPORTS[fmt](head(VD), tmp_path / "h")
    _set_config(folder, _four_context_layers)  # fc would read 4 * Ht
    problems = inspect_folder(folder)["problems"]
    assert any("'fc.weight'" in p and f"[{H}, {4 * H}]" in p for p in problems), problems
    _set_config(folder, lambda r: r.update(block_size=1))
    assert any("block_size 1" in p for p in inspect_folder(folder)["problems"])


def test_inspect_checks_aux_ids_against_the_target(tmp_path):
    folder = export_vllm(head(), tmp_path / "h")
    (tmp_path / "t").mkdir()
    target = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 6}
    target.update(hidden_size=H, vocab_size=V, max_position_embeddings=128)
    (tmp_path / "t" / "config.json").write_text(json.dumps(target))
    problems = inspect_folder(folder, target=tmp_path / "t")["problems"]
    assert any("outside the target's 6 layers" in p for p in problems), problems


def test_serve_command_dflash():
    cmd = serve_command("/h", "dflash", 15, "qwen3", "Qwen/Qwen3-8B")
    assert json.loads(cmd.split("'")[1]) == {"method": "dflash", "model": "/h", "num_speculative_tokens": 15}


# ---------------------------------------------------------------------------------------
# against speculators' own DFlashDraftModel
SPEC_CASES = ["tiny", "tiny-Vd<V"]


def _parity():
    pytest.importorskip("torch")
    pytest.importorskip("speculators", exc_type=ImportError)
    import test_dflash_parity

    return test_dflash_parity


@pytest.mark.speculators
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("case", SPEC_CASES)
def test_speculators_checkpoint_imports_with_same_logits(case, tmp_path, monkeypatch):
    par = _parity()
    c = par.CASES[case]
    model = par.speculators_model(c)
    model.save_pretrained(str(tmp_path / "spec"))
    sd = {k: t.detach().numpy() for k, t in model.state_dict().items()}
    verifier = (sd["embed_tokens.weight"], sd["lm_head.weight"] if c["vd"] == c["vocab"] else None)
    cfg, arrays, _ = read_drafter(tmp_path / "spec", target_weights=lambda: verifier)
    problems = inspect_folder(tmp_path / "spec")["problems"]  # speculators saves the vLLM trap
    assert [p.split(":")[0] for p in problems] == ["sliding_window_non_causal false"], problems
    assert cfg.aux_layer_ids == tuple(range(1, c["aux"] + 1)) and cfg.block_size == c["block"]
    drafter = Drafter.from_arrays(cfg, arrays)
    aux, ids = par.inputs(c)
    want = par.speculators_logits(model, c, aux, ids, monkeypatch)
    got = par.our_logits(drafter, aux, ids)
    assert got.shape == want.shape
    assert np.abs(got - want).max() / np.abs(want).max() < par.TOL
    drafts = np.arange(c["block"]) % c["block"] != 0  # slot 0 is the bonus token
    rows = np.tile(drafts, len(par.ANCHORS))
    assert np.array_equal(got[rows].argmax(-1), want[rows].argmax(-1))


@pytest.mark.speculators
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("case", SPEC_CASES)
def test_speculators_loads_our_export(case, tmp_path):
    par = _parity()
    from speculators.models.dflash.config import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel

    c = par.CASES[case]
    ours = par.our_drafter(c, par.speculators_model(c, seed=4))
    folder = export_speculators(ours, tmp_path / "s", "float32")
    raw = json.loads((folder / "config.json").read_text())
    raw["transformer_layer_config"]["_attn_implementation"] = "eager"
    theirs = DFlashDraftModel(DFlashSpeculatorConfig(**raw))
    tensors = {k: par.torch.as_tensor(v) for k, v in load_file(folder / "model.safetensors").items()}
    missing, unexpected = theirs.load_state_dict(tensors, strict=False)
    expected = {"verifier_lm_head.weight", "verifier_norm.weight", "embed_tokens.weight"}
    if c["vd"] == c["vocab"]:
        expected.add("lm_head.weight")
    assert unexpected == [] and set(missing) == expected
    state = theirs.state_dict()
    assert np.array_equal(state["fc.weight"].numpy(), ours.arrays()[("fc", "kernel")].T)
    assert np.array_equal(
        state["layers.0.self_attn.k_norm.weight"].numpy(), ours.arrays()[("layers", 0, "self_attn", "k_norm", "weight")]
    )


def test_inspect_own_dflash_checkpoint(tmp_path):
    folder = head().save(tmp_path / "own")
    report = inspect_folder(folder)
    assert report["problems"] == [] and report["mode"] == "dflash" and report["block_size"] == 4
