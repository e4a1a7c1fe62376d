"""`python -m infer.report --smoke`: the whole pipeline (data, both heads trained by `python -m
train`, evaluation, results.json, plots, report) on the tiny preset, then a rerun that reuses
every finished stage, and the one-line errors."""

from __future__ import annotations

import json

import pytest

from infer.report import goals, main

# the lightest smoke: one K, one batch size of 2 (the batched path), 2 prompts per set
FAST = ["--ks", "2", "--batches", "2"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    argv = ["--smoke", "--out", str(root / "report"), "--work", str(root / "work"), *FAST]
    assert main(argv) == 0
    return root, argv


def test_smoke_report_writes_every_result(smoke):
    root, _ = smoke
    res = json.loads((root / "report" / "results.json").read_text())
    assert res["settings"]["smoke"] is True and res["settings"]["ks"] == [2] and res["settings"]["batches"] == [2]
    assert set(res["stages"]) == {
        "data",
        "train-parallel",
        "train-chain",
        "eval-mtbench-b2",
        "eval-humaneval-b2",
    }
    assert all(s["seconds"] > 0 and s["commands"] for s in res["stages"].values())
    assert "--model.mode chain" in res["stages"]["train-chain"]["commands"][0]
    # the data stage trains nothing (the trainer's data.prepare_only): its data statistics, no head
    assert "--data.prepare_only true" in res["stages"]["data"]["commands"][0]
    assert not (root / "work" / "data" / "checkpoints").exists() and not (root / "work" / "data" / "head").exists()
    assert json.loads((root / "work" / "data" / "summary.json").read_text())["data"]["train_tokens"] > 0
    rows = res["results"]
    assert {(r["head"], r["dataset"], r["k"], r["batch"]) for r in rows} == {
        (h, d, 2, 2) for h in ("P-EAGLE", "EAGLE-3") for d in ("mtbench", "humaneval")
    }
    for r in rows:
        for key in ("tokens_per_second", "baseline_tokens_per_second", "speedup", "drafter_ms", "verify_ms"):
            assert r[key] > 0, key
        assert r["acceptance_length"] >= 1.0 and len(r["per_position_acceptance"]) == 2
        assert r["prompts"] == 2 and r["new_tokens"] > 0
        assert r["greedy_mismatches"] == 0  # greedy speculative decoding is lossless
    assert res["greedy"] == {"equal": 8, "total": 8}  # 2 heads x 2 sets x 2 prompts
    # the same data and budget for both heads, and the trainer's own summaries
    p, c = res["training"]["P-EAGLE"], res["training"]["EAGLE-3"]
    assert (p["mode"], c["mode"]) == ("parallel", "chain")
    assert p["steps"] == c["steps"] == 4 and p["train_tokens"] == c["train_tokens"] > 0
    assert len(res["goals"]) == 4 and {g["basis"] for g in res["goals"]} == {"measured", "cost model"}
    for name in ("acceptance_length_vs_k.png", "speedup_vs_k.png", "per_position_acceptance.png"):
        assert (root / "report" / name).read_bytes()[:4] == b"\x89PNG", name
    md = (root / "report.md").read_text()
    for text in ("## Goals", "Cost model", "Greedy outputs equal to plain decoding: **8 / 8**", "python -m train"):
        assert text in md, text
    assert not list(root.glob(".report.*"))  # no temporary folder left beside OUT


def test_rerun_reuses_finished_stages(smoke, capsys):
    root, argv = smoke
    stage_files = sorted((root / "work" / "stages").glob("*.json"))
    assert len(stage_files) == 5
    before = {f: f.stat().st_mtime_ns for f in stage_files}
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count(": reused (") == 5 and "running python -m train" not in err
    assert {f: f.stat().st_mtime_ns for f in stage_files} == before
    assert json.loads((root / "report" / "results.json").read_text())["greedy"]["total"] == 8


def test_rerun_with_other_settings_names_the_flag(smoke, capsys):
    root, argv = smoke
    assert main([*argv, "--budget", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --budget:") and "another --work" in err[0]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--smoke", "--target", "x"], "--target"),
        (["--smoke", "--out", "docs/report"], "--out"),  # a smoke run never writes into docs/
        (["--ks", "0"], "--ks"),
        (["--budget", "-1"], "--budget"),
    ],
)
def test_usage_errors_are_one_line(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err


def _row(head, k, acceptance, speedup, model_speedup, dataset="mtbench", batch=1):
    return dict(
        head=head, k=k, dataset=dataset, batch=batch, acceptance_length=acceptance, speedup=speedup,
        model_speedup=model_speedup,
    )  # fmt: skip


def test_goals_compare_the_heads_side_by_side():
    rows = [
        _row("P-EAGLE", 3, 2.0, 1.1, 1.5),
        _row("P-EAGLE", 7, 3.0, 1.3, 2.4),  # best measured and modelled at K=7
        _row("EAGLE-3", 3, 2.0, 1.0, 1.8),  # best at K=3
        _row("EAGLE-3", 7, 2.4, 0.8, 1.7),
        _row("P-EAGLE", 7, 9.0, 9.0, 9.0, batch=4),  # only the smallest batch counts
    ]
    measured, model = goals(rows, [3, 7])
    assert measured["basis"] == "measured" and model["basis"] == "cost model"
    assert measured["acceptance_ratio"] == pytest.approx(3.0 / 2.4) and measured["acceptance_goal_met"]
    assert (measured["best_k_peagle"], measured["best_k_eagle3"], measured["best_k_goal_met"]) == (7, 3, True)
    assert measured["speedup_ratio"] == pytest.approx(1.3) and measured["speedup_goal_met"]
    assert model["speedup_ratio"] == pytest.approx(2.4 / 1.8) and model["speedup_goal_met"]
    rows[1]["speedup"] = 1.05  # now P-EAGLE's best is K=3 at 1.1x, 1.1 / 1.0 < 1.2
    measured = goals(rows, [3, 7])[0]
    assert not measured["best_k_goal_met"] and not measured["speedup_goal_met"]


def test_the_committed_report_is_a_full_run_and_its_markdown_is_generated():
    """docs/report/results.json holds the full default run (every head, set, K and batch with the
    issue's keys, every greedy output equal to plain decoding) and docs/report.md is exactly what
    `infer.report.markdown` writes from it (no hand edits)."""
    from pathlib import Path

    from infer.report import markdown

    docs = Path(__file__).resolve().parents[1] / "docs"
    res = json.loads((docs / "report" / "results.json").read_text())
    s = res["settings"]
    assert not s["smoke"] and s["ks"] == [1, 3, 5, 7] and s["batches"] == [1, 4]
    want = {
        (h, d, k, b)
        for h in ("P-EAGLE", "EAGLE-3")
        for d in ("mtbench", "humaneval")
        for k in s["ks"]
        for b in s["batches"]
    }
    assert {(r["head"], r["dataset"], r["k"], r["batch"]) for r in res["results"]} == want
    for r in res["results"]:
        assert r["acceptance_length"] >= 1.0 and len(r["per_position_acceptance"]) == r["k"]
        assert r["tokens_per_second"] > 0 and r["baseline_tokens_per_second"] > 0 and r["prompts"] == 8
        assert r["greedy_mismatches"] == 0
    assert res["greedy"]["equal"] == res["greedy"]["total"] == 256
    assert res["training"]["P-EAGLE"]["train_tokens"] == res["training"]["EAGLE-3"]["train_tokens"]
    assert (docs / "report.md").read_text() == markdown(res, "report")
