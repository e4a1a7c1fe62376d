"""Tensor-parallel placement: the speculative engine on 8 simulated CPU devices gives the
same tokens as on one device (plain greedy decoding there: the engine is lossless). Runs in a subprocess (the device count is fixed at start)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import hf_tiny
import xla_env
from limits import HANG_S

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "programs" / "sharded_engine.py"


def test_sharded_engine_equals_single_device(tmp_path):
    hf_tiny.build("llama-gqa2-tied-llama3", tmp_path / "t")
    env = {**xla_env.simulated_devices(8), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(PROGRAM), str(tmp_path / "t")], env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["q_shards_False"] == 1
    assert out["q_shards_True"] == 8  # really spread over the mesh
    for mode in ("parallel", "chain", "none"):
        assert out[f"{mode}_True"] == out["none_False"], mode
    assert out["parallel_rounds"] > 0
    assert out["chain_rounds"] > 0
