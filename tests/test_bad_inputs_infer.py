"""Bad input to `python -m infer`, `python -m peagle_jax.convert import` and the Python API
(issue 42): one clear `error:` line naming the flag, file, key or argument, the exit status of
the project's standard (2: a value judged before any work, before anything loads; 1: the work
failed), nothing half-written left behind; the API raises ValueError / TypeError naming the
argument. The command lines run their main in the test process (`in_process`) on a tiny target
and head folders built once."""

from __future__ import annotations

import json
from pathlib import Path

import hf_tiny
import numpy as np
import pytest
from head_folders import hand_tensors, vllm_config, write_folder
from in_process import run_module
from test_dflash_formats import H, V
from test_dflash_formats import head as dflash_head

import peagle_jax as pj
from peagle_jax.formats import export_vllm, inspect_folder
from peagle_jax.handles.drafter import Drafter

HUGE_SEED = "999999999999999999999"
TARGET_LAYERS = 6  # the DFlash head reads layers (2, 5, 7): 7 is outside


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    hf_tiny.build("llama-gqa2-tied-llama3", root / "target")
    target = pj.load_target(root / "target", dtype="float32")
    drafter = pj.new_drafter(target, num_layers=1, mode="parallel", seed=1)
    drafter.save(root / "drafter")
    # a Qwen3 target's config with fewer layers than the DFlash head reads (configs are all a check needs)
    (root / "t6").mkdir()
    t6 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": TARGET_LAYERS}
    t6.update(hidden_size=H, vocab_size=V, max_position_embeddings=128)
    (root / "t6" / "config.json").write_text(json.dumps(t6))
    export_vllm(dflash_head(), root / "dflash")  # aux ids (2, 5, 7), embed_tokens and lm_head included
    export_vllm(dflash_head(), root / "dflash_verifier")  # the same, recording t6 as its target
    cfg_file = root / "dflash_verifier" / "config.json"
    raw = json.loads(cfg_file.read_text())
    raw["peagle_jax"]["verifier"] = str(root / "t6")
    cfg_file.write_text(json.dumps(raw))
    tensors = hand_tensors()
    tensors["fc.weight"][0, 0] = np.inf
    write_folder(root / "inf_head", vllm_config(), tensors)
    return root, target, drafter


# (case, argv with {root} / {out} placeholders, exit status, a word the error line holds, paths
# (under {root} / {out}) that must not exist afterwards)
GENERATE = ["infer", "generate", "--target", "{root}/target", "--drafter", "{root}/drafter", "--prompt-ids", "1,2,3"]
CLI_CASES = [
    (
        "seed above jax.random.key's int64",
        GENERATE + ["--temperature", "1", "--seed", HUGE_SEED],
        2,
        "--seed",
        [],
    ),
    (
        "negative seed",
        GENERATE + ["--seed", "-1"],
        2,
        "2**63 - 1",
        [],
    ),
    (
        "bench --json in /proc",
        ["infer", "bench", "--target", "{root}/target", "--drafter", "{root}/drafter", "--prompts", "mtbench"]
        + ["--json", "/proc/peagle.json"],
        2,
        "--json /proc/peagle.json",
        ["/proc/peagle.json"],
    ),
    (
        "bench --json below a file",
        ["infer", "bench", "--target", "{root}/target", "--drafter", "{root}/drafter", "--json"]
        + ["{root}/drafter/drafter.json/r.json"],
        2,
        "drafter.json",
        [],
    ),
    (
        "stop ids that are not ids",
        GENERATE + ["--stop-token-ids", "abc"],
        2,
        "argument --stop-token-ids: expected comma-separated token ids, got 'abc'",
        [],
    ),
    (
        "a stop id outside the vocabulary",
        GENERATE + ["--stop-token-ids", f"3,{hf_tiny.VOCAB}"],
        1,
        f"--stop-token-ids: token id {hf_tiny.VOCAB} outside the target's vocabulary [0, {hf_tiny.VOCAB})",
        [],
    ),
    (
        "a prompt id outside the vocabulary",
        ["infer", "generate", "--target", "{root}/target", "--drafter", "{root}/drafter", "--prompt-ids", "1,-2,3"],
        1,
        f"--prompt-ids: token id -2 outside the target's vocabulary [0, {hf_tiny.VOCAB})",
        [],
    ),
    (
        "bench stop ids outside the vocabulary",
        ["infer", "bench", "--target", "{root}/target", "--drafter", "{root}/drafter", "--stop-token-ids", "-1"],
        1,
        f"--stop-token-ids: token id -1 outside the target's vocabulary [0, {hf_tiny.VOCAB})",
        [],
    ),
    (
        "a head of this project's format as --target",
        ["infer", "generate", "--target", "{root}/drafter", "--drafter", "{root}/drafter", "--prompt-ids", "1,2,3"],
        1,
        "a drafter head in this project's format (drafter.json), not a target model",
        [],
    ),
    (
        "a vLLM head as --target",
        ["infer", "bench", "--target", "{root}/dflash", "--drafter", "{root}/drafter"],
        1,
        "a vLLM drafter head (architectures ['DFlashDraftModel']), not a target model",
        [],
    ),
    (
        "a head as the converter's --target",
        ["peagle_jax.convert", "export", "{root}/drafter", "{out}/x", "--format", "vllm", "--target", "{root}/dflash"],
        1,
        "not a target model",
        ["{out}/x"],
    ),
    (
        "DFlash aux ids outside --target",
        ["peagle_jax.convert", "import", "{root}/dflash", "{out}/imported", "--target", "{root}/t6"],
        1,
        f"outside the target's {TARGET_LAYERS} layers",
        ["{out}/imported"],
    ),
    (
        "DFlash aux ids outside the recorded verifier",
        ["peagle_jax.convert", "import", "{root}/dflash_verifier", "{out}/imported"],
        1,
        f"outside the target's {TARGET_LAYERS} layers",
        ["{out}/imported"],
    ),
    (
        "vLLM head with an Inf weight",
        ["peagle_jax.convert", "import", "{root}/inf_head", "{out}/imported"],
        1,
        "'fc.kernel' holds 1 non-finite value (0 NaN, 1 Inf)",
        ["{out}/imported"],
    ),
]


@pytest.mark.parametrize("argv, code, word, absent", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_bad_input_is_one_line_and_leaves_nothing(assets, tmp_path, argv, code, word, absent):
    root, _, _ = assets
    fill = {"root": root, "out": tmp_path}
    module, *args = (a.format(**fill) for a in argv)
    proc = run_module(module, args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == code, proc.stderr
    assert len(errors) == 1, proc.stderr
    assert word in errors[0], errors[0]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    if code == 2:  # judged before anything loads
        assert "loading target" not in proc.stderr, proc.stderr
    for path in absent:
        assert not Path(path.format(**fill)).exists(), path
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary sibling left


def test_import_force_writes_with_one_warning_per_problem(assets, tmp_path):
    """--force imports what inspect flags, each problem one `warning:` line; inspect then flags it."""
    root, _, _ = assets
    for src, target, word in ((root / "inf_head", None, "non-finite"), (root / "dflash", root / "t6", "outside")):
        out = tmp_path / src.name
        flags = [] if target is None else ["--target", target]
        proc = run_module("peagle_jax.convert", ["import", src, out, *flags, "--force"])
        assert proc.returncode == 0, proc.stderr
        warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and word in warnings[0], proc.stderr
        assert "error:" not in proc.stderr
        assert any(word in p for p in inspect_folder(out, target=target)["problems"])


def test_inspect_lists_disagreeing_dflash_aux_ids_once(assets, tmp_path):
    """eagle_aux_hidden_state_layer_ids that is not target_layer_ids + 1: one problem, not two (the
    tensor table's config no longer reports it again under the file's name)."""
    root, _, _ = assets
    folder = export_vllm(dflash_head(), tmp_path / "h")
    raw = json.loads((folder / "config.json").read_text())
    raw["eagle_aux_hidden_state_layer_ids"] = [2, 5, 6]
    (folder / "config.json").write_text(json.dumps(raw))
    proc = run_module("peagle_jax.convert", ["inspect", folder])
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.count("is not 'dflash_config.target_layer_ids'") == 1, proc.stdout
    assert "problems (1):" in proc.stdout, proc.stdout
    for bad in ([2, 2, 7], [-1, 2, 7]):  # malformed context layers: once too
        raw["eagle_aux_hidden_state_layer_ids"] = bad
        raw["dflash_config"] = {"mask_token_id": V - 2}  # no target_layer_ids: nothing to disagree with
        (folder / "config.json").write_text(json.dumps(raw))
        problems = inspect_folder(folder)["problems"]
        assert len([p for p in problems if str(bad)[1:-1] in p]) == 1, problems


# ---------------------------------------------------------------------------------------
# the Python API
@pytest.mark.parametrize("seed", [10**30, 2**63, -1, 1.5, True])
def test_api_seed_outside_jax_range_is_a_value_error(assets, seed):
    _, target, _ = assets
    dec = pj_decoder(target)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63 - 1\]"):
        dec.generate([[1, 2, 3]], max_new_tokens=2, temperature=1.0, seed=seed)


def test_seed_range_is_what_jax_random_key_accepts():
    import jax

    from infer.__main__ import SEED_MAX as CLI_SEED_MAX
    from peagle_jax.engine.generation import SEED_MAX, check_seed

    assert CLI_SEED_MAX == SEED_MAX
    jax.random.key(SEED_MAX)
    with pytest.raises(OverflowError):
        jax.random.key(SEED_MAX + 1)
    assert check_seed(SEED_MAX) == SEED_MAX and check_seed(0) == 0


def pj_decoder(target, drafter=None):
    from infer import SpeculativeDecoder

    return SpeculativeDecoder(target, drafter, mode="none" if drafter is None else None)


def test_api_wrong_handle_types_are_type_errors(assets):
    _, target, drafter = assets
    with pytest.raises(TypeError, match=r"drafter: expected a Drafter .* got Target"):
        pj_decoder(target, target)
    with pytest.raises(TypeError, match=r"drafter: expected a Drafter .* got str"):
        pj_decoder(target, "path/to/head")
    with pytest.raises(TypeError, match=r"target: expected a Target .* got Drafter"):
        pj_decoder(drafter, drafter)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_drafter_save_refuses_non_finite_weights(assets, tmp_path, value):
    _, _, drafter = assets
    arrays = drafter.arrays()
    arrays["fc", "kernel"] = arrays["fc", "kernel"].copy()
    arrays["fc", "kernel"][0, 1] = value
    bad = Drafter.from_arrays(drafter.config, arrays)
    with pytest.raises(ValueError, match=r"tensor 'fc.kernel' holds 1 non-finite value .*allow_non_finite=True"):
        bad.save(tmp_path / "head")
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary folder
    folder = bad.save(tmp_path / "head", allow_non_finite=True)
    assert any("'fc.kernel' holds 1 non-finite value" in p for p in inspect_folder(folder)["problems"])
