"""Tensor-parallel placement: the speculative engine on 8 simulated CPU devices gives the
same tokens as on one device (plain greedy decoding there: the engine is lossless). Runs in a subprocess (the device count is fixed at start)."""

from __future__ import annotations

from pathlib import Path

import hf_tiny
import xla_env

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "programs" / "sharded_engine.py"


def test_sharded_engine_equals_single_device(tmp_path):
    hf_tiny.build("llama-gqa2-tied-llama3", tmp_path / "t")
    out = xla_env.run_program(PROGRAM, tmp_path / "t", devices=8)
    assert out["q_shards_False"] == 1
    assert out["q_shards_True"] == 8  # really spread over the mesh
    for mode in ("parallel", "chain", "none"):
        assert out[f"{mode}_True"] == out["none_False"], mode
    assert out["parallel_rounds"] > 0
    assert out["chain_rounds"] > 0
