"""`python -m infer bench` with several heads (`--drafter A --drafter B`) and several K in one
run: modes from the heads, every head and K interleaved with plain decoding, greedy outputs
checked prompt by prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import peagle_jax as pj
from infer.__main__ import main, parse_args
from infer.compare import head_summary
from train.tiny import build_tiny_target


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = pj.load_target(build_tiny_target(root / "target"), dtype="float32")
    pj.new_drafter(target, num_layers=1, mode="parallel", seed=1).save(root / "parallel")
    pj.new_drafter(target, num_layers=1, mode="chain", seed=2).save(root / "chain")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "w5 w6 w7"}\n{"prompt": "w1 w2"}\n{"prompt": "w9 w8 w7 w6"}\n')
    return root


def test_two_heads_side_by_side(heads, tmp_path, capsys):
    """Each head at K = 2 (every (head, K) pair compiles once: one K keeps this test short; several
    K go through the same loop, see test_k_lists_parse and tests/test_report.py)."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--target", str(heads / "target"), "--prompts", str(heads / "prompts.jsonl")]
    argv += ["--drafter", str(heads / "parallel"), "--drafter", str(heads / "chain"), "--k", "2"]
    argv += ["--batch-size", "2", "--max-new-tokens", "6", "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["batches"] == 2
    assert res["batch_size"] == 2
    assert res["baseline"]["tokens_per_second"] > 0
    runs = {(r["head"].rsplit("/", 1)[-1], r["k"]): r for r in res["runs"]}
    assert set(runs) == {("parallel", 2), ("chain", 2)}
    for (name, k), r in runs.items():
        assert r["mode"] == name  # inferred from the head
        assert r["prompts"] == 3
        assert r["greedy_mismatches"] == 0
        assert r["identical_greedy_outputs"] is True
        assert len(r["per_position_acceptance"]) == k
        assert r["acceptance_length"] >= 1.0
        for key in ("tokens_per_second", "baseline_tokens_per_second", "speedup", "drafter_ms", "verify_ms"):
            assert r[key] > 0, key
        assert r["baseline_tokens_per_second"] == res["baseline"]["tokens_per_second"]  # one shared baseline
    assert "speedup" not in res  # several runs: no single-drafter keys at the top
    table = capsys.readouterr().out
    assert table.count("parallel") >= 2
    assert table.count("chain") >= 2


def test_k_lists_parse(tmp_path):
    t, a, b = (str(tmp_path / name) for name in ("t", "a", "b"))
    for folder in (t, a, b):  # the flags name existing folders (checked before anything loads)
        Path(folder).mkdir()
    args = parse_args(["bench", "--target", t, "--drafter", a, "--drafter", b, "--k", "1, 3,7"])
    assert args.k == [1, 3, 7]
    assert args.drafter == [a, b]
    assert args.mode is None
    assert parse_args(["bench", "--target", t, "--drafter", a]).k == [7]
    assert parse_args(["generate", "--target", t, "--drafter", a, "--k", "3", "--prompt", "x"]).k == 3


def test_mismatches_are_counted_prompt_by_prompt():
    base = [{"new_tokens": 8, "seconds": 1.0, "tokens_per_second": 8.0}] * 2
    spec = [
        {"new_tokens": 8, "seconds": 0.5, "tokens_per_second": 16.0, "rounds": 4, "acceptance_length": 2.0,
         "per_position_acceptance": [1.0, 0.0], "same": [True, False]},
        {"new_tokens": 8, "seconds": 0.5, "tokens_per_second": 16.0, "rounds": 2, "acceptance_length": 1.0,
         "per_position_acceptance": [0.0, 0.0], "same": [False]},
    ]  # fmt: skip
    s = head_summary(base, spec, k=2, batch_size=2)
    assert s["greedy_mismatches"] == 2
    assert s["identical_greedy_outputs"] is False
    assert s["speedup"] == pytest.approx(2.0)
    assert s["acceptance_length"] == pytest.approx((2.0 * 4 + 1.0 * 2) / 6)
    assert s["per_position_acceptance"] == pytest.approx([4 / 6, 0.0])


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--drafter", "a", "--drafter", "a"], "--drafter"),
        (["--drafter", "a", "--k", "1,1"], "--k"),
        (["--drafter", "a", "--k", "0"], "--k"),
    ],
)
def test_bench_usage_errors_name_the_flag(extra, flag, capsys):
    assert main(["bench", "--target", "t", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert flag in err[0], err
