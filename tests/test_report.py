"""`python -m infer.report --smoke`: the whole pipeline (data, both heads trained by `python -m
train`, evaluation, results.json, plots, report) on the tiny preset, then a rerun that reuses
every finished stage, the one-line errors, and the rendering of the paper's published figures as
reference columns beside ours."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infer.report import main
from infer.report.reference import acceptance
from infer.report.render import markdown

ROOT = Path(__file__).resolve().parents[1]

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
    assert res["settings"]["smoke"] is True
    assert res["settings"]["ks"] == [2]
    assert res["settings"]["batches"] == [2]
    assert set(res["stages"]) == {"data", "train-parallel", "train-chain", "eval-mtbench-b2", "eval-humaneval-b2"}
    for name, stage in res["stages"].items():
        assert stage["seconds"] > 0, name
        assert stage["commands"], name
    assert "--model.mode chain" in res["stages"]["train-chain"]["commands"][0]
    # the data stage trains nothing (the trainer's data.prepare_only): its data statistics, no head
    assert "--data.prepare_only true" in res["stages"]["data"]["commands"][0]
    assert not (root / "work" / "data" / "checkpoints").exists()
    assert not (root / "work" / "data" / "head").exists()
    assert json.loads((root / "work" / "data" / "summary.json").read_text())["data"]["train_tokens"] > 0
    assert "goals" not in res  # no pass/miss scorecard in the results


def test_smoke_rows_measure_both_heads_losslessly(smoke):
    root, _ = smoke
    res = json.loads((root / "report" / "results.json").read_text())
    rows = res["results"]
    assert {(r["head"], r["dataset"], r["k"], r["batch"]) for r in rows} == {
        (h, d, 2, 2) for h in ("P-EAGLE", "EAGLE-3") for d in ("mtbench", "humaneval")
    }
    for r in rows:
        for key in ("tokens_per_second", "baseline_tokens_per_second", "speedup", "drafter_ms", "verify_ms"):
            assert r[key] > 0, key
        assert r["acceptance_length"] >= 1.0
        assert len(r["per_position_acceptance"]) == 2
        assert r["prompts"] == 2
        assert r["new_tokens"] > 0
        assert r["greedy_mismatches"] == 0  # greedy speculative decoding is lossless
    assert res["greedy"] == {"equal": 8, "total": 8}  # 2 heads x 2 sets x 2 prompts
    # the same data and budget for both heads, and the trainer's own summaries
    p, c = res["training"]["P-EAGLE"], res["training"]["EAGLE-3"]
    assert (p["mode"], c["mode"]) == ("parallel", "chain")
    assert p["steps"] == c["steps"] == 4
    assert p["train_tokens"] == c["train_tokens"]
    assert p["train_tokens"] > 0


def test_smoke_report_writes_plots_and_markdown(smoke):
    root, _ = smoke
    for name in ("acceptance_length_vs_k.png", "speedup_vs_k.png", "per_position_acceptance.png"):
        assert (root / "report" / name).read_bytes()[:4] == b"\x89PNG", name
    md = (root / "report.md").read_text()
    for text in (
        "## Reference: the paper's published figures",
        "## Best K (batch 2)",
        "Cost model",
        "Greedy outputs equal to plain decoding: **8 / 8**",
        "python -m train",
    ):
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
    assert err.count(": reused (") == 5
    assert "running python -m train" not in err
    assert {f: f.stat().st_mtime_ns for f in stage_files} == before
    assert json.loads((root / "report" / "results.json").read_text())["greedy"]["total"] == 8


def test_rerun_with_other_settings_names_the_flag(smoke, capsys):
    root, argv = smoke
    assert main([*argv, "--budget", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: --budget:")
    assert "another --work" in err[0]


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
    assert len(err) == 1, err
    assert flag in err[0], err


def test_python_dash_m_runs_the_package():
    proc = subprocess.run(
        [sys.executable, "-m", "infer.report", "--batches", "0"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: python -m infer.report: argument --batches")


# ---------------------------------------------------------------- rendering from a results dict


def _row(head, dataset, k, acceptance_length, speedup, model_speedup, batch=1):
    return dict(
        head=head, mode={"P-EAGLE": "parallel", "EAGLE-3": "chain"}[head], dataset=dataset, k=k, batch=batch,
        acceptance_length=acceptance_length, per_position_acceptance=[0.5] * k, tokens_per_second=10.0 * speedup,
        baseline_tokens_per_second=10.0, speedup=speedup, drafter_ms=2.0, verify_ms=110.0, prompts=2, new_tokens=16,
        ms_per_round=120.0, greedy_mismatches=0, model_speedup=model_speedup, verify_steps=1.1,
    )  # fmt: skip


def _results(ks=(3, 7)):
    """A results dict as `collect` writes it: both sets at batch 1; P-EAGLE best at K=7 (measured
    and modelled), EAGLE-3 at K=3."""
    numbers = {  # (head, K): acceptance length, speedup, model speedup
        ("P-EAGLE", 3): (2.0, 1.1, 1.5),
        ("P-EAGLE", 7): (3.0, 1.3, 2.4),
        ("EAGLE-3", 3): (2.0, 1.0, 1.8),
        ("EAGLE-3", 7): (2.4, 0.8, 1.7),
        ("P-EAGLE", 2): (1.5, 1.0, 1.2),
        ("EAGLE-3", 2): (1.4, 0.9, 1.1),
    }
    rows = [
        _row(h, d, k, *numbers[(h, k)]) for d in ("mtbench", "humaneval") for h in ("P-EAGLE", "EAGLE-3") for k in ks
    ]
    training = {
        "mode": "parallel", "steps": 4, "train_tokens": 100, "train_seconds": 1.0, "final_loss": 1.0,
        "per_depth_accuracy": [0.5], "simulated_acceptance_length": 1.5,
    }  # fmt: skip
    return {
        "settings": {
            "target": "t", "smoke": False, "budget": 1.0, "steps": 4, "regenerate": True, "prompts_per_set": 2,
            "max_new_tokens": 16, "max_prompt_tokens": 64, "ks": list(ks), "batches": [1], "temperature": 0.0,
        },
        "hardware": {
            "platform": "p", "cpu": "c", "cpu_count": 2, "jax_backend": "cpu", "devices": ["cpu:0"], "python": "3",
            "jax": "0",
        },
        "command": "python -m infer.report",
        "stages": {"data": {"seconds": 1.0, "commands": ["python -m train"], "load_average": None}},
        "wall_seconds_this_run": 1.0,
        "training": {"P-EAGLE": training, "EAGLE-3": {**training, "mode": "chain"}},
        "greedy": {"equal": len(rows) * 2, "total": len(rows) * 2},
        "baseline": [
            {"dataset": d, "batch": 1, "tokens_per_second": 10.0, "new_tokens": 16, "prompts": 2, "step_ms": 100.0}
            for d in ("mtbench", "humaneval")
        ],
        "results": rows,
        "plots": [],
    }  # fmt: skip


def _section(md: str, title: str) -> str:
    """The text of the section `## title`, up to the next section."""
    start = md.index(f"## {title}\n")
    end = md.find("\n## ", start + 1)
    return md[start : end if end >= 0 else len(md)]


def _cells(section: str, first: str) -> list[str]:
    """The cells of the table row whose first cell is `first` (the only one)."""
    rows = [ln for ln in section.splitlines() if ln.startswith(f"| {first} |")]
    assert len(rows) == 1, rows
    return [c.strip() for c in rows[0].strip("|").split("|")]


def _column(section: str, name: str) -> int:
    header = next(ln for ln in section.splitlines() if ln.startswith("| "))
    return [c.strip() for c in header.strip("|").split("|")].index(name)


def test_the_paper_figures_are_reference_columns_beside_ours():
    md = markdown(_results(), "report")
    for dataset, paper in (("mtbench", "3.70 / 3.27"), ("humaneval", "3.94 / 3.03")):
        sec = _section(md, f"{dataset}, batch 1")
        col = _column(sec, "paper accept P / E")
        assert _cells(sec, "7")[col] == paper, dataset  # published at K=7 only
        assert _cells(sec, "3")[col] == "-", dataset
        assert _cells(sec, "7")[_column(sec, "accept P-EAGLE")] == "3.000", dataset  # ours beside it
        assert _cells(sec, "7")[_column(sec, "accept EAGLE-3")] == "2.400", dataset


def test_the_reference_section_names_its_source_and_every_published_figure():
    sec = _section(markdown(_results(), "report"), "Reference: the paper's published figures")
    assert "GPT-OSS-20B" in sec
    assert "B200" in sec
    assert "different target" in sec
    assert _cells(sec, "HumanEval")[1:3] == ["3.94", "3.03"]
    assert _cells(sec, "SPEED-Bench")[1:3] == ["3.38", "2.59"]
    assert _cells(sec, "MT-Bench")[1:3] == ["3.70", "3.27"]
    assert "1.05-1.69x over the best EAGLE-3 setting" in sec
    assert "P-EAGLE peaks at K=7, EAGLE-3 at K=3" in sec


def test_best_k_shows_ours_with_the_paper_beside_it():
    sec = _section(markdown(_results(), "report"), "Best K (batch 1)")
    rows = [ln for ln in sec.splitlines() if ln.startswith("| mtbench |")]
    assert len(rows) == 2  # measured and cost model
    measured, model = ([c.strip() for c in ln.strip("|").split("|")] for ln in rows)
    assert measured[:6] == ["mtbench", "measured", "K=7 / K=3", "1.30x", "1.00x", "1.30x"]
    assert model[:6] == ["mtbench", "cost model", "K=7 / K=3", "2.40x", "1.80x", "1.33x"]
    assert measured[6:] == ["K=7 / K=3", "1.05-1.69x"]
    assert model[6:] == ["K=7 / K=3", "1.05-1.69x"]


def test_without_k7_no_row_claims_a_paper_acceptance():
    md = markdown(_results(ks=(2, 3)), "report")
    sec = _section(md, "mtbench, batch 1")
    col = _column(sec, "paper accept P / E")
    assert [_cells(sec, k)[col] for k in ("2", "3")] == ["-", "-"]
    assert "## Reference: the paper's published figures" in md  # the figures are still shown once


def test_the_report_has_no_verdicts():
    md = markdown(_results(), "report").lower()
    for word in ("**pass**", "**miss**", "goal", "missed", "session"):
        assert word not in md, word


def test_paper_acceptance_is_published_at_k7_only():
    assert acceptance("mtbench", 7) == (3.70, 3.27)
    assert acceptance("humaneval", 7) == (3.94, 3.03)
    assert acceptance("mtbench", 3) is None
    assert acceptance("unknown", 7) is None


def test_the_committed_report_is_a_full_run_and_its_markdown_is_generated():
    """docs/report/results.json holds the full default run (every head, set, K and batch with the
    issue's keys, every greedy output equal to plain decoding) and docs/report.md is exactly what
    `infer.report.render.markdown` writes from it (no hand edits)."""
    docs = ROOT / "docs"
    res = json.loads((docs / "report" / "results.json").read_text())
    s = res["settings"]
    assert not s["smoke"]
    assert s["ks"] == [1, 3, 5, 7]
    assert s["batches"] == [1, 4]
    want = {
        (h, d, k, b)
        for h in ("P-EAGLE", "EAGLE-3")
        for d in ("mtbench", "humaneval")
        for k in s["ks"]
        for b in s["batches"]
    }
    assert {(r["head"], r["dataset"], r["k"], r["batch"]) for r in res["results"]} == want
    for r in res["results"]:
        assert r["acceptance_length"] >= 1.0
        assert len(r["per_position_acceptance"]) == r["k"]
        assert r["tokens_per_second"] > 0
        assert r["baseline_tokens_per_second"] > 0
        assert r["prompts"] == 8
        assert r["greedy_mismatches"] == 0
    assert res["greedy"]["equal"] == res["greedy"]["total"] == 256
    assert res["training"]["P-EAGLE"]["train_tokens"] == res["training"]["EAGLE-3"]["train_tokens"]
    assert (docs / "report.md").read_text() == markdown(res, "report")
