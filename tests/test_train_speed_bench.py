"""`python -m bench.train_speed` at a tiny size: both sides train (ours: the trainer's cached-features step;
theirs: speculators' PyTorch P-EAGLE step) on the same rows with positive step times, and their
first-step losses agree (same head, rows, features and objective)."""

from __future__ import annotations

import importlib
import json

import pytest

pytestmark = [pytest.mark.speculators, pytest.mark.filterwarnings("ignore::FutureWarning")]

pytest.importorskip("torch")
pytest.importorskip("speculators", exc_type=ImportError)


def test_train_speed_bench_tiny(tmp_path, capsys):
    mod = importlib.import_module("bench.train_speed")
    out = tmp_path / "speed.json"
    argv = ["--small", "--lengths", "48", "--repeats", "1", "--their-attn", "sdpa", "--json", str(out)]
    assert mod.main(argv) == 0
    assert "speculators sdpa" in capsys.readouterr().out
    res = json.loads(out.read_text())
    (r,) = res["results"]
    assert set(r["sides"]) == {"ours", "sdpa"}
    for side in r["sides"].values():
        assert side["median_ms"] > 0
        assert side["tokens_per_s"] > 0
        assert side["rows_per_s"] > 0
    # the same rows on both sides: the row count is one number, and the first losses agree
    assert r["rows"] == sum(r["rows_per_depth"])
    assert r["rows"] <= r["rows_padded"]
    assert r["sides"]["ours"]["rows_per_s"] * r["sides"]["ours"]["median_ms"] == pytest.approx(r["rows"] * 1e3)
    assert r["sides"]["sdpa"]["rows_per_s"] * r["sides"]["sdpa"]["median_ms"] == pytest.approx(r["rows"] * 1e3)
    assert r["loss_max_rel_diff"] < 1e-4, (r["loss_ours"], r["loss_theirs[sdpa]"])
    assert r["speedup"]["sdpa"] > 0
