"""`python -m bench.memory_plan --publish`: with --merge, a few cases planned again replace the published rows
of their programs in place and keep the rest, their "Longest ..." notes replace the old ones, and
each program keeps the commit it was planned at across merges; the what-fits table is read off the
published rows. (The plans themselves need the compile venv.)"""

from __future__ import annotations

import importlib
import json


def _module():
    return importlib.import_module("bench.memory_plan")


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


def test_a_merged_serving_case_replaces_only_its_batch_and_cache(tmp_path, monkeypatch):
    """Serving rows are cases of their own: planning the 32k cache again keeps the 8k rows of the
    same program, and the note names a program's cases only when some of them are older."""
    mod = _module()
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)

    def publish(commit: str, rows: list) -> dict:
        new = {"commit": commit, "date": "2026-12-01", "rows": rows, "notes": []}
        return json.loads(mod.write_published(new, "plan", merge=True).read_text())

    serve = [["L x32", "v5p-8", "serve/decode", f"batch {b}", c] for c in ("8,192", "32,768") for b in (1, 16)]
    train = [["L x32", d, "train/parallel", "4,096", "-"] for d in ("h100", "h200", "v5e-8", "v6e-8")]
    publish("aaa", [serve[0], serve[1], train[0]])
    data = publish("bbb", [serve[2] + ["new"], serve[3] + ["new"]])
    assert data["rows"] == [serve[0], serve[1], train[0], serve[2] + ["new"], serve[3] + ["new"]]
    assert data["planned_at"]["L x32 serve/decode on v5p-8 (batch 16, cache 8,192)"] == "aaa (2026-12-01)"
    assert data["notes"][-1] == (
        "Planned at bbb (2026-12-01): L x32 serve/decode on v5p-8 (batch 1, cache 32,768); L x32 serve/decode on "
        "v5p-8 (batch 16, cache 32,768). The other rows: at aaa (2026-12-01)."
    )
    publish("ccc", serve)  # every case of the program again: the note names it once
    data = publish("ddd", [*train, ["L x32", "v5p-16", "train/parallel", "4,096", "-"]])
    assert (
        data["notes"][-1]
        == "Planned at ccc (2026-12-01): L x32 serve/decode on v5p-8. The other rows: at ddd (2026-12-01)."
    )


def _row(device, program, size, cache, peak, verdict):
    return ["T x2", device, program, size, cache, "1.00", "1.00", peak, "80.0", "1.00", verdict, "10"]


def test_what_fits_is_the_largest_size_that_fits_per_device_and_program(tmp_path, monkeypatch):
    mod = _module()
    train, serve = "train/parallel", "serve/round/parallel"
    rows = [
        _row("h100", train, "16,384 tokens", "-", "90.00", "does not fit"),  # out of order on purpose
        _row("h100", train, "4,096 tokens", "-", "20.00", "fits"),
        _row("h100", train, "8,192 tokens", "-", "40.00", "fits"),
        _row("h100x8", train, "4,096 tokens", "-", "5.00", "fits"),
        _row("h100x8", train, "8,192 tokens", "-", "6.00", "fits"),
        _row("v5e-8", train, "4,096 tokens", "-", "-", "refused"),
        _row("h100", train + ", one segment", "4,096 tokens", "-", "99.00", "does not fit"),
        _row("h100x8", serve, "batch 1", "8,192", "30.00", "fits"),
        _row("h100x8", serve, "batch 16", "8,192", "40.00", "fits"),
        _row("h100x8", serve, "batch 64", "8,192", "90.00", "does not fit"),
        _row("h100x8", "serve/decode", "batch 64", "8,192", "50.00", "fits"),  # the decode step is not the round
        _row("v5p-8", serve, "batch 64", "8,192", "50.00", "fits"),
    ]
    cells = {c[0]: mod.fits_cell(rows, *c[1:]) for c in mod.FITS_COLUMNS}
    assert cells == {
        "train h100": "8,192",
        "train h100x8": "≥ 8,192",
        "train v5e-8": "none (4,096: refused)",
        "train v5p-8": "-",
        "train h100, one segment": "none (4,096: 99.00 GiB)",
        "serve GPU, cache 8,192": "16 on h100x8",
        "serve GPU, cache 32,768": "-",
        "serve v5p-8, cache 8,192": "64",
        "serve v5p-8, cache 32,768": "-",
    }
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    other = ["U x1", "h100", train, "4,096 tokens", "-", "1", "1", "2.00", "80.0", "78", "fits", "1"]
    data = json.loads(mod.publish_fits({"rows": [*rows, other]}).read_text())
    assert [row[:2] for row in data["rows"]] == [["T x2", "8,192"], ["U x1", "≥ 4,096"]]
    assert len(data["columns"]) == len(data["rows"][0]) == 1 + len(mod.FITS_COLUMNS)
