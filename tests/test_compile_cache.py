"""The command lines' persistent compilation cache (`peagle_jax.runtime.compile_cache`): where it goes, how it
is turned off, and that a real command fills it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from limits import HANG_S

from peagle_jax.runtime.compile_cache import cache_folder

REPO = Path(__file__).resolve().parents[1]


def test_where_the_cache_goes(monkeypatch, tmp_path):
    for name in ("PEAGLE_JAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_folder() == tmp_path / "xdg" / "peagle_jax" / "xla-cache"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert cache_folder() == tmp_path / "jax"
    monkeypatch.setenv("PEAGLE_JAX_COMPILE_CACHE", str(tmp_path / "ours"))
    assert cache_folder() == tmp_path / "ours"
    for off in ("off", "OFF", "0", "none"):
        monkeypatch.setenv("PEAGLE_JAX_COMPILE_CACHE", off)
        assert cache_folder() is None


def test_a_command_fills_the_cache_and_off_leaves_none(tmp_path):
    (tmp_path / "t").mkdir()
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}
    config.update(num_key_value_heads=2, intermediate_size=128, vocab_size=512, max_position_embeddings=256)
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    argv = [sys.executable, "-m", "infer", "generate", "--target", str(tmp_path / "t"), "--load-format", "dummy"]
    argv += ["--mode", "none", "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # this tiny target's programs compile in less than 1 s
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")  # where the default folder would be
    for setting in (str(tmp_path / "cache"), "off"):
        env["PEAGLE_JAX_COMPILE_CACHE"] = setting
        r = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
        assert r.returncode == 0, r.stderr
    kept = {p.name.split("-")[0] for p in (tmp_path / "cache").iterdir() if p.name.endswith("-cache")}
    assert {"jit_jit_prefill", "jit_jit_generate"} <= kept  # the engine's programs
    assert not (tmp_path / "xdg").exists() and not (REPO / "off").exists()  # off: no cache anywhere
