"""The trainer's sliding-window flags (`--model.sliding_window`, `--model.full_attention_layers`,
`--model.sliding_window_non_causal`): a run builds and saves the head they name, for DFlash and
P-EAGLE, the window changes what the head computes (its first loss), and flags no head can use
are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

import peagle_jax as pj
from peagle_jax.runtime.command_line import UsageError
from train.flags import parse_args
from train.loop import run


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from train.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("window") / "target")


def train_once(out, target, mode, *extra):
    argv = ["--preset", "tiny", "--model.mode", mode, "--model.target", str(target), "--out", str(out),
            "--loop.steps", "1", "--loop.progress", "false", "--eval.enabled", "false", "--data.heldout", "0",
            "--model.num_layers", "2", *extra]  # fmt: skip
    return run(parse_args(argv)), pj.load_drafter(out / "head")


@pytest.mark.parametrize("mode", ["dflash", "parallel"])
def test_a_run_saves_the_sliding_head_its_flags_name(tmp_path, target, mode):
    window = ["--model.sliding_window", "3", "--model.full_attention_layers", "1"]
    if mode == "dflash":
        window += ["--model.sliding_window_non_causal", "true"]
    full, full_head = train_once(tmp_path / "full", target, mode)
    slid, head = train_once(tmp_path / "slid", target, mode, *window)
    c = head.config
    assert (c.mode, c.sliding_window, c.layer_types) == (mode, 3, ("sliding_attention", "full_attention"))
    assert full_head.config.sliding_window is None
    assert set(full_head.config.layer_types or ("full_attention",)) == {"full_attention"}
    if mode == "dflash":
        assert c.sliding_window_non_causal is True
    # same seed and batch: only the window differs, and 3 positions cut the tiny rows' context
    assert np.isfinite(slid["first_loss"]) and np.isfinite(full["first_loss"])
    assert abs(slid["first_loss"] - full["first_loss"]) > 1e-6 * abs(full["first_loss"])


def test_window_flags_no_head_can_use_are_refused():
    base = ["--preset", "tiny", "--model.mode", "dflash", "--model.num_layers", "2"]
    assert parse_args(base).model.sliding_window is None
    for extra, message in [
        (["--model.sliding_window", "0"], "model.sliding_window must be >= 1"),
        (["--model.full_attention_layers", "0"], "needs model.sliding_window"),
        (["--model.sliding_window", "4", "--model.full_attention_layers", "2"], r"layers are 0 \.\. 1"),
        (["--model.sliding_window_non_causal", "true"], "for DFlash heads with a model.sliding_window"),
        (
            ["--model.mode", "parallel", "--model.sliding_window", "4", "--model.sliding_window_non_causal", "true"],
            "for DFlash heads",
        ),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_args([*base, *extra])
