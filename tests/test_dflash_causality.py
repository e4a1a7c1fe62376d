"""Which DFlash layers run causally inside their block (peagle_jax.formats.dflash_causality): the
table over every combination of its keys, its vLLM column against vLLM 0.33's rule restated, its
speculators column against speculators 0.9.0's own mask, the keys our exports write read through
it, and the lint on a head saved by speculators' own `DFlashDraftModel.save_pretrained`."""

from __future__ import annotations

import itertools
import json

import pytest
from test_dflash_formats import EXPORTS, head

from peagle_jax.config.target_config import ConfigError
from peagle_jax.formats import inspect_folder, read_drafter
from peagle_jax.formats.convert import main
from peagle_jax.formats.dflash_causality import (
    ABSENT,
    CAUSALITY,
    FULL,
    SLIDING,
    causality_keys,
    head_causality,
    layer_causality,
)

VALUES = (True, False, ABSENT)
COMBINATIONS = list(itertools.product(("speculators", "vllm"), (FULL, SLIDING), VALUES, VALUES))


def vllm_033(fmt: str, layer: str, swnc, causal) -> bool:
    """vLLM 0.33's rule, restated from its code: `update_dflash` (speculators translation) builds
    dflash_config anew with causal = not sliding_window_non_causal (absent: true);
    `_dflash_layer_causal` takes dflash_config.causal when set, else layer type == sliding."""
    if fmt == "speculators":
        dflash_config = {"causal": not (True if swnc is ABSENT else swnc)}
    else:
        dflash_config = {} if causal is ABSENT else {"causal": causal}
    override = dflash_config.get("causal")
    return bool(override) if override is not None else layer == SLIDING


def test_every_combination_has_one_row_and_vllm_033s_causality():
    seen = set()
    for fmt, layer, swnc, causal in COMBINATIONS:
        row = layer_causality(fmt, layer, swnc, causal)  # asserts exactly one row fits
        seen.add(row)
        assert row.vllm == vllm_033(fmt, layer, swnc, causal), (fmt, layer, swnc, causal)
        assert bool(row.why) == (row.vllm != row.meant), row  # every disagreement says why
    assert seen == set(CAUSALITY)  # no row unreachable


def test_the_trap_rows():
    """speculators' own default (false) runs full attention causally in vLLM; absent, a sliding
    layer runs bidirectionally in vLLM but causally in speculators."""
    row = layer_causality("speculators", FULL, False)
    assert row.vllm and not row.meant
    row = layer_causality("speculators", SLIDING, ABSENT)
    assert not row.vllm and row.meant


def speculators_causal(layer: str, swnc) -> bool:
    """Whether speculators 0.9.0 masks the block causally in a layer of type `layer`: its model
    built from a config with these keys, its own mask mod asked whether slot 0 sees slot 1."""
    pytest.importorskip("torch")
    pytest.importorskip("speculators", exc_type=ImportError)
    import torch
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from speculators.models.dflash.config import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel
    from transformers import Qwen3Config

    tl = Qwen3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        num_hidden_layers=2, vocab_size=64, layer_types=[FULL, layer], sliding_window=8,
        use_sliding_window=layer == SLIDING,
    )  # fmt: skip
    keys = {} if swnc is ABSENT else {"sliding_window_non_causal": swnc}
    cfg = DFlashSpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=64, block_size=4, aux_hidden_state_layer_ids=[1, 2],
        mask_token_id=62, **keys,
    )  # fmt: skip
    model = DFlashDraftModel(cfg)
    window = model.sliding_window if 1 in model.sliding_window_indices else None
    total = 8
    mod, _, _ = create_anchor_block_mask_mod(
        torch.zeros(total, dtype=torch.long), total, torch.tensor([4]), 4, window, model.sliding_window_non_causal
    )
    zero = torch.tensor(0)
    return not bool(mod(zero, zero, torch.tensor(0), torch.tensor(total + 1)))


@pytest.mark.speculators
@pytest.mark.parametrize("layer, swnc", list(itertools.product((FULL, SLIDING), VALUES)))
def test_speculators_rows_are_speculators_mask(layer, swnc):
    assert layer_causality("speculators", layer, swnc).meant == speculators_causal(layer, swnc)


PATTERNS = [(FULL, FULL), (SLIDING, SLIDING), (FULL, SLIDING)]


@pytest.mark.parametrize("fmt", ["speculators", "vllm"])
@pytest.mark.parametrize("types", PATTERNS)
def test_written_keys_run_as_meant(fmt, types):
    """The writer's keys make vLLM and the trainer agree on every layer; only a causal sliding
    layer beside a full one has no speculators form (vLLM applies one value to every layer)."""
    for sliding_causal in (True, False):
        meant = [t == SLIDING and sliding_causal for t in types]
        if fmt == "speculators" and set(types) == {FULL, SLIDING} and sliding_causal:
            with pytest.raises(ConfigError, match="export --format vllm"):
                causality_keys(fmt, types, meant)
            continue
        rows = head_causality(fmt, types, causality_keys(fmt, types, meant))
        assert [r.vllm for r in rows] == meant == [r.meant for r in rows], (types, meant)


# ---------------------------------------------------------------------------------------
# our exports and the lint
def keys_as_written(folder) -> tuple[list, dict]:
    """(layer types, causality keys) of a DFlash config.json, read straight from the file."""
    raw = json.loads((folder / "config.json").read_text())
    layer = raw.get("transformer_layer_config", raw)
    n = layer["num_hidden_layers"]
    keys = {k: raw[k] for k in ("sliding_window_non_causal",) if k in raw}
    if "causal" in raw.get("dflash_config", {}):
        keys["dflash_config.causal"] = raw["dflash_config"]["causal"]
    return layer.get("layer_types") or [FULL] * n, keys


@pytest.mark.parametrize("fmt", ["speculators", "vllm"])
def test_exports_run_bidirectionally_in_vllm(fmt, tmp_path):
    """Fails on the speculators export that wrote `sliding_window_non_causal: false`."""
    folder = EXPORTS[fmt](head(), tmp_path / "h", "float32")
    types, keys = keys_as_written(folder)
    assert types == [FULL, FULL] and keys  # both written explicitly
    rows = head_causality(fmt, types, keys)
    assert [r.vllm for r in rows] == [False, False] == [r.meant for r in rows], keys


@pytest.mark.speculators
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_inspect_flags_a_speculators_saved_head(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("speculators", exc_type=ImportError)
    import test_dflash_parity as par

    model = par.speculators_model(par.CASES["tiny"])
    model.save_pretrained(str(tmp_path / "spec"))
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert raw["sliding_window_non_causal"] is False  # speculators' default, as it saves it
    problems = inspect_folder(tmp_path / "spec")["problems"]
    assert len(problems) == 1, problems
    text = problems[0]
    assert text.startswith("sliding_window_non_causal false: vLLM (<= 0.34) runs full_attention layers [0, 1]")
    assert "causally" in text and '{"sliding_window_non_causal": true}' in text and "convert export" in text
    assert main(["inspect", str(tmp_path / "spec")]) == 1
    assert "sliding_window_non_causal false" in capsys.readouterr().out
    # the head itself reads as speculators trained it, and imports (its export is clean)
    sd = {k: t.detach().numpy() for k, t in model.state_dict().items()}
    cfg, _, _ = read_drafter(
        tmp_path / "spec", target_weights=lambda: (sd["embed_tokens.weight"], sd["lm_head.weight"])
    )
    assert cfg.layer_types == (FULL, FULL)


def test_convert_import_then_export_rewrites_the_keys(tmp_path, capsys):
    """A native head whose `dflash_config.causal: true` makes vLLM run its full-attention layers
    causally: inspect names the key and the fix; import + export writes keys vLLM runs as trained."""
    folder = EXPORTS["vllm"](head(), tmp_path / "h", "float32")
    raw = json.loads((folder / "config.json").read_text())
    raw["dflash_config"]["causal"] = True
    (folder / "config.json").write_text(json.dumps(raw))
    problems = inspect_folder(folder)["problems"]
    assert len(problems) == 1 and problems[0].startswith(
        "dflash_config.causal true: vLLM (<= 0.34) runs full_attention"
    )
    assert '{"dflash_config.causal": false}' in problems[0]
    assert main(["import", str(folder), str(tmp_path / "own")]) == 0
    for fmt in ("vllm", "speculators"):
        out = tmp_path / fmt
        assert main(["export", str(tmp_path / "own"), str(out), "--format", fmt]) == 0
        assert inspect_folder(out)["problems"] == []
        rows = head_causality(fmt, *keys_as_written(out))
        assert not any(r.vllm or r.meant for r in rows)
    raw["dflash_config"]["causal"] = "yes"
    (folder / "config.json").write_text(json.dumps(raw))
    assert (
        "causality key(s) {'dflash_config.causal': 'yes'} must be true or false" in inspect_folder(folder)["problems"]
    )
