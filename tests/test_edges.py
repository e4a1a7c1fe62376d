"""The edges a new user trips over: stop tokens, file modes, interrupted writes, unchecked
values, CLI manners. Each test failed against the behaviour it pins down."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import hf_tiny
import jax.numpy as jnp
import numpy as np
import pytest
from limits import HANG_S

import peagle_jax as pj
from infer.__main__ import main as infer_main
from peagle_jax.engine import SpeculativeDecoder, generate_greedy
from peagle_jax.runtime.folders import atomic_folder, atomic_write_text, write_hf_folder

NEW = 8
ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "tests" / "programs"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("edges") / "target"
    hf_tiny.build("llama-gqa2-tied-llama3", folder)
    return folder, pj.load_target(folder, dtype="float32")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ------------------------------------------------------------------------------ stop tokens


def test_generation_config_eos_and_per_call_stop_ids(tiny, tmp_path):
    folder, target = tiny
    prompt = [5, 6, 7, 8]
    free = generate_greedy(target, [prompt], NEW, eos=())[0]
    stop = free[2]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop]}))
    try:
        reloaded = pj.load_target(folder, dtype="float32")
        assert stop in reloaded.eos_token_ids
        got = SpeculativeDecoder(reloaded, mode="none").generate([prompt], max_new_tokens=NEW).tokens[0]
        assert got == free[: free.index(stop) + 1]  # stops at the generation config's eos, keeps it
    finally:
        (folder / "generation_config.json").unlink()
    per_call = SpeculativeDecoder(target, mode="none").generate([prompt], max_new_tokens=NEW, stop_token_ids=[free[1]])
    assert per_call.tokens[0] == free[:2]
    drafter = pj.new_drafter(target, mode="parallel", seed=1)
    spec = SpeculativeDecoder(target, drafter, k=3).generate([prompt], max_new_tokens=NEW, stop_token_ids=[free[1]])
    assert spec.tokens == per_call.tokens


# ------------------------------------------------------------------------------ file modes and temporaries


def test_written_folders_follow_the_umask(tiny, tmp_path):
    _, target = tiny
    old = os.umask(0o022)
    try:
        drafter = pj.new_drafter(target, mode="parallel", seed=1)
        saved = drafter.save(tmp_path / "own")
        from peagle_jax.formats import export_vllm

        exported = export_vllm(drafter, tmp_path / "vllm")
        json_file = atomic_write_text(tmp_path / "bench" / "r.json", "{}")
        target_folder = target.save(tmp_path / "target")
    finally:
        os.umask(old)
    for root in (saved, exported, target_folder):
        assert _mode(root) == 0o755, root
        for path in root.rglob("*"):
            assert _mode(path) == (0o755 if path.is_dir() else 0o644), path
    assert _mode(json_file) == 0o644


def test_failed_write_leaves_nothing_and_stale_temporaries_are_removed(tmp_path):
    dest = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_folder(dest) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.tmp-{dead.pid}-abcd"
    stale.mkdir()
    live = tmp_path / f".out.tmp-{os.getpid()}-abcd"  # a live writer (this process) is left alone
    live.mkdir()
    write_hf_folder(dest, {"a": 1}, {"w": np.zeros(2, np.float32)})
    assert not stale.exists()
    assert live.exists()
    assert (dest / "config.json").exists()


def test_sigterm_during_a_write_removes_the_temporary(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(PROGRAMS / "sigterm_write.py"), str(tmp_path / "out")],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 130, proc.stderr
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ unchecked values


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
    ],
)
def test_sampling_values_are_checked(tiny, kw, match):
    _, target = tiny
    args = {"max_new_tokens": 4, **kw}
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target, mode="none").generate([[1, 2]], **args)


def test_decoder_arguments_are_checked(tiny):
    _, target = tiny
    drafter = pj.new_drafter(target, mode="parallel", seed=1)
    with pytest.raises(ValueError, match="deep_k"):
        SpeculativeDecoder(target, drafter, k=3, deep_k="maybe")
    with pytest.raises(ValueError, match="k must be an integer"):
        SpeculativeDecoder(target, drafter, k=2.5)
    dec = SpeculativeDecoder(target, mode="none")
    with pytest.raises(ValueError, match="prompt 0: token ids must be integers"):
        dec.generate([[1.0, 2.7]], max_new_tokens=2)
    with pytest.raises(ValueError, match="no prompts"):
        dec.generate([], max_new_tokens=2)
    with pytest.raises(ValueError, match="no tokens"):
        target.forward(np.zeros((1, 0), np.int32))


def test_array_prompts_simply_work(tiny):
    _, target = tiny
    dec = SpeculativeDecoder(target, mode="none")
    want = dec.generate([[3, 4, 5]], max_new_tokens=4).tokens
    assert dec.generate(np.array([3, 4, 5]), max_new_tokens=4).tokens == want  # one 1-D prompt
    assert dec.generate(jnp.array([[3, 4, 5]]), max_new_tokens=4).tokens == want  # a 2-D batch
    assert dec.generate([np.array([3, 4, 5], np.int64)], max_new_tokens=4).tokens == want


def test_dtype_defaults(tiny):
    folder, _ = tiny
    target = pj.load_target(folder)  # CPU: float32 by default
    assert target.dtype == jnp.float32
    bf16 = pj.load_target(folder, dtype="bfloat16")
    assert pj.new_drafter(bf16, mode="parallel").dtype == jnp.bfloat16  # follows the target
    assert pj.new_drafter(bf16, mode="parallel", dtype="float32").dtype == jnp.float32


# ------------------------------------------------------------------------------ the infer CLI


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--batch-size", "0"], "--batch-size"),
        (["--batch-size", "-1"], "--batch-size"),
        (["--temperature", "nan"], "--temperature"),
        (["--top-p", "1.5"], "--top-p"),
        (["--k", "2.5"], "--k"),
    ],
)
def test_bench_flags_are_usage_errors(tiny, flags, needle, capsys):
    folder, _ = tiny
    assert infer_main(["bench", "--target", str(folder), "--mode", "none", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert needle in err[0], err


def test_prompt_ids_and_help_defaults(tiny, tmp_path, capsys):
    folder, target = tiny
    assert (
        infer_main(
            [
                "generate",
                "--target",
                str(folder),
                "--mode",
                "none",
                "--prompt-ids",
                "5,6,7",
                "--max-new-tokens",
                "4",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == generate_greedy(target, [[5, 6, 7]], 4)[0]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("[5, 6, 7]\n[9, 10]\n")
    assert (
        infer_main(
            [
                "generate",
                "--target",
                str(folder),
                "--mode",
                "none",
                "--prompt-ids",
                str(jsonl),
                "--max-new-tokens",
                "3",
                "--json",
            ]
        )
        == 0
    )
    assert len(json.loads(capsys.readouterr().out)["outputs"]) == 2
    assert infer_main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in (
        "(default: each head's own mode)",
        "(default: auto)",
        "(default: 128)",
        "(default: 0.0)",
        "(default: 1.0)",
    ):
        assert default in text, default


def test_terminated_cli_exits_cleanly(tiny):
    folder, _ = tiny
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infer",
            "generate",
            "--target",
            str(folder),
            "--mode",
            "none",
            "--prompt-ids",
            "5,6,7",
            "--max-new-tokens",
            "20",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:  # wait until it works (compiling takes seconds), then stop it like a scheduler would
        if "loaded" in line:
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=HANG_S) == 130
    assert "error: interrupted" in rest


# ------------------------------------------------------------------------------ the convert CLI


def test_convert_exit_codes_and_help(tiny, tmp_path, capsys):
    from peagle_jax.formats.convert import main as convert_main

    _, target = tiny
    assert convert_main(["inspect", str(tmp_path / "missing")]) == 2  # could not inspect
    assert convert_main(["export", str(tmp_path / "missing"), str(tmp_path / "out"), "--format", "vllm"]) == 1
    assert convert_main(["export", "a", "b", "--format", "onnx"]) == 2  # usage
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3
    assert all(line.startswith("error: ") for line in err)
    assert "missing" in err[1]
    assert ".tmp-" not in err[1]
    head = pj.new_drafter(target, mode="parallel", seed=1).save(tmp_path / "head")
    assert convert_main(["export", str(head), str(tmp_path / "vllm"), "--format", "vllm"]) == 0
    assert convert_main(["inspect", str(tmp_path / "vllm"), "--vllm-version", "0.33"]) == 0  # clean
    assert convert_main(["export", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: bfloat16)" in text
    assert "(default: 5GB)" in text
    assert convert_main(["export-target", "--help"]) == 0
    assert "same round trip" in " ".join(capsys.readouterr().out.split())


def test_killed_export_leaves_no_temporary(tiny, tmp_path):
    """SIGTERM in the middle of an export: exit 130, no `.OUT.tmp-*` folder, no OUT."""
    _, target = tiny
    head = pj.new_drafter(target, mode="parallel", seed=1).save(tmp_path / "head")
    proc = subprocess.run(
        [sys.executable, str(PROGRAMS / "killed_export.py"), str(head), str(tmp_path / "out")],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 130, proc.stderr
    assert "interrupted" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]
