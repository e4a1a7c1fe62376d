"""The user docs: docs/benchmarks.md is what bench/results/*.json renders, every result names its
command, hardware, commit and date, and no doc narrates how it was written."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RESULT_FILES = sorted(RESULTS.glob("*.json"))
DOCS = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md", ROOT / "CHANGELOG.md"]
NARRATION = re.compile(r"this session|sessions|session |no device was lent|\bissue \d+", re.IGNORECASE)


def render(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.render_results", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_benchmarks_doc_is_rendered_from_results():
    out = render("--check")
    assert out.returncode == 0, out.stderr


def test_check_fails_on_a_changed_result(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    path = results / RESULT_FILES[0].name
    data = json.loads(path.read_text())
    data["rows"][0][-1] = "changed"
    path.write_text(json.dumps(data))
    out = render("--check", "--results", str(results), "--doc", str(ROOT / "docs" / "benchmarks.md"))
    assert out.returncode == 1
    assert "out of date" in out.stderr


def test_there_are_results():
    assert len(RESULT_FILES) >= 5


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_result_names_its_provenance(path):
    data = json.loads(path.read_text())
    for key in ("title", "command", "hardware", "commit", "date"):
        assert data.get(key), f"{path.name}: no {key}"
    assert "jax" in data, f"{path.name}: no jax (null when not recorded)"
    assert re.fullmatch(r"[0-9a-f]{7,40}", data["commit"]), data["commit"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]), data["date"]
    assert all(len(row) == len(data["columns"]) for row in data["rows"])


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_narration(path):
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1) if NARRATION.search(line)]
    assert not hits, f"{path.relative_to(ROOT)} narrates how it was made:\n" + "\n".join(hits)


def _doc_default(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return f"`{' '.join(map(str, value))}`" if value else "none"
    return f"`{value}`"


def test_the_training_guide_lists_every_flag_with_its_default():
    import dataclasses
    import re

    from train.config import TrainConfig

    text = (ROOT / "docs" / "training.md").read_text()
    rows = dict(re.findall(r"^\| `--([\w.]+)` \| [^|]+ \| ([^|]+) \|", text, flags=re.M))

    def defaults(obj, prefix=""):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            yield from defaults(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else [(prefix + f.name, v)]

    cfg = TrainConfig()
    missing = [n for n, _ in defaults(cfg) if n.count(".") and n not in rows]
    wrong = {
        n: (rows[n].strip(), _doc_default(v))
        for n, v in defaults(cfg)
        if n in rows and rows[n].strip() != _doc_default(v)
    }
    assert not missing, f"docs/training.md lacks rows for {missing}"
    assert not wrong, f"docs/training.md defaults differ (doc, code): {wrong}"
