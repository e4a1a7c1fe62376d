"""`python -m bench.learning_efficiency`'s bookkeeping (no training): a variant's --bench.epochs leaves the
trainer's flags, a run compares with the base it recorded (older runs: by their name), and a
publication lists the data's command, each run's own command, then its own."""

from __future__ import annotations

import importlib
import json


def load_bench():
    return importlib.import_module("bench.learning_efficiency")


def result(variant, acceptance, base=None, command=None, budget=19200):
    heldout = {"acceptance": acceptance, "se": 0.01, "by_depth": [0.2, 0.01, 0.0, 0.0]}
    res = {"trainer": "ours", "variant": variant, "budget": budget, "seed": 0, "tokens": budget, "train_s": 100.0}
    res |= {"heldout": heldout, "base": base}
    if command:
        res["command"] = command
    return res


def test_bench_epochs_leaves_the_trainer_flags():
    bench = load_bench()
    assert bench.bench_epochs(["--loop.ce_weight", "1"]) == (["--loop.ce_weight", "1"], 1)
    flags = ["--optim.lr", "3e-3", "--bench.epochs", "2", "--data.batch_size", "2"]
    assert bench.bench_epochs(flags) == (["--optim.lr", "3e-3", "--data.batch_size", "2"], 2)


def test_levers_compare_with_their_recorded_base_and_old_runs_by_name():
    bench = load_bench()
    runs = [
        result("adamw", 1.10),
        result("muon", 1.15),  # an older run without a base: compared with adamw by its name
        result("muon_lr3e-3", 1.20),  # muon_*: with muon
        result("default", 1.22, base="default"),  # the base itself: no comparison
        result("ce1", 1.30, base="default"),
    ]
    rows = {row[2]: row for row in bench.lever_rows(runs)}
    assert rows["muon"][5] == "+0.050 vs adamw"
    assert rows["muon_lr3e-3"][5] == "+0.050 vs muon"
    assert rows["default"][5] == ""
    assert rows["ce1"][5] == "+0.080 vs default"


def test_publish_lists_the_commands_and_keeps_the_efficiency_table(tmp_path, monkeypatch):
    bench = load_bench()
    results_dir = tmp_path / "bench" / "results"
    results_dir.mkdir(parents=True)
    efficiency = results_dir / "learning_efficiency.json"
    efficiency.write_text('{"kept": true}')
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    runs = [
        result("default", 1.22, base="default", command="python -m bench.learning_efficiency --work DIR --a"),
        result("ce1", 1.30, base="default", command="python -m bench.learning_efficiency --work DIR --b"),
        result("ce05", 1.25, base="default", command="python -m bench.learning_efficiency --work DIR --b"),
    ]
    bench.publish(runs, "python -m bench.learning_efficiency --work DIR --publish", "levers_x")
    table = json.loads((results_dir / "levers_x.json").read_text())
    assert table["command"] == [
        bench.DATA_COMMAND,
        "python -m bench.learning_efficiency --work DIR --a",
        "python -m bench.learning_efficiency --work DIR --b",
        "python -m bench.learning_efficiency --work DIR --publish",
    ]
    assert [row[2] for row in table["rows"]] == ["ce05", "ce1", "default"]
    assert json.loads(efficiency.read_text()) == {"kept": True}  # no speculators runs: not rewritten


def test_speculators_default_is_compared_with_ours_and_the_per_round_figure_shown():
    bench = load_bench()
    theirs = result("default", 1.23, base="default") | {"trainer": "speculators"}
    theirs["heldout"] = theirs["heldout"] | {"per_round": 1.2, "per_round_se": 0.015}
    rows = {(row[1], row[2]): row for row in bench.lever_rows([result("default", 1.18, base="default"), theirs])}
    assert rows[("speculators", "default")][5] == "+0.050 vs default"
    assert rows[("ours", "default")][5] == ""  # not against itself
    assert rows[("speculators", "default")][6] == "1.200 ± 0.015"
    assert rows[("ours", "default")][6] == "-"  # scored before the walk was recorded
