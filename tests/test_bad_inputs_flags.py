"""Flag values that no run can use (issue 58, item 1): every command line judges them before it
loads a model or compiles, with one `error:` line naming the flag and exit status 2, and writes
nothing (an output path: its parent a writable folder, itself not a folder where a file goes nor
a file where a folder goes). The command lines run their main in the test process
(`in_process`; `bench.device.main` too)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import hf_tiny
import pytest
from in_process import run_module

import peagle_jax as pj


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """target/, head/ (a random head of this project's format), a_file (a regular file)."""
    root = tmp_path_factory.mktemp("flags")
    hf_tiny.build("llama-gqa2-tied-llama3", root / "target")
    pj.new_drafter(pj.load_target(root / "target", dtype="float32"), num_layers=1, seed=1).save(root / "head")
    (root / "a_file").write_text("x")
    return root


def device_main(argv: list[str]) -> tuple[int, str]:
    from bench.device import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


TRAIN = ["train", "--preset", "tiny", "--loop.progress", "false"]
BENCH = ["infer", "bench", "--target", "{root}/target", "--drafter", "{root}/head"]
SERVE = ["infer", "serve", "--target", "{root}/target", "--drafter", "{root}/head"]
EXPORT = ["peagle_jax.convert", "export", "{root}/head", "{out}/x", "--format", "vllm"]
# (case, argv with {root} / {out}, what the error line says)
CASES = [
    (
        "train --out in /proc",
        TRAIN + ["--out", "/proc/peagle-run"],
        "--out /proc/peagle-run: folder /proc is not writable",
    ),
    (
        "train --out below a file",
        TRAIN + ["--out", "{root}/a_file/run"],
        "--out {root}/a_file/run: {root}/a_file is a file, not a folder",
    ),
    (
        "train --data.cache_features in /proc",
        TRAIN + ["--out", "{out}/x", "--data.cache_features", "/proc/feats"],
        "data.cache_features /proc/feats: folder /proc is not writable",
    ),
    (
        "train --data.cache_features below a file",
        TRAIN + ["--out", "{out}/x", "--data.cache_features", "{root}/a_file/f"],
        "data.cache_features {root}/a_file/f: {root}/a_file is a file, not a folder",
    ),
    (
        "train --model.target no such folder",
        TRAIN + ["--out", "{out}/x", "--model.target", "{out}/none"],
        "model.target {out}/none: no such folder, nor an asset name, a Hub id (org/name) or tiny",
    ),
    (
        "train --data.source no such file",
        TRAIN + ["--out", "{out}/x", "--data.source", "{out}/none.jsonl"],
        "data.source {out}/none.jsonl: no such file or folder",
    ),
    (
        "infer --target no such folder",
        ["infer", "generate", "--target", "{out}/none", "--drafter", "{root}/head", "--prompt-ids", "1,2"],
        "--target {out}/none: no such folder, nor a Hub id (org/name)",
    ),
    (
        "infer bench --drafter no such folder",
        BENCH + ["--drafter", "{out}/none"],
        "--drafter {out}/none: no such folder, nor a Hub id (org/name)",
    ),
    (
        "infer --prompt-ids no such file",
        ["infer", "generate", "--target", "{root}/target", "--drafter", "{root}/head", "--prompt-ids", "{out}/p.jsonl"],
        "--prompt-ids {out}/p.jsonl: no such file",
    ),
    (
        "infer bench --prompts no such file",
        BENCH + ["--prompts", "{out}/none.jsonl"],
        "--prompts '{out}/none.jsonl': neither mtbench, humaneval, an existing JSONL file nor synthetic:LENGTHS",
    ),
    (
        "infer bench --prompts a folder",
        BENCH + ["--prompts", "{root}"],
        "--prompts '{root}': neither mtbench, humaneval, an existing JSONL file nor synthetic:LENGTHS",
    ),
    (
        "serve --dist.num_processes 2 without a coordinator",
        SERVE + ["--dist.num_processes", "2"],
        "dist.num_processes > 1 needs --dist.coordinator HOST:PORT (or --dist.auto true)",
    ),
    (
        "serve --dist.process-id past the processes",
        SERVE + ["--dist.coordinator", "127.0.0.1:1", "--dist.num_processes", "2", "--dist.process-id", "2"],
        "dist.process_id must lie in [0, dist.num_processes)",
    ),
    ("serve --dist.auto maybe", SERVE + ["--dist.auto", "maybe"], "argument --dist.auto: expected true or false"),
    (
        "export --target no such folder",
        EXPORT + ["--target", "{out}/none"],
        "argument --target: '{out}/none': no such folder, nor a Hub id (org/name)",
    ),
    (
        "export --target a file",
        EXPORT + ["--target", "{root}/a_file"],
        "argument --target: '{root}/a_file': not a folder",
    ),
    (
        "inspect --target no such folder",
        ["peagle_jax.convert", "inspect", "{root}/head", "--target", "{out}/none"],
        "argument --target: '{out}/none': no such folder",
    ),
    (
        "import --target no such folder",
        ["peagle_jax.convert", "import", "{root}/head", "{out}/x", "--target", "{out}/none"],
        "argument --target: '{out}/none': no such folder",
    ),
    ("export --verifier not a Hub id", EXPORT + ["--verifier", "bad id!"], "argument --verifier: expected a Hub id"),
]


@pytest.mark.parametrize("argv, says", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_flag_is_one_line_exit_2_before_any_work(root, tmp_path, argv, says):
    fill = {"root": root, "out": tmp_path}
    module, *args = (a.format(**fill) for a in argv)
    proc = run_module(module, args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr
    assert len(errors) == 1 and says.format(**fill) in errors[0], proc.stderr
    assert "loading" not in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, not even OUT or a temporary


DEVICE_CASES = [
    ("--minutes inf", ["--minutes", "inf"], "--minutes must be positive and finite, got inf"),
    ("--minutes nan", ["--minutes", "nan"], "--minutes must be positive and finite, got nan"),
    ("--out below a file", ["--out", "{root}/a_file/dev"], "--out {root}/a_file/dev: {root}/a_file is a file"),
    ("--out in /proc", ["--out", "/proc/peagle-dev"], "--out /proc/peagle-dev: folder /proc is not writable"),
]


@pytest.mark.parametrize("flags, says", [c[1:] for c in DEVICE_CASES], ids=[c[0] for c in DEVICE_CASES])
def test_device_playbook_flags(root, tmp_path, flags, says):
    fill = {"root": root, "out": tmp_path}
    argv = ["--out", str(tmp_path / "dev"), "--smoke", *(f.format(**fill) for f in flags)]
    code, err = device_main(argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: python -m bench.device: "), err
    assert says.format(**fill) in lines[0], err
    assert list(tmp_path.iterdir()) == []
