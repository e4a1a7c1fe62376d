"""`python -m train`'s command line: `--help` under a preset, the usage line, the tiny target's
file modes, and the values the flag fuzz (tests/test_train_fuzz.py) found to end in a traceback
or to reach a run they can only fail: each is now one line naming its flag, exit 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from limits import HANG_S

import train.__main__ as entry
from train import config as C
from train import flags as F
from train.checks import INT_MAX, SEED_MAX

ROOT = Path(__file__).resolve().parents[1]


def _flat(text: str) -> str:
    """tyro's help boxes as one line: the frames dropped, the wrapped lines joined."""
    return " ".join(text.replace("│", " ").split())


def _run(argv, capsys) -> tuple[int, str, str]:
    """main(argv) with the training itself replaced (nothing is trained or written)."""
    with mock.patch.object(entry, "train", lambda cfg, hooks=(): 0):
        rc = entry.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _usage_error(argv, capsys) -> str:
    rc, _, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    return lines[0]


# ---------------------------------------------------------------------------------------
# --help and the usage line
def test_help_shows_the_presets_defaults_and_names_python_m_train(capsys):
    rc, out, _ = _run(["--preset", "tiny", "--help"], capsys)
    assert rc == 0
    assert out.startswith("usage: python -m train ")
    flat = _flat(out)
    for shown in ("(default: runs/tiny)", "(default: tiny)", "(default: synthetic)", "(default: 48)"):
        assert shown in flat, shown
    assert "runs/peagle-gemma3-270m" not in flat and "(default: sharegpt)" not in flat


def test_help_shows_the_files_values_over_the_preset(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("out: runs/from-file\noptim:\n  lr: 0.0123\n")
    rc, out, _ = _run(["--preset", "tiny", "--config", str(f), "-h"], capsys)
    assert rc == 0
    flat = _flat(out)
    assert "(default: runs/from-file)" in flat and "(default: 0.0123)" in flat and "(default: synthetic)" in flat


def test_help_of_the_default_preset_is_unchanged(capsys):
    rc, out, _ = _run(["--help"], capsys)
    assert rc == 0 and "(default: runs/peagle-gemma3-270m)" in _flat(out)


def test_usage_line_of_the_module_names_python_m_train():
    """As a user runs it (tyro alone would print the path of train/__main__.py)."""
    proc = subprocess.run(
        [sys.executable, "-m", "train", "--preset", "tiny", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m train "), proc.stdout[:200]
    assert "(default: runs/tiny)" in _flat(proc.stdout)


# ---------------------------------------------------------------------------------------
# the tiny target's files
@pytest.mark.parametrize("umask", [0o022, 0o002], ids=["umask-022", "umask-002"])
def test_tiny_target_files_have_the_umasks_modes(tmp_path, umask):
    """Like every writer of peagle_jax.runtime.folders (safetensors alone leaves model.safetensors 0600)."""
    from train.tiny import build_tiny_target

    old = os.umask(umask)
    try:
        folder = build_tiny_target(tmp_path / "tiny-target")
    finally:
        os.umask(old)
    assert (folder / "model.safetensors").is_file()
    for p in [folder, *folder.rglob("*")]:
        want = (0o777 if p.is_dir() else 0o666) & ~umask
        assert p.stat().st_mode & 0o777 == want, (p.name, oct(p.stat().st_mode & 0o777))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-target"]  # no temporary left beside it
    assert build_tiny_target(folder) == folder  # found, not rebuilt


# ---------------------------------------------------------------------------------------
# values the fuzz found: a traceback before, one line naming the flag now
def test_segments_of_a_digit_that_is_no_integer(capsys):
    """'²' passes str.isdigit, and int('²') raised ValueError out of the parser."""
    line = _usage_error(["--loop.segments", "²"], capsys)
    assert "loop.segments" in line and "'²'" in line


@pytest.mark.parametrize("value,want", [("3", 3), ("auto", "auto"), ("٣", 3)])
def test_segments_still_takes_integers_and_auto(value, want):
    assert F.parse_args(["--loop.segments", value]).loop.segments == want


def test_a_config_file_that_is_not_text(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"\xff\xfe\x00binary")
    line = _usage_error(["--config", str(f)], capsys)
    assert f"--config {f}: cannot read it" in line


@pytest.mark.parametrize("path,want", [("", "must name a YAML or JSON file"), (".", "not a file")])
def test_a_config_that_names_no_file(path, want, capsys):
    assert want in _usage_error(["--config", path], capsys)


@pytest.mark.parametrize(
    "text,want",
    [
        ("model:\n  mask_token_id: abc\n", "model.mask_token_id: expected an integer, got 'abc'"),  # was a TypeError
        ("data:\n  max_anchors: 1.5\n", "data.max_anchors: expected an integer"),  # was taken as a float
        ("data:\n  cache_features: 5\n", "data.cache_features: expected a string"),
        ("loop:\n  segments: 2.5\n", "loop.segments: expected an integer or a string"),
        ('{"optim": {"lr": 1' + "0" * 400 + "}}", "optim.lr: expected a finite number"),  # was an OverflowError
    ],
)
def test_config_file_values_of_optional_and_union_fields_are_converted(tmp_path, text, want, capsys):
    f = tmp_path / ("c.json" if text.startswith("{") else "c.yaml")
    f.write_text(text)
    assert want in _usage_error(["--config", str(f)], capsys)


def test_config_file_union_fields_take_their_members(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("loop:\n  segments: auto\nmodel:\n  mask_token_id: 3\ndata:\n  max_anchors: null\n")
    cfg = F.parse_args(["--config", str(f)])
    assert (cfg.loop.segments, cfg.model.mask_token_id, cfg.data.max_anchors) == ("auto", 3, None)
    f.write_text("loop:\n  segments: 4\n")
    assert F.parse_args(["--config", str(f)]).loop.segments == 4


HUGE = str(10**30)
REFUSED = [
    (["--model.num_layers", HUGE], f"model.num_layers must be at most {INT_MAX}"),
    (["--model.draft_vocab", str(2**63)], "model.draft_vocab must be at most"),
    (["--data.max_len", HUGE], "data.max_len must be at most"),
    (["--eval.ks", "3", HUGE], "eval.ks must be at most"),
    (["--loop.steps", HUGE], "loop.steps must be at most"),
    (["--model.seed", "-1"], f"model.seed must lie in [0, {SEED_MAX}]"),  # numpy: "expected non-negative integer"
    (["--data.seed", HUGE], "data.seed must lie in"),
    (["--optim.lr", "1e300"], "optim.lr must be a finite number > 0"),  # inf in the float32 step
    (["--optim.lr", "1e-320"], "--optim.lr 1e-320 is 0 in float32"),  # nothing trained, exit 0
    (["--optim.lr", "1e-40"], "--optim.lr 1e-40 is subnormal in float32"),
    (["--optim.clip", "1e39"], "optim.clip must be a finite number > 0"),
    (["--optim.weight_decay", "1e300"], "optim.weight_decay must be a finite number >= 0"),
    (["--data.row_factor", "1e300"], "data.row_factor x data.max_len"),  # "Maximum allowed dimension exceeded"
    (["--out", ""], "--out must name a folder"),  # the current folder
    (["--model.target", ""], "model.target must not be empty"),
    (["--data.source", ""], "data.source must not be empty"),
    (["--data.cache_features", ""], "data.cache_features must not be empty"),
    (["--eval.prompts", "no-such-prompts.jsonl"], "eval.prompts 'no-such-prompts.jsonl': neither"),  # after training
    (["--preset", ""], "unknown preset ''"),  # was taken as the default preset
    (["--optim.lr=", ""], "Unrecognized options: ''"),  # tyro's message ended at the colon
]


@pytest.mark.parametrize("argv,want", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_values_no_run_can_use_are_refused_naming_the_flag(argv, want, capsys):
    assert want in _usage_error(["--preset", "tiny", *argv], capsys)


def test_paths_that_are_files_where_folders_go(tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    assert f"--out {f}: exists and is not a folder" in _usage_error(["--out", str(f)], capsys)
    line = _usage_error(["--data.cache_features", str(f)], capsys)
    assert f"data.cache_features {f}: exists and is not a folder" in line
    assert f"model.target {f}: a file, not a folder" in _usage_error(["--model.target", str(f)], capsys)


def test_eval_prompts_is_checked_only_when_evaluating(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["w1 w2"]}) + "\n")
    for value in ("mtbench", "HumanEval", "synthetic", str(prompts)):
        assert F.parse_args(["--eval.prompts", value]).eval.prompts == value
    assert F.parse_args(["--eval.enabled", "false", "--eval.prompts", "nope"]).eval.prompts == "nope"


def test_long_and_odd_names_are_no_traceback(capsys):
    """A name the system refuses (too long, a NUL byte) is left to the run, which names it."""
    for name in ("x" * 5000, "a\x00b"):
        rc, _, err = _run(["--preset", "tiny", "--model.target", name, "--data.cache_features", name], capsys)
        assert rc == 0, err


def test_the_saved_config_of_a_parsed_command_line_reads_back():
    """config.json (what a resume compares) holds what the command line set."""
    cfg = F.parse_args(["--preset", "tiny", "--loop.segments", "auto", "--eval.ks", "3", "5", "--optim.lr", "1.2e-38"])
    assert F.from_dict(C.to_dict(cfg)) == cfg


def test_messages_are_one_line_with_no_traceback_frames(capsys):
    line = _usage_error(["--model.mask_token_id", ""], capsys)
    assert "model.mask-token-id" in line and not re.search(r"Traceback|File \"", line)


# ---------------------------------------------------------------------------------------
# a run whose last update blew the head up (found by the fuzz: `--loop.steps 2 --optim.optimizer muon
# --optim.muon_weight_decay 1e30`, or `--loop.steps 1 --optim.lr 1e30`) ended with exit 0 and a
# held-out loss of nan in summary.json: the steps' losses are taken before their update
def _summary(**kw):
    return {"head_dir": "OUT/head", "first_loss": 1.2, "final_loss": 1.1, "heldout": {"eval_loss": 1.0}, **kw}


@pytest.mark.parametrize(
    "summary,name",
    [
        (_summary(heldout={"eval_loss": float("nan")}), "held-out loss is nan"),
        (_summary(final_loss=float("inf")), "final_loss is inf"),
    ],
)
def test_a_summary_with_a_loss_that_is_not_finite_is_a_failed_run(summary, name, capsys):
    with mock.patch("train.loop.run", lambda cfg, hooks=(): summary):
        rc = entry.main(["--preset", "tiny"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and name in err[0] and "OUT/head" in err[0], err


def test_a_summary_with_finite_losses_passes():
    entry.check_losses(_summary())
    entry.check_losses(_summary(first_loss=None, final_loss=None, heldout=None))  # no step, no held-out split


def test_a_step_whose_update_blows_up_the_head_stops_the_run():
    import types

    from train.loop import StopOnNonFinite, TrainError

    hook, trainer = StopOnNonFinite(), types.SimpleNamespace(step=7)
    hook.after_step(trainer, {"loss": 2.0, "grad_norm": 1.0, "param_norm": 30.0})  # finite: nothing
    with pytest.raises(TrainError, match="step 7: param_norm is inf"):
        hook.after_step(trainer, {"loss": 2.0, "grad_norm": 1.0, "param_norm": float("inf")})


def test_the_end_line_names_the_training_batches_acceptance_beside_the_held_out_one(capsys):
    summary = _summary(
        vllm_dir="OUT/vllm",
        steps=9,
        train_tokens=900,
        wall_seconds=3.0,
        per_depth_accuracy=[0.5, 0.25],
        simulated_acceptance_length=1.81,
        heldout={"eval_loss": 1.0, "eval_sim_tau": 1.23},
        data={"heldout": 4},
        serve="vllm serve T",
        serve_lines=['pip install "vllm>=0.16,<0.34" && vllm serve T', "python -m infer serve --target T"],
        serve_note="vLLM 0.34 and later refuse P-EAGLE heads",
    )
    with mock.patch("train.loop.run", lambda cfg, hooks=(): summary):
        assert entry.main(["--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "simulated acceptance length 1.81 on the last training batches, 1.23 on the 4 held-out conversations" in out
    assert out.splitlines()[-3:] == [
        "note: vLLM 0.34 and later refuse P-EAGLE heads",
        'serve: pip install "vllm>=0.16,<0.34" && vllm serve T',
        "serve: python -m infer serve --target T",
    ]
    rounds = {"k": 7, "conversations": 4, "per_anchor": 1.31, "per_anchor_se": 0.02, "per_round": 1.19}
    summary["heldout_rounds"] = rounds | {"per_round_se": 0.03, "rounds": 120}
    with mock.patch("train.loop.run", lambda cfg, hooks=(): summary):
        assert entry.main(["--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert (
        "simulated acceptance length 1.81 on the last training batches, 1.31 per anchor and 1.19 ± 0.03 per greedy "
        "round (K=7, 120 rounds: what the engine accepts) on the 4 held-out conversations"
    ) in out
    summary.update(simulated_acceptance_se=0.291, simulated_acceptance_batches=20)
    with mock.patch("train.loop.run", lambda cfg, hooks=(): summary):
        assert entry.main(["--preset", "tiny"]) == 0
    assert (
        "simulated acceptance length 1.81 ± 0.29 on the last 20 training batches, 1.31 per anchor"
        in capsys.readouterr().out
    )
