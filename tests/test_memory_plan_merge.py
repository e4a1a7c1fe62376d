"""bench/memory_plan.py --publish --merge: a few cases planned again replace the published rows of
their programs in place and keep the rest, their "Longest ..." notes replace the old ones, and
each program keeps the commit it was planned at across merges. (The plans themselves need the compile venv.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "memory_plan.py"


def _module():
    spec = importlib.util.spec_from_file_location("memory_plan_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_merged_replaces_each_key_in_place_and_appends_new_keys():
    mod = _module()
    old = [("a", 1), ("b", 1), ("b", 2), ("c", 1)]
    new = [("b", 9), ("d", 9), ("b", 8)]
    assert mod.merged(old, new, lambda x: x[0]) == [("a", 1), ("b", 9), ("b", 8), ("c", 1), ("d", 9)]


def test_a_merged_publish_keeps_the_other_rows_and_notes(tmp_path, monkeypatch):
    mod = _module()
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    longest = "Longest training sequence (powers of two), L x32 parallel on "
    old = {
        "commit": "aaa",
        "date": "2026-11-01",
        "rows": [["L x32", "h100", "train/parallel", "4,096"], ["L x32", "v5p-8", "train/parallel", "4,096"]],
        "notes": [longest + "h100: 4,096 tokens.", longest + "v5p-8: 4,096 tokens.", "a fixed note, old text"],
    }
    (tmp_path / "bench" / "results" / "plan.json").write_text(json.dumps(old))
    new = {
        "commit": "bbb",
        "date": "2026-12-03",
        "rows": [["L x32", "v5p-8", "train/parallel", "8,192"], ["L x32", "v5p-8", "train/parallel", "16,384"]],
        "notes": [longest + "v5p-8: 16,384 tokens.", "a fixed note, new text"],
    }
    data = json.loads(mod.write_published(new, "plan", merge=True).read_text())
    assert [r[1:] for r in data["rows"]] == [
        ["h100", "train/parallel", "4,096"],
        ["v5p-8", "train/parallel", "8,192"],
        ["v5p-8", "train/parallel", "16,384"],
    ]
    assert data["notes"] == [
        longest + "h100: 4,096 tokens.",
        longest + "v5p-8: 16,384 tokens.",
        "a fixed note, new text",
        "Planned at bbb (2026-12-03): L x32 train/parallel on v5p-8. The other rows: at aaa (2026-11-01).",
    ]
    # a second merge on top: each program keeps the commit it was planned at
    newer = {"commit": "ccc", "date": "2026-12-04", "rows": [["L x32", "h200", "train/parallel", "4,096"]], "notes": []}
    data = json.loads(mod.write_published(newer, "plan", merge=True).read_text())
    assert data["planned_at"] == {
        "L x32 train/parallel on h100": "aaa (2026-11-01)",
        "L x32 train/parallel on v5p-8": "bbb (2026-12-03)",
        "L x32 train/parallel on h200": "ccc (2026-12-04)",
    }
    assert data["notes"][-1] == (
        "Planned at bbb (2026-12-03): L x32 train/parallel on v5p-8. Planned at ccc (2026-12-04): L x32 "
        "train/parallel on h200. The other rows: at aaa (2026-11-01)."
    )
    unmerged = json.loads(mod.write_published(dict(new, notes=[]), "plan", merge=False).read_text())
    assert len(unmerged["rows"]) == 2  # a full publish writes only what it planned
