"""Dummy weights (`load_format="dummy"`, `peagle_jax.sources.dummy`): every target family from its config.json
alone, the shapes and dtypes of a real load, norms at identity, matrices at the sane scale, finite
outputs, one compiled program per distinct shape; and what the CLIs build on them: `infer cost`,
`infer generate --drafter new`, `python -m train --model.load_format dummy`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import hf_tiny
import jax
import numpy as np
import pytest
from flax import nnx
from in_process import run_module

import peagle_jax as pj
from peagle_jax.formats import inspect_folder
from peagle_jax.handles.target import target_source
from peagle_jax.models.layers import RMSNorm
from peagle_jax.sources import dummy
from peagle_jax.sources.weights import WeightsError, abstract_model

# a shape no test fixture or preset has: what a user's own config.json looks like
UNSEEN = {
    "model_type": "qwen3",
    "hidden_size": 192,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
KINDS = ["llama-gqa2-tied-llama3", "qwen3", "gemma3", "qwen3_moe", "gpt_oss"]


def config_folder(folder: Path, fields: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


@pytest.fixture(scope="module")
def unseen(tmp_path_factory) -> Path:
    return config_folder(tmp_path_factory.mktemp("unseen"), UNSEEN)


def leaves(state) -> dict:
    return {tuple(p): v.get_value() for p, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("kind", KINDS)
def test_every_family_from_its_config_alone(kind, tmp_path):
    hf_tiny._hf_config(*hf_tiny.SPECS[kind]).to_json_file(str(config_folder(tmp_path, {}) / "config.json"))
    target = pj.load_target(tmp_path, dtype="float32", load_format="dummy")
    assert target.load_format == "dummy" and "load_format='dummy'" in repr(target)
    _, abstract = abstract_model(target.config, np.float32)
    want, got = leaves(abstract), leaves(target.state)
    assert {p: (x.shape, x.dtype) for p, x in got.items()} == {p: (x.shape, x.dtype) for p, x in want.items()}
    norms = {(*p, "weight"): n.offset for p, n in nnx.iter_graph(target.model) if isinstance(n, RMSNorm)}
    assert norms, "every family has norms"
    for path, offset in norms.items():
        assert np.all(np.asarray(got[path]) == (0.0 if offset else 1.0)), path  # identity: 1, or Gemma's (1 + 0)
    matrices = [np.asarray(x) for x in got.values() if x.ndim >= 2]
    assert all(0.015 < x.std() < 0.025 and abs(x.mean()) < 0.01 for x in matrices)
    out = target.forward(hf_tiny.tokens(2, 12))
    assert np.isfinite(np.asarray(out.logits)).all() and np.asarray(out.logits).std() > 0


def test_one_program_per_distinct_shape_and_a_seed(unseen):
    dummy._filler.cache_clear()
    cfg = target_source(unseen, "dummy")[0]
    _, a = dummy.dummy_params(cfg, "bfloat16", seed=1)
    programs = dummy._filler.cache_info().currsize
    got = leaves(a)
    assert len(got) == 3 + 11 * UNSEEN["num_hidden_layers"]  # embed, norm, lm_head; 11 leaves a Qwen3 layer
    assert programs == len({(x.shape, str(x.dtype), x.ndim > 1 or None) for x in got.values()}) <= 12
    assert all(x.dtype == jax.numpy.bfloat16 for x in got.values())
    again, other = (
        leaves(dummy.dummy_params(cfg, "bfloat16", seed=1)[1]),
        leaves(dummy.dummy_params(cfg, "bfloat16", seed=2)[1]),
    )
    key = ("layers", 0, "mlp", "down_proj", "kernel")
    assert np.array_equal(np.asarray(again[key]), np.asarray(got[key]))
    assert not np.array_equal(np.asarray(other[key]), np.asarray(got[key]))
    first, second = ("layers", 0, "self_attn", "q_proj", "kernel"), ("layers", 1, "self_attn", "q_proj", "kernel")
    assert not np.array_equal(np.asarray(got[first]), np.asarray(got[second]))  # one program, a key per leaf


def test_presets_and_what_is_refused(tmp_path):
    cfg, folder = target_source("llama-3.1-8b", "dummy")  # any case
    assert folder is None and (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (32, 4096, 128256)
    with pytest.raises(WeightsError, match=r"nosuch: no such folder, nor a preset \(Llama-3.1-8B, "):
        target_source(str(tmp_path / "nosuch"), "dummy")
    with pytest.raises(WeightsError, match="no such folder$"):  # reading weights needs a folder
        target_source("Llama-3.1-8B", "auto")
    with pytest.raises(ValueError, match="load_format 'dumb': expected one of auto, dummy"):
        pj.load_target(tmp_path, load_format="dumb")


def test_infer_cost_rows_on_an_unseen_shape(unseen, tmp_path):
    out = tmp_path / "cost.json"
    argv = ["cost", "--target", unseen, "--load-format", "dummy", "--drafter", "new", "--modes", "parallel,chain"]
    r = run_module(
        "infer", argv + ["--k", "1,7", "--batch", "1", "--prompt-len", "48,5000", "--reps", "2", "--json", out]
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    rows = {(x["mode"], x["k"]): x for x in data["rounds"]}
    assert sorted(rows) == sorted((m, k) for m in ("parallel", "chain") for k in (1, 7))
    (step,) = data["plain"]
    (refused,) = data["refused"]  # a prompt past the target's context is that size's result, not the run's end
    assert refused["prompt_len"] == 5000 and "max_position_embeddings=4096" in refused["error"]
    for x in rows.values():
        assert x["step_ms"] == step["step_ms"] and x["break_even_acceptance_length"] == x["round_ms"] / x["step_ms"]
        assert min(x["round_ms"], x["drafter_ms"], x["verify_ms"], x["round_compile_s"]) > 0
    assert step["roofline_ms"] > 0 and step["step_bytes"] > 4 * (2 * 192 * 32000 - 192 * 32000)
    phases = [p["phase"].split(" (")[0] for p in data["phases"]]
    assert phases[:3] == ["target weights", "heads", "read bandwidth"] and all(
        p["seconds"] >= 0 for p in data["phases"]
    )
    assert "break-even AL" in r.stdout and "[cost] target weights (dummy):" in r.stderr


def test_generate_on_dummy_weights_is_lossless(unseen):
    base = ["generate", "--target", unseen, "--load-format", "dummy", "--prompt-ids", "5,6,7,8"]
    base += ["--max-new-tokens", "10", "--json"]
    plain = run_module("infer", base + ["--mode", "none"])
    spec = run_module("infer", base + ["--drafter", "new:2", "--k", "3"])
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert json.loads(spec.stdout)["tokens"] == json.loads(plain.stdout)["tokens"]
    assert len(json.loads(plain.stdout)["tokens"]) == 10


def test_bench_on_synthetic_prompts_without_a_tokenizer(unseen, tmp_path):
    argv = ["bench", "--target", unseen, "--load-format", "dummy", "--drafter", "new", "--k", "3"]
    argv += ["--prompts", "synthetic:12,30", "--limit", "3", "--max-new-tokens", "6", "--json", tmp_path / "b.json"]
    r = run_module("infer", argv)
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["prompts"] == "synthetic:12,30" and out["batches"] == 3
    assert out["greedy_mismatches"] == 0 and out["new_tokens"] == 3 * 6


@pytest.mark.parametrize(
    "argv, words",
    [
        (["generate", "--drafter", "new:0", "--prompt-ids", "1"], "--drafter new:0: expected new or new:LAYERS"),
        (["bench", "--drafter", "new", "--prompts", "synthetic:0"], "neither mtbench, humaneval, an existing JSONL"),
        (["cost", "--modes", "parallel,bogus"], "--modes: expected some of parallel, chain, dflash"),
        (["cost", "--load-format", "real"], "--load-format: invalid choice"),
    ],
)
def test_usage_errors(unseen, argv, words):
    r = run_module("infer", [*argv[:1], "--target", unseen, *argv[1:]])
    assert r.returncode == 2 and words in r.stderr.strip().splitlines()[-1], r.stderr


def test_train_on_dummy_weights_marks_the_head(unseen, tmp_path):
    out = tmp_path / "run"
    argv = ["--model.target", unseen, "--model.load_format", "dummy", "--data.source", "synthetic"]
    argv += ["--loop.steps", "2", "--eval.enabled", "false", "--loop.progress", "false", "--out", out]
    r = run_module("train", argv)
    assert r.returncode == 0, r.stderr
    assert "note: the target's weights were dummy (random)" in r.stdout
    assert "serve: none (a head trained on dummy weights" in r.stdout and "vllm serve" not in r.stdout
    assert json.loads((out / "summary.json").read_text())["target_load_format"] == "dummy"
    assert json.loads((out / "head" / "drafter.json").read_text())["config"]["dummy_target"] is True
    (warning,) = [w for w in inspect_folder(out / "head")["warnings"] if "dummy" in w]
    assert "drafter.json" in warning and "its drafts are meaningless" in warning
    real = dataclasses.replace(pj.load_drafter(out / "head").config, dummy_target=False)
    assert "dummy_target" not in real.to_dict()  # other heads' drafter.json stay as they were


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--model.target", "Llama-3.1-8B"],
            "Llama-3.1-8B: no such folder, nor an asset name, a Hub id (org/name) or "
            "tiny (a preset needs --model.load_format dummy)",
        ),
        (
            ["--model.target", "Nope-8B", "--model.load_format", "dummy"],
            "Nope-8B: no such folder, nor an asset name, a Hub id (org/name) or tiny, nor a preset",
        ),
        (["--model.load_format", "fake"], "model.load_format must be auto or dummy, got 'fake'"),
    ],
)
def test_train_flags_for_dummy_weights(argv, words, tmp_path):
    r = run_module("train", [*argv, "--out", tmp_path / "run"])
    assert r.returncode == 2 and words in r.stderr.strip().splitlines()[-1], r.stderr
    assert not (tmp_path / "run").exists()
