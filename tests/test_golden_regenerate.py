"""tests/golden/regenerate.py makes a set with the committed golden vectors' layout: the same files,
the same arrays and tensors (names, shapes, dtypes), a finite loss and valid draft ids."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

GOLDEN = Path(__file__).parent / "golden"
COMMITTED = GOLDEN / "peagle-tiny"


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _specs(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """name -> (shape, dtype) of an .npz or .safetensors file."""
    arrays = dict(np.load(path)) if path.suffix == ".npz" else load_file(str(path))
    return {k: (v.shape, v.dtype) for k, v in arrays.items()}


@pytest.mark.slow
@pytest.mark.skipif(not COMMITTED.is_dir(), reason=f"golden vectors not found at {COMMITTED}")
def test_regenerate_matches_the_committed_layout(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("speculators", exc_type=ImportError)
    subprocess.run([sys.executable, str(GOLDEN / "regenerate.py"), str(tmp_path), "--seed", "1"], check=True)
    out = tmp_path / "peagle-tiny"
    assert _files(out) == _files(COMMITTED)
    for name in _files(COMMITTED):
        if name.endswith((".npz", ".safetensors")):
            assert _specs(out / name) == _specs(COMMITTED / name), name
        elif name.endswith(".json"):
            assert json.loads((out / name).read_text()).keys() == json.loads((COMMITTED / name).read_text()).keys()

    rows, prop = np.load(out / "train_rows.npz"), np.load(out / "propose.npz")
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(float(rows["loss"]))
    assert float(rows["loss"]) > 0
    assert summary["loss"] == pytest.approx(float(rows["loss"]))
    vocab = json.loads((out / "target" / "config.json").read_text())["vocab_size"]
    ids = [int(prop["bonus"]), *prop["drafts"].tolist()]
    assert all(0 <= i < vocab for i in ids)
    assert summary["propose"] == ids
    t2d = load_file(str(out / "drafter-speculators" / "model.safetensors"))["t2d"]
    assert t2d[prop["drafts"]].all()  # drafts come from the draft vocabulary
