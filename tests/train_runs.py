"""Shared pieces of the sharded and multi-host trainer tests: one tiny run configuration, its
single-device reference run (made once per pytest process), and the comparisons."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

# 3 steps of the tiny preset, 8 sequences per step (splits over up to 8 data x fsdp devices),
# checkpoints at steps 2 and 3, the held-out loss at the end; no speculative evaluation
FLAGS = [
    "--preset",
    "tiny",
    "--loop.steps",
    "3",
    "--data.batch_size",
    "8",
    "--loop.checkpoint_every",
    "2",
    "--eval.enabled",
    "false",
    "--loop.progress",
    "false",
]


def flags(target, out, mesh=None) -> list[str]:
    extra = []
    if mesh is not None:
        extra = ["--mesh.data", str(mesh[0]), "--mesh.fsdp", str(mesh[1]), "--mesh.tensor", str(mesh[2])]
    return [*FLAGS, "--model.target", str(target), "--out", str(out), *extra]


@functools.cache
def reference(root: str) -> tuple[Path, Path]:
    """(tiny target, OUT of the run on this process's one device), made once under `root`."""
    from train.__main__ import main
    from train.tiny import build_tiny_target

    target = build_tiny_target(Path(root) / "target")
    out = Path(root) / "one-device"
    if not (out / "summary.json").exists():
        assert main(flags(target, out)) == 0
    return target, out


def records(out: Path) -> tuple[list[float], list[float]]:
    """(training loss per step, held-out losses) of OUT/metrics.jsonl."""
    recs = [json.loads(ln) for ln in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r], [r["eval_loss"] for r in recs if "eval_loss" in r]


def head(out: Path) -> dict[str, np.ndarray]:
    """The exported head's arrays (OUT/vllm safetensors, float32 in the tiny preset)."""
    from safetensors.numpy import load_file

    arrays = {}
    for f in sorted((Path(out) / "vllm").glob("*.safetensors")):
        arrays.update(load_file(f))
    assert arrays, out
    return arrays


def assert_same_run(out: Path, ref: Path, rtol: float = 1e-5) -> None:
    """The same losses and the same trained head as the reference run (within rtol)."""
    got, want = records(out), records(ref)
    assert len(got[0]) == len(want[0]) == 3, (got, want)
    assert len(got[1]) == len(want[1]) >= 1, (got, want)
    np.testing.assert_allclose(got[0], want[0], rtol=rtol, err_msg=str(out))
    np.testing.assert_allclose(got[1], want[1], rtol=rtol, err_msg=str(out))
    a, b = head(out), head(ref)
    assert sorted(a) == sorted(b)
    for k in a:
        if not np.issubdtype(b[k].dtype, np.floating):
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{out}: {k}")
            continue
        scale = max(1e-6, float(np.abs(b[k]).max()))
        np.testing.assert_allclose(a[k] / scale, b[k] / scale, atol=rtol, err_msg=f"{out}: {k}")
