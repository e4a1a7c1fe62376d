"""`python -m infer generate|bench` on a tiny target that has a tokenizer and a chat template."""

from __future__ import annotations

import json
import os
import re

import hf_tiny
import pytest
from in_process import run_module

import peagle_jax as pj
from infer import SpeculativeDecoder
from infer.__main__ import main
from peagle_jax.engine import largest_k


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    hf_tiny.build("llama-gqa2-tied-llama3", root / "target")
    hf_tiny.word_tokenizer(root / "target")
    target = pj.load_target(root / "target", dtype="float32")
    pj.new_drafter(target, num_layers=1, mode="parallel", seed=1).save(root / "drafter")
    return root, target


def test_generate_json_is_lossless_and_uses_the_chat_template(assets, capsys):
    root, target = assets
    assert (
        main(
            [
                "generate",
                "--target",
                str(root / "target"),
                "--drafter",
                str(root / "drafter"),
                "--k",
                "3",
                "--prompt",
                "w10 w11 w12",
                "--max-new-tokens",
                "10",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    templated = [2, 10, 11, 12, 3, 4]  # w2 <content> w3 w4
    plain = SpeculativeDecoder(target, mode="none").generate([templated], max_new_tokens=10)
    assert out["tokens"] == plain.tokens[0]
    assert out["text"] == " ".join(f"w{t}" for t in plain.tokens[0])
    assert out["stats"]["acceptance_length"] >= 1.0


def test_bench_writes_all_numbers(assets, tmp_path, capsys):
    root, _ = assets
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "w5 w6"}\n{"messages": [{"role": "user", "content": "w7 w8 w9"}]}\n{"turns": ["w1", "w2"]}\n'
    )
    out = tmp_path / "res" / "bench.json"
    assert (
        main(
            [
                "bench",
                "--target",
                str(root / "target"),
                "--drafter",
                str(root / "drafter"),
                "--k",
                "3",
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                "8",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["batches"] == 3
    assert res["identical_greedy_outputs"] is True
    for key in (
        "baseline_tokens_per_second",
        "speculative_tokens_per_second",
        "speedup",
        "acceptance_length",
        "drafter_ms_per_round",
        "target_ms_per_round",
    ):
        assert res[key] > 0, key
    assert len(res["per_position_acceptance"]) == 3
    assert "speedup" in capsys.readouterr().out


def test_errors_are_one_line_and_nonzero(assets, tmp_path):
    root, _ = assets
    proc = run_module(
        "infer", ["generate", "--target", tmp_path / "nope", "--drafter", root / "drafter", "--prompt", "w1"]
    )
    assert proc.returncode == 2  # no such folder: judged with the flags, before anything loads
    assert proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "nope" in errors[0]
    assert proc.stderr.strip().splitlines()[-1] == errors[0]
    no_drafter = run_module("infer", ["generate", "--target", root / "target", "--prompt", "w1"])
    assert no_drafter.returncode == 2
    assert "--drafter" in no_drafter.stderr


@pytest.mark.parametrize("argv", [["generate"], ["bench", "--target", "x", "--k", "seven"], ["nope"], []])
def test_usage_errors_are_one_line(argv, capsys):
    """argparse's own errors (missing flag, bad int, unknown command) are one line too, exit 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: python -m infer"), err


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ---------------------------------------------------------------------------------------
# checked before anything loads or compiles
@pytest.mark.parametrize("case", ["a folder", "below a file", "unwritable"])
def test_bench_json_destination_is_checked_before_loading(case, tmp_path, capsys):
    """A --json FILE that cannot be written fails in the parser (exit 2), not after the benchmark;
    the target does not exist, so exit 2 (not 1) shows that nothing was loaded."""
    if case == "unwritable" and os.geteuid() == 0:
        pytest.skip("root writes into any folder")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    dest, why = {
        "a folder": (tmp_path, "exists and is a folder, not a file"),
        "below a file": (blocker / "res" / "bench.json", f"{blocker} is a file, not a folder"),
        "unwritable": (locked / "bench.json", f"folder {locked} is not writable"),
    }[case]
    argv = ["bench", "--target", str(tmp_path / "no-target"), "--drafter", str(tmp_path / "d"), "--json", str(dest)]
    assert main(argv) == 2
    assert f"--json {dest}: {why}" in _one_error_line(capsys)
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("deep_k", [[], ["--deep-k", "warn"]])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_k_deeper_than_the_cache_is_a_usage_error(assets, command, deep_k, tmp_path, capsys):
    """--k 100000 on a 128-position target: one line, exit 2, before the target loads (not the
    deep-k error, and not minutes of compiling with --deep-k warn)."""
    root, _ = assets
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w5 w6"}\n')
    argv = [command, "--target", str(root / "target"), "--drafter", str(root / "drafter"), *deep_k]
    if command == "generate":
        argv += ["--k", "100000", "--prompt-ids", "1,2"]
    else:
        argv += ["--k", "3,100000", "--prompts", str(prompts), "--max-new-tokens", "2"]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert "--k: k=100000 does not fit the target's max_position_embeddings=128" in line, line
    assert "need 2k+4=200004 positions; the largest k is 62" in line, line


def test_k_is_checked_against_the_cache_at_both_sides_of_the_boundary(assets):
    """The largest k whose smallest call (1-token prompt, 1 new token) fits still generates; one
    more is a ValueError naming k and the cache length, raised by the constructor."""
    root, target = assets
    drafter = pj.load_drafter(root / "drafter")
    assert largest_k(128) == 62 and largest_k(64) == 30
    for cache_len, largest, named in ((None, 62, "max_position_embeddings=128"), (64, 30, "cache_len=64")):
        with pytest.warns(UserWarning, match="trained depth"):
            dec = SpeculativeDecoder(target, drafter, k=largest, deep_k="warn", cache_len=cache_len)
        assert len(dec.generate([[5]], max_new_tokens=1).tokens[0]) == 1
        want = rf"k={largest + 1} does not fit .*{re.escape(named)}.*the largest k is {largest}$"
        with pytest.raises(ValueError, match=want):
            SpeculativeDecoder(target, drafter, k=largest + 1, deep_k="warn", cache_len=cache_len)


def test_text_prompts_without_a_tokenizer_name_the_target():
    import types

    from infer.load import source_prompt_ids

    with pytest.raises(ValueError, match="need a tokenizer, and /x/target has none"):
        source_prompt_ids(types.SimpleNamespace(tokenizer=None, path="/x/target"), "mtbench")
