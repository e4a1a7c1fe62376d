"""A head whose drafter.json is wrong, read by every reader (the lint, the converter, load_drafter):
one line naming the folder's file and key (`DrafterConfig.build`), and the lint never prints a
traceback, also for a config that disagrees with the state's tensors (checked from the state's
metadata before a restore, whose failure leaves orbax's threads printing tracebacks)."""

from __future__ import annotations

import json
import shutil

import pytest
from head_folders import random_drafter, run

from peagle_jax.config.target_config import ConfigError
from peagle_jax.handles.drafter import load_drafter

CASES = {  # name: (the edit of drafter.json's config, what the line says after "drafter.json key 'config': ")
    "mode": ({"mode": "bogus"}, "mode must be one of ('parallel', 'chain', 'dflash'), got 'bogus'"),
    "window": (
        {"sliding_window": -4, "layer_types": ["sliding_attention", "full_attention"]},
        "sliding_window must be an int >= 1, got -4",
    ),
    "layer_types": ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_hidden_layers 2"),
    "unknown key": ({"heads": 4}, "unknown keys ['heads']"),
}


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("config_errors")
    random_drafter().save(root / "good")
    for name, (edit, _) in {**CASES, "shapes": ({"intermediate_size": 24}, None)}.items():
        shutil.copytree(root / "good", root / name)
        meta = json.loads((root / name / "drafter.json").read_text())
        meta["config"].update(edit)
        (root / name / "drafter.json").write_text(json.dumps(meta))
    return root


@pytest.mark.parametrize("name", list(CASES))
def test_every_reader_names_the_file_and_key(heads, tmp_path, capsys, name):
    where = f"{heads / name / 'drafter.json'} key 'config': {CASES[name][1]}"
    with pytest.raises(ConfigError) as err:
        load_drafter(heads / name)
    assert str(err.value) == where
    for argv, code in (
        (["inspect", heads / name, "--vllm-version", "0.33"], 2),
        (["export", heads / name, tmp_path / "x", "--format", "vllm"], 1),
    ):
        rc, out, stderr = run(capsys, *argv)
        assert rc == code and out == "", (argv, out)
        assert stderr == f"error: {where}\n", (argv, stderr)
    assert not (tmp_path / "x").exists()


def test_a_config_that_disagrees_with_its_state_is_a_finding_without_a_traceback(heads, capsys):
    rc, out, err = run(capsys, "inspect", heads / "shapes", "--vllm-version", "0.33")
    assert rc == 1 and err == "", err
    state, cfg = heads / "shapes" / "state", heads / "shapes" / "drafter.json"
    want = f"  - {state}: tensor 'layers.0.mlp.down_proj.kernel' is stored as [48, 32], but {cfg} key 'config' makes it"
    assert want in out, out
    with pytest.raises(ValueError, match="the config and the state disagree"):
        load_drafter(heads / "shapes")
