"""`python -m infer generate|bench` on a tiny target that has a tokenizer and a chat template."""

from __future__ import annotations

import json
import subprocess
import sys

import hf_tiny
import pytest

import peagle_jax as pj
from infer import SpeculativeDecoder
from infer.__main__ import main


def _word_tokenizer(folder) -> None:
    """A word-level tokenizer over w0..w{V-1} with a chat template, saved beside the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(hf_tiny.VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.chat_template = "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}w4"
    fast.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    hf_tiny.build("llama-gqa2-tied-llama3", root / "target")
    _word_tokenizer(root / "target")
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
    cmd = [
        sys.executable,
        "-m",
        "infer",
        "generate",
        "--target",
        str(tmp_path / "nope"),
        "--drafter",
        str(root / "drafter"),
        "--prompt",
        "w1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1  # the work failed: a folder it cannot use
    assert proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "nope" in errors[0]
    assert proc.stderr.strip().splitlines()[-1] == errors[0]
    no_drafter = subprocess.run(
        [sys.executable, "-m", "infer", "generate", "--target", str(root / "target"), "--prompt", "w1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert no_drafter.returncode == 2
    assert "--drafter" in no_drafter.stderr


@pytest.mark.parametrize("argv", [["generate"], ["bench", "--target", "x", "--k", "seven"], ["nope"], []])
def test_usage_errors_are_one_line(argv, capsys):
    """argparse's own errors (missing flag, bad int, unknown command) are one line too, exit 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: python -m infer"), err
