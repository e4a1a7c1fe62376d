"""`python -m peagle_jax.plan` checks every flag before it compiles: a value no program can use is
one line naming the flag and exit 2, here where no accelerator compiler is installed (so the
check comes before the compiler's, which is the next thing the command does). The compiler's own
refusals stay results: tests/compile/test_plan_cli.py."""

from __future__ import annotations

import os

import pytest

from plan.__main__ import main

BASE = ["--target", "Llama-3.1-8B", "--device", "h100"]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--tokens", "0"], "argument --tokens: expected a positive integer, got '0'"),
        (["--tokens", "-4096"], "argument --tokens: expected a positive integer, got '-4096'"),
        (["--batch", "0"], "argument --batch: expected a positive integer"),
        (["--job", "serve", "--k", "0"], "argument --k: expected a positive integer, got '0'"),
        (["--job", "serve", "--cache-len", "x"], "argument --cache-len: expected a positive integer, got 'x'"),
        (["--modes", "bogus"], "--modes 'bogus': unknown mode(s) ['bogus'] (--job train: parallel, chain, dflash)"),
        (["--modes", "none"], "--modes 'none': unknown mode(s) ['none'] (--job train"),
        (["--modes", "chain,chain"], "--modes 'chain,chain': a mode given twice"),
        (["--train-flag=--model.bogus=1"], "--train-flag '--model.bogus=1': unknown option --model.bogus"),
        (["--train-flag=--model.num_layers=0"], "--train-flag '--model.num_layers=0': model.num_layers must be >= 1"),
        (["--job", "serve", "--train-flag=--model.num_layers=2"], "only a --job train plan builds the trainer's step"),
        (["--target", "Gemma-3-270M", "--layers", "99"], "--layers 99: the target Gemma-3-270M has 18 layers"),
        (["--json", "/proc/plan.json"], "--json /proc/plan.json: folder /proc is not writable"),
        (["--json", "{tmp}"], "exists and is a folder, not a file"),
        (["--json", "{tmp}/file/plan.json"], "is a file, not a folder"),
        (["--job", "server", "--tensor", "2"], "--tensor 2: needs 2 devices, h100 has 1"),
        (["--job", "train", "--data", "2"], "--tensor 1 --data 2: a serving plan's mesh (--job serve or server)"),
        (["--job", "server", "--device", "h100x8", "--tensor", "3"], "--tensor 3: the target's 32 attention heads"),
        (
            ["--job", "serve", "--device", "h100x8", "--data", "2", "--batch", "3"],
            "--batch 3: not divisible by --data 2",
        ),
        (
            ["--job", "server", "--device", "h100x8", "--devices", "auto", "--data", "3"],
            "--data 3 does not divide the 8",
        ),
        (["--job", "server", "--tensor", "2", "--devices", "auto"], "argument --devices: not allowed with argument"),
    ],
)
def test_a_flag_no_program_can_use_is_one_line_and_exit_2(flags, says, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code = main(BASE + [f.replace("{tmp}", str(tmp_path)) for f in flags])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out
    (line,) = err.splitlines()
    assert line.startswith("error: python -m peagle_jax.plan: ") and says in line, line


def test_flags_it_can_use_reach_the_compiler(capsys, monkeypatch):
    """Valid train flags pass the check: the next line is the compiler's (none installed here)."""
    for key in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "TPU_SKIP_MDS_QUERY", "ALLOW_MULTIPLE_LIBTPU_LOAD"):
        monkeypatch.setenv(key, os.environ.get(key, ""))  # deviceless_env sets them: put back afterwards
    code = main(BASE + ["--modes", "dflash", "--train-flag=--model.num_layers=2", "--tokens", "512"])
    err = capsys.readouterr().err
    assert code == 1 and "no deviceless cuda compiler" in err, err
