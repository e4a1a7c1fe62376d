"""Bad input to `python -m train`: one `error:` line naming the file, key or flag, no traceback,
exit 2 for what the flags alone decide (before any loading, so nothing is written), 1 for work
that failed, 130 interrupted; a run stopped before its first checkpoint removes the OUT it made,
and leaves an OUT that existed before as it was, saying which. The bad inputs run the command's
main in the test process (`in_process`); the interrupts, which the process itself receives, run
it as a user does (a subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from in_process import run_module
from limits import HANG_S

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The tiny target (built once) and the bad data files."""
    from train.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("bad-inputs")
    good = {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4 w5 w6"}]}
    (root / "bin.jsonl").write_bytes(b"\x80\x81\x00binary\x00\xff\n" * 4)
    folder = root / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps(good) + "\n")
    (folder / "b.jsonl").write_bytes(b"\x80\x81\x00binary\x00\xff\n")
    return {"TARGET": build_tiny_target(root / "target"), "BIN": root / "bin.jsonl", "FOLDER": folder}


def train_flags(out: Path, flags: list[str]) -> list[str]:
    return ["--preset", "tiny", "--out", str(out), "--loop.progress", "false", *flags]


def train_cmd(out: Path, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "train", *train_flags(out, flags)]


def assert_one_error_line(stderr: str, word: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, stderr[-3000:]
    assert word in lines[0], lines[0]
    return lines[0]


# (flags, exit status, a word of the error line, OUT exists before the run, OUT left after it, a word
# saying so); "@NAME" is a path of the `files` fixture. Checks before any loading: 2-5 s each; the
# rows with a target load cost ~10 s each and stay few.
CASES = [
    (["--data.batch-size", "100000"], 2, "--data.batch-size", False, False, None),  # was OOM after 87 s
    (["--model.mode", "dflash", "--model.init-layer", "1"], 2, "--model.init-layer", False, False, "--model.mode"),
    (["--model.mode", "dflash", "--model.block-size", "100000"], 2, "--model.block-size", False, False, None),
    (["--optim.lr", "1e-50"], 2, "--optim.lr", False, False, None),  # 0 in float32: trained nothing, exit 0
    (["--optim.lr", "1e-40"], 2, "--optim.lr", False, False, "subnormal"),
    (["--model.target", "@TARGET", "--data.source", "@BIN"], 1, "bin.jsonl", False, False, "removed"),
    (["--model.target", "@TARGET", "--data.source", "@FOLDER"], 1, "b.jsonl", False, False, "removed"),
    (["--model.target", "@TARGET", "--model.init-layer", "9"], 1, "init_layer", True, True, "kept"),
    (["--model.target", "@TARGET", "--data.max-len", "1000000"], 2, "--data.max-len", False, False, "removed"),
]
IDS = [" ".join(c[0]).replace("@", "") + (" (OUT existed)" if c[3] else "") for c in CASES]


@pytest.mark.parametrize("flags,code,word,existed,left,said", CASES, ids=IDS)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, files, flags, code, word, existed, left, said):
    out = tmp_path / "new" / "out"  # its parent too is made by the run, and must go with it
    if existed:
        out.mkdir(parents=True)
        (out / "mine.txt").write_text("the user's file")
    flags = [str(files[f[1:]]) if f.startswith("@") else f for f in flags]
    res = run_module("train", train_flags(out, flags))
    assert res.returncode == code, res.stderr[-3000:]
    line = assert_one_error_line(res.stderr, word)
    if said:
        assert said in line, line
    if left:
        assert (out / "mine.txt").read_text() == "the user's file"
    else:
        assert not (tmp_path / "new").exists(), sorted(p.name for p in (tmp_path / "new").rglob("*"))


def test_the_default_draft_vocabulary_fits_a_small_target(tmp_path, files):
    """A target of 6,144 tokens (dummy weights, a folder with only config.json): model.draft_vocab
    unset drafts over its whole vocabulary (the 16384 of a larger target would not fit); 16384
    given is refused, naming the flag and the target's vocabulary."""
    target = tmp_path / "v6144"
    target.mkdir()
    config = json.loads((files["TARGET"] / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "vocab_size": 6144}))
    flags = ["--model.target", target, "--model.load_format", "dummy", "--loop.steps", "1", "--data.heldout", "0"]
    flags += ["--eval.enabled", "false"]
    res = run_module("train", [*train_flags(tmp_path / "run", flags), "--model.draft_vocab", "None"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["draft_vocab_size"] == 6144
    bad = run_module("train", [*train_flags(tmp_path / "bad", flags), "--model.draft_vocab", "16384"])
    assert bad.returncode == 1, bad.stderr[-3000:]
    line = assert_one_error_line(bad.stderr, "--model.draft_vocab")
    assert "model.draft_vocab=16384 exceeds the target's vocabulary of 6144" in line, line


@pytest.mark.parametrize("saved,resumes", [(16384, True), (None, True), (8192, False)])
def test_a_run_saved_with_the_old_default_draft_vocabulary_resumes_unset(tmp_path, saved, resumes):
    """OUT written when model.draft_vocab defaulted to 16384 resumes with it unset (the same head
    on every target that could train with 16384); another size is refused, naming the key."""
    from train import config as C
    from train.flags import parse_args
    from train.loop import TrainError, check_resume

    cfg = C.to_dict(parse_args(["--preset", "tiny", "--out", str(tmp_path), "--model.draft_vocab", str(saved)]))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)  # a checkpoint
    now = parse_args(["--preset", "tiny", "--out", str(tmp_path), "--model.draft_vocab", "None"])
    if resumes:
        check_resume(tmp_path, now)
    else:
        with pytest.raises(TrainError, match=r"model.draft_vocab=8192 \(now None\)"):
            check_resume(tmp_path, now)


def test_help_into_a_closed_pipe_is_quiet():
    """`python -m train --help | head -3`: the reader leaves before the help is written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", "--help"],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader is gone before the first byte
    err = proc.stderr.read().decode()
    proc.wait(timeout=HANG_S)
    assert proc.returncode in (0, 141), err
    assert err == "", err


# ---------------------------------------------------------------------------------------
# interrupts: at the final evaluation (a signal there was once lost in a weakref callback and the
# run ended 0), and before the first checkpoint (OUT removed when the run made it)
def interrupt_when(cmd: list[str], ready: str, logs: Path, sig=signal.SIGINT) -> subprocess.CompletedProcess:
    """Run `cmd`; send `sig` once its stdout holds `ready`; the finished process."""
    out_path, err_path = logs / "stdout.txt", logs / "stderr.txt"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=err)
        deadline = time.monotonic() + HANG_S
        while ready not in out_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"ended before the signal: {err_path.read_text()[-2000:]}"
        proc.send_signal(sig)
        proc.wait(timeout=HANG_S)
    return subprocess.CompletedProcess(cmd, proc.returncode, out_path.read_text(), err_path.read_text())


EVAL = ["--eval.num_prompts", "4", "--eval.max_new_tokens", "96", "--eval.ks", "1", "2", "3"]


def test_interrupt_at_the_final_evaluation_is_exit_130(tmp_path, files):
    out = tmp_path / "run"
    flags = ["--model.target", str(files["TARGET"]), "--loop.steps", "2", "--loop.checkpoint_every", "1", *EVAL]
    res = interrupt_when(train_cmd(out, flags), "evaluating on", tmp_path)
    assert res.returncode == 130, (res.stdout[-1000:], res.stderr[-3000:])
    line = assert_one_error_line(res.stderr, "interrupted")
    assert "resume" in line  # it has checkpoints: OUT stays, and a rerun resumes
    assert not (out / "summary.json").exists()
    assert (out / "checkpoints").is_dir()


@pytest.mark.parametrize("existed", [False, True], ids=["out-new", "out-existed"])
def test_interrupt_before_the_first_checkpoint(tmp_path, files, existed):
    out = tmp_path / "run"
    if existed:
        out.mkdir()
    flags = ["--model.target", str(files["TARGET"]), "--loop.steps", "200", "--loop.checkpoint_every", "100"]
    flags += ["--eval.enabled", "false"]
    res = interrupt_when(train_cmd(out, flags), "target", tmp_path, signal.SIGTERM)  # "[ 5.1s] target ... loaded"
    assert res.returncode == 130, res.stderr[-3000:]
    line = assert_one_error_line(res.stderr, "interrupted before the first checkpoint")
    if existed:
        assert "kept" in line and out.is_dir()
    else:
        assert "removed" in line and not out.exists()
