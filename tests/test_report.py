"""`python -m report --smoke`: the whole pipeline (data, the three heads P-EAGLE, EAGLE-3 and
DFlash trained by `python -m train`, evaluation, results.json, plots, report) on the tiny preset,
then a rerun that reuses every finished stage, an evaluation of other heads redone, the one-line
errors, and the rendering (every head's columns, the ratios, the paper's published figures as
reference columns beside ours, a two-head run as it always rendered)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from report import main
from report.common import HEADS
from report.reference import acceptance
from report.render import markdown
from report.stages import Stages, train_settings, trainer_command

ROOT = Path(__file__).resolve().parents[1]
LABELS = ("P-EAGLE", "EAGLE-3", "DFlash")
STAGES = {"data", "train-parallel", "train-chain", "train-dflash", "eval-mtbench-b2", "eval-humaneval-b2"}

# the lightest smoke: one K, one batch size of 2 (the batched path), 2 prompts per set
FAST = ["--ks", "2", "--batches", "2"]


SMOKE = pytest.mark.slow  # the --smoke run of every stage: ~95 s of the 2-core CI


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    argv = ["--smoke", "--out", str(root / "report"), "--work", str(root / "work"), *FAST]
    assert main(argv) == 0
    return root, argv


@SMOKE
def test_smoke_report_writes_every_result(smoke):
    root, _ = smoke
    res = json.loads((root / "report" / "results.json").read_text())
    assert res["settings"]["smoke"] is True
    assert res["settings"]["ks"] == [2]
    assert res["settings"]["batches"] == [2]
    assert res["settings"]["heads"] == list(LABELS)
    assert res["settings"]["dflash_block_size"] == 3  # max K + 1
    assert set(res["stages"]) == STAGES
    for name, stage in res["stages"].items():
        assert stage["seconds"] > 0, name
        assert stage["commands"], name
    assert "--model.mode chain" in res["stages"]["train-chain"]["commands"][0]
    assert "--model.mode dflash --loop.steps 4 --model.block_size 3" in res["stages"]["train-dflash"]["commands"][0]
    assert "--model.block_size" not in res["stages"]["train-parallel"]["commands"][0]
    # the data stage trains nothing (the trainer's data.prepare_only): its data statistics, no head
    assert "--data.prepare_only true" in res["stages"]["data"]["commands"][0]
    assert not (root / "work" / "data" / "checkpoints").exists()
    assert not (root / "work" / "data" / "head").exists()
    assert json.loads((root / "work" / "data" / "summary.json").read_text())["data"]["train_tokens"] > 0
    assert "goals" not in res  # no pass/miss scorecard in the results


@SMOKE
def test_smoke_rows_measure_every_head_losslessly(smoke):
    root, _ = smoke
    res = json.loads((root / "report" / "results.json").read_text())
    rows = res["results"]
    assert {(r["head"], r["dataset"], r["k"], r["batch"]) for r in rows} == {
        (h, d, 2, 2) for h in LABELS for d in ("mtbench", "humaneval")
    }
    assert {(r["head"], r["mode"]) for r in rows} == {
        ("P-EAGLE", "parallel"),
        ("EAGLE-3", "chain"),
        ("DFlash", "dflash"),
    }
    for r in rows:
        for key in ("tokens_per_second", "baseline_tokens_per_second", "speedup", "drafter_ms", "verify_ms"):
            assert r[key] > 0, key
        assert r["acceptance_length"] >= 1.0
        assert len(r["per_position_acceptance"]) == 2
        assert r["prompts"] == 2
        assert r["new_tokens"] > 0
        assert r["greedy_mismatches"] == 0  # greedy speculative decoding is lossless
    assert res["greedy"] == {"equal": 12, "total": 12}  # 3 heads x 2 sets x 2 prompts
    # the same data and budget for every head, and the trainer's own summaries
    p, c, d = (res["training"][h] for h in LABELS)
    assert (p["mode"], c["mode"], d["mode"]) == ("parallel", "chain", "dflash")
    assert p["steps"] == c["steps"] == d["steps"] == 4
    assert p["train_tokens"] == c["train_tokens"] == d["train_tokens"]
    assert p["train_tokens"] > 0


@SMOKE
def test_smoke_report_writes_plots_and_markdown(smoke):
    root, _ = smoke
    for name in ("acceptance_length_vs_k.png", "speedup_vs_k.png", "per_position_acceptance.png"):
        assert (root / "report" / name).read_bytes()[:4] == b"\x89PNG", name
    md = (root / "report.md").read_text()
    for text in (
        "# P-EAGLE vs EAGLE-3 vs DFlash vs plain decoding",
        "DFlash block size 3 (max K + 1",
        "## Reference: the paper's published figures",
        "## Best K (batch 2)",
        "Cost model",
        "Greedy outputs equal to plain decoding: **12 / 12**",
        "python -m train",
    ):
        assert text in md, text
    sec = _section(md, "mtbench, batch 2")
    for column in ("accept DFlash", "D/P accept", "speedup DFlash", "D/P speedup", "mismatches P / E / D"):
        assert _cells(sec, "2")[_column(sec, column)], column
    assert _cells(sec, "2")[_column(sec, "mismatches P / E / D")] == "0 / 0 / 0"
    assert _cells(sec, "DFlash")[1] == "2"  # its per-position acceptance row at K=2
    assert not list(root.glob(".report.*"))  # no temporary folder left beside OUT


@SMOKE
def test_rerun_reuses_finished_stages(smoke, capsys):
    root, argv = smoke
    stage_files = sorted((root / "work" / "stages").glob("*.json"))
    assert {f.stem for f in stage_files} == STAGES
    before = {f: f.stat().st_mtime_ns for f in stage_files}
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count(": reused (") == 6
    assert "running python -m train" not in err
    assert {f: f.stat().st_mtime_ns for f in stage_files} == before
    assert json.loads((root / "report" / "results.json").read_text())["greedy"]["total"] == 12


@SMOKE
def test_an_evaluation_of_other_heads_is_redone_and_the_trained_heads_reused(smoke, capsys):
    """A WORK from a two-head run: its evaluations measured P-EAGLE and EAGLE-3 only, so they are
    redone with all three heads; every finished training is reused."""
    root, argv = smoke
    for name in ("eval-mtbench-b2", "eval-humaneval-b2"):
        path = root / "work" / "stages" / f"{name}.json"
        record = json.loads(path.read_text())
        record["settings"]["heads"] = ["P-EAGLE", "EAGLE-3"]
        path.write_text(json.dumps(record))
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count(": reused (") == 4  # data and the three trainings
    assert err.count("(now ['P-EAGLE', 'EAGLE-3', 'DFlash']): redoing it") == 2
    assert "running python -m train" not in err
    res = json.loads((root / "report" / "results.json").read_text())
    assert {r["head"] for r in res["results"]} == set(LABELS)
    assert json.loads((root / "work" / "stages" / "eval-mtbench-b2.json").read_text())["settings"]["heads"] == list(
        LABELS
    )


@SMOKE
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


@pytest.mark.parametrize("name", ["report", "infer.report"])  # infer.report: the earlier name, forwarded
def test_python_dash_m_runs_the_package(name):
    proc = subprocess.run([sys.executable, "-m", name, "--batches", "0"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: python -m report: argument --batches")


# ---------------------------------------------------------------- stage records and trainer commands


def test_stages_reuse_a_record_redoes_other_heads_and_refuses_other_flags(tmp_path):
    stages = Stages(tmp_path)
    assert stages.reuse("eval-x", {"--ks": [1]}, {"heads": ["a"]}) is None  # not finished
    stages.finish("eval-x", {"--ks": [1]}, 1.0)  # a record of a run before the heads were recorded
    assert stages.reuse("eval-x", {"--ks": [1]}) is not None
    assert stages.reuse("eval-x", {"--ks": [1]}, {"heads": ["a"]}) is None  # stale: redone
    stages.finish("eval-x", {"--ks": [1], "heads": ["a"]}, 1.0)
    assert stages.reuse("eval-x", {"--ks": [1]}, {"heads": ["a"]})["settings"]["heads"] == ["a"]
    with pytest.raises(ValueError, match="^--ks: stage eval-x"):
        stages.reuse("eval-x", {"--ks": [2]}, {"heads": ["a"]})


def _args(ks=(1, 3, 5, 7)):
    return SimpleNamespace(
        smoke=False, target="t", regenerate=False, budget=1.0, ks=list(ks), train_flags=[], batch_size=1, heldout=0,
        steps=10,
    )  # fmt: skip


def test_dflash_trains_with_a_block_of_max_k_plus_one(tmp_path):
    args = _args()
    for mode in HEADS:
        cmd = trainer_command(args, tmp_path, mode, 10, "t")
        assert cmd[cmd.index("--model.mode") + 1] == mode
        assert ("--model.block_size" in cmd) == (mode == "dflash"), mode
    cmd = trainer_command(args, tmp_path, "dflash", 10, "t")
    assert cmd[cmd.index("--model.block_size") + 1] == "8"


def test_the_regenerated_conversations_keep_the_steps_within_one_epoch(tmp_path):
    """The committed run's 224 records gave 178 examples (a fifth dropped): 200 steps then passed
    over 174 training conversations again, and its last batches' simulated acceptance (1.81) was
    on text the head had fitted. The records asked for now leave a step for every conversation."""
    args = _args()
    args.regenerate, args.steps, args.heldout, args.regenerate_tokens = True, 200, 4, 128
    cmd = trainer_command(args, tmp_path, "parallel", 200, "t")
    records = int(cmd[cmd.index("--data.max_conversations") + 1])
    assert round(records * 178 / 224) - args.heldout >= args.steps * args.batch_size


def test_the_two_head_trainings_keep_their_settings_and_dflash_depends_on_the_ks():
    """A WORK of a two-head run reuses its trainings: their settings are what they were."""
    old = {"--smoke": False, "--target": "t", "--regenerate": False, "--budget": 1.0}
    assert train_settings(_args(), "parallel") == train_settings(_args(), "chain") == old
    assert train_settings(_args(), "dflash") == {**old, "--ks": [1, 3, 5, 7]}


# ---------------------------------------------------------------- rendering from a results dict


def _row(head, dataset, k, acceptance_length, speedup, model_speedup, batch=1):
    return dict(
        head=head, mode={"P-EAGLE": "parallel", "EAGLE-3": "chain", "DFlash": "dflash"}[head], dataset=dataset, k=k,
        batch=batch,
        acceptance_length=acceptance_length, per_position_acceptance=[0.5] * k, tokens_per_second=10.0 * speedup,
        baseline_tokens_per_second=10.0, speedup=speedup, drafter_ms=2.0, verify_ms=110.0, prompts=2, new_tokens=16,
        ms_per_round=120.0, greedy_mismatches=0, model_speedup=model_speedup, verify_steps=1.1,
    )  # fmt: skip


def _results(ks=(3, 7), heads=LABELS):
    """A results dict as `collect` writes it: both sets at batch 1; P-EAGLE best at K=7 (measured
    and modelled), EAGLE-3 at K=3, DFlash at K=7."""
    numbers = {  # (head, K): acceptance length, speedup, model speedup
        ("P-EAGLE", 3): (2.0, 1.1, 1.5),
        ("P-EAGLE", 7): (3.0, 1.3, 2.4),
        ("EAGLE-3", 3): (2.0, 1.0, 1.8),
        ("EAGLE-3", 7): (2.4, 0.8, 1.7),
        ("P-EAGLE", 2): (1.5, 1.0, 1.2),
        ("EAGLE-3", 2): (1.4, 0.9, 1.1),
        ("DFlash", 3): (2.2, 1.2, 2.0),
        ("DFlash", 7): (3.3, 1.5, 2.88),
        ("DFlash", 2): (1.6, 1.1, 1.3),
    }
    rows = [_row(h, d, k, *numbers[(h, k)]) for d in ("mtbench", "humaneval") for h in heads for k in ks]
    modes = {"P-EAGLE": "parallel", "EAGLE-3": "chain", "DFlash": "dflash"}
    training = {
        "mode": "parallel", "steps": 4, "train_tokens": 100, "train_seconds": 1.0, "final_loss": 1.0,
        "per_depth_accuracy": [0.5], "simulated_acceptance_length": 1.5, "heldout": {"eval_sim_tau": 1.3},
        "heldout_rounds": {"per_round": 1.2},
    }  # fmt: skip
    return {
        "settings": {
            "target": "t", "smoke": False, "budget": 1.0, "steps": 4, "regenerate": True, "prompts_per_set": 2,
            "max_new_tokens": 16, "max_prompt_tokens": 64, "ks": list(ks), "batches": [1], "temperature": 0.0,
            "heads": list(heads), "dflash_block_size": max(ks) + 1,
        },
        "hardware": {
            "platform": "p", "cpu": "c", "cpu_count": 2, "jax_backend": "cpu", "devices": ["cpu:0"], "python": "3",
            "jax": "0",
        },
        "command": "python -m report",
        "stages": {"data": {"seconds": 1.0, "commands": ["python -m train"], "load_average": None}},
        "wall_seconds_this_run": 1.0,
        "training": {h: {**training, "mode": modes[h]} for h in heads},
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


def test_the_training_table_gives_the_held_out_acceptance_beside_the_training_batches():
    cells = _cells(_section(markdown(_results(), "report"), "Training"), "P-EAGLE")
    assert cells[-3:] == ["1.50", "1.30", "1.20"]


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
    # best K P / E / D, best speedup of each head, P/E, D/P, then the paper's P / E
    assert measured[:8] == ["mtbench", "measured", "K=7 / K=3 / K=7", "1.30x", "1.00x", "1.50x", "1.30x", "1.15x"]
    assert model[:8] == ["mtbench", "cost model", "K=7 / K=3 / K=7", "2.40x", "1.80x", "2.88x", "1.33x", "1.20x"]
    assert measured[8:] == ["K=7 / K=3", "1.05-1.69x"]
    assert model[8:] == ["K=7 / K=3", "1.05-1.69x"]


def test_dflash_has_its_columns_and_ratios_over_p_eagle_in_every_set_table():
    md = markdown(_results(), "report")
    sec = _section(md, "mtbench, batch 1")
    header = next(ln for ln in sec.splitlines() if ln.startswith("| K |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    # HEADS order is column order; P/E before D/P
    assert columns[1:6] == ["accept P-EAGLE", "accept EAGLE-3", "accept DFlash", "P/E accept", "D/P accept"]
    k7 = _cells(sec, "7")
    assert k7[_column(sec, "accept DFlash")] == "3.300"
    assert k7[_column(sec, "D/P accept")] == "1.10x"  # 3.3 / 3.0
    assert k7[_column(sec, "P/E accept")] == "1.25x"  # 3.0 / 2.4
    assert k7[_column(sec, "speedup DFlash")] == "1.50x"
    assert k7[_column(sec, "D/P speedup")] == "1.15x"  # 1.5 / 1.3
    assert k7[_column(sec, "drafter ms P / E / D")] == "2.0 / 2.0 / 2.0"
    assert k7[_column(sec, "mismatches P / E / D")] == "0 / 0 / 0"
    assert _cells(sec, "7")[_column(sec, "paper accept P / E")] == "3.70 / 3.27"  # the paper: P-EAGLE vs EAGLE-3 only
    assert [ln.split("|")[1].strip() for ln in sec.splitlines() if ln.startswith("| DFlash |")] == ["DFlash"] * 2
    assert "Ratio columns: P/E = P-EAGLE over EAGLE-3, D/P = DFlash over P-EAGLE." in md


def test_the_settings_line_says_how_dflash_was_trained():
    md = markdown(_results(), "report")
    assert md.startswith("# P-EAGLE vs EAGLE-3 vs DFlash vs plain decoding\n")
    assert "all three heads: 4 training steps" in md
    assert "DFlash block size 8 (max K + 1: one pass drafts block size - 1 = 7 tokens" in md


def test_the_cost_model_has_every_head_and_both_ratios():
    sec = _section(markdown(_results(), "report"), "Cost model (a model, not a measurement)")
    assert "one pass over its block for DFlash" in sec
    header = next(ln for ln in sec.splitlines() if ln.startswith("| set |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[5:7] == ["P/E", "D/P"]
    row = next(ln for ln in sec.splitlines() if ln.startswith("| mtbench | 7 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[columns.index("model speedup DFlash")] == "2.88x"
    assert cells[columns.index("D/P")] == "1.20x"  # 2.88 / 2.4
    assert cells[columns.index("measured DFlash")] == "1.50x"


def test_a_two_head_run_renders_without_dflash():
    """The results of a run before DFlash (docs/report until it is rerun) have no DFlash columns."""
    md = markdown(_results(heads=("P-EAGLE", "EAGLE-3")), "report")
    assert md.startswith("# P-EAGLE vs EAGLE-3 vs plain decoding\n")
    assert "both heads: 4 training steps" in md
    for text in ("DFlash", "D/P", "P / E / D"):
        assert text not in md, text
    sec = _section(md, "Best K (batch 1)")
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in sec.splitlines() if ln.startswith("| mtbench |")]
    assert rows[0] == ["mtbench", "measured", "K=7 / K=3", "1.30x", "1.00x", "1.30x", "K=7 / K=3", "1.05-1.69x"]


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
    `report.render.markdown` writes from it (no hand edits)."""
    docs = ROOT / "docs"
    res = json.loads((docs / "report" / "results.json").read_text())
    s = res["settings"]
    assert not s["smoke"]
    assert s["ks"] == [1, 3, 5, 7]
    assert s["batches"] == [1, 4]
    heads = list(res["training"])  # two heads until the report is rerun with DFlash
    assert heads in (list(LABELS[:2]), list(LABELS))
    want = {(h, d, k, b) for h in heads for d in ("mtbench", "humaneval") for k in s["ks"] for b in s["batches"]}
    assert {(r["head"], r["dataset"], r["k"], r["batch"]) for r in res["results"]} == want
    for r in res["results"]:
        assert r["acceptance_length"] >= 1.0
        assert len(r["per_position_acceptance"]) == r["k"]
        assert r["tokens_per_second"] > 0
        assert r["baseline_tokens_per_second"] > 0
        assert r["prompts"] == 8
        assert r["greedy_mismatches"] == 0
    assert res["greedy"]["equal"] == res["greedy"]["total"] == 128 * len(heads)  # 2 sets x 4 K x 2 batches x 8 prompts
    assert len({res["training"][h]["train_tokens"] for h in heads}) == 1
    assert (docs / "report.md").read_text() == markdown(res, "report")


def test_commands_name_no_machine_folder(monkeypatch, tmp_path):
    """The report shows commands as a user types them: paths under the working directory relative
    to it, under the home folder as ~/..., any other path as it is."""
    from report.stages import shown

    home, work = tmp_path / "home", tmp_path / "home" / "project"
    work.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    cmd = [sys.executable, "-m", "train", "--out", str(work / "runs" / "a b"), "--model.target"]
    cmd += [str(home / ".cache" / "gemma"), "--data.source", "/data/x.jsonl"]
    assert shown(cmd) == "python -m train --out 'runs/a b' --model.target ~/.cache/gemma --data.source /data/x.jsonl"
    from report.evaluate import stage_times

    record = {"seconds": 1.0, "commands": [f"python -m infer bench --target {home}/.cache/gemma --drafter {work}/h"]}
    times = stage_times(record, {}, [{**record, "dataset": "mtbench", "batch": 1}])
    assert times["eval-mtbench-b1"]["commands"] == ["python -m infer bench --target ~/.cache/gemma --drafter h"]
