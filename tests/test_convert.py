"""The converter CLI (`python -m peagle_jax.convert`): round trips ours <-> vLLM / speculators
(bit-exact in f32, exact after one bf16 cast), sharding, hand-built vLLM / speculators folders of
each variant, what the exports hold for vLLM 0.33 (no id maps in a full-vocabulary head, layer flags
inside transformer_layer_config, the printed serve command), bad input (one `error:` line, exit 1 / 2,
nothing left behind) and the target HF round trip. Tiny shapes, CPU only. The lint is test_inspect.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from head_folders import (
    BF16,
    HD,
    HEADS,
    INTER,
    KV,
    MASK_KEYS,
    H,
    V,
    bf16_round,
    expected_state,
    folder_tensors,
    hand_tensors,
    listing,
    one_error_line,
    random_drafter,
    run,
    same_arrays,
    speculators_cfg,
    vllm_config,
    write_folder,
    write_target_config,
)
from limits import HANG_S
from safetensors.numpy import load_file, save_file

from peagle_jax.config.target_config import RopeConfig
from peagle_jax.formats.convert import INDEX_FILE, parse_size
from peagle_jax.handles.drafter import load_drafter

REPO = Path(__file__).resolve().parents[1]


def _hf_tiny():
    import hf_tiny

    return hf_tiny


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """(folder, drafter): a 2-layer P-EAGLE head, draft vocab 40 of 64, saved as our checkpoint."""
    d = random_drafter()
    folder = tmp_path_factory.mktemp("own") / "ckpt"
    d.save(folder)
    return folder, d


# ---------------------------------------------------------------------------------------
# round trips
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_roundtrip_f32_is_bit_exact(fmt, own, tmp_path, capsys):
    src, d = own
    rc, out, err = run(capsys, "export", src, tmp_path / "x", "--format", fmt, "--dtype", "float32")
    assert rc == 0, err
    assert "wrote" in out
    assert "&& vllm serve " in out  # a P-EAGLE head: pinned to the releases that serve it
    floats = {t.dtype for k, t in folder_tensors(tmp_path / "x").items() if k not in ("d2t", "t2d")}
    assert floats == {np.dtype(np.float32)}
    rc, _, err = run(capsys, "import", tmp_path / "x", tmp_path / "back")
    assert rc == 0, err
    back = load_drafter(tmp_path / "back")
    same_arrays(back.arrays(), d.arrays())
    assert back.config == d.config


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_roundtrip_bf16_exact_after_one_cast(fmt, own, tmp_path, capsys):
    src, d = own
    assert run(capsys, "export", src, tmp_path / "x", "--format", fmt)[0] == 0  # default dtype bfloat16
    first = folder_tensors(tmp_path / "x")
    assert {t.dtype for k, t in first.items() if k not in ("d2t", "t2d")} == {BF16}
    assert first["d2t"].dtype == np.int64
    assert first["t2d"].dtype == np.bool_
    assert run(capsys, "import", tmp_path / "x", tmp_path / "back")[0] == 0
    back = load_drafter(tmp_path / "back")
    same_arrays(back.arrays(), bf16_round(d.arrays()))
    # the second export of the imported head is the same bytes
    assert run(capsys, "export", tmp_path / "back", tmp_path / "y", "--format", fmt)[0] == 0
    same_arrays(folder_tensors(tmp_path / "y"), first)
    assert json.loads((tmp_path / "y/config.json").read_text()) == json.loads((tmp_path / "x/config.json").read_text())


def test_vllm_export_layout(own, tmp_path, capsys):
    """docs/method.md section 6: every key, shape and dtype; the config fields vLLM reads."""
    src, d = own
    assert run(capsys, "export", src, tmp_path / "x", "--format", "vllm")[0] == 0
    cfg = json.loads((tmp_path / "x/config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama"
    assert all(cfg[k] == V - 3 for k in MASK_KEYS)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert cfg["eagle_config"] == {
        "use_aux_hidden_state": True,
        "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5],
    }
    assert cfg["draft_vocab_size"] == 40
    assert cfg["vocab_size"] == V
    assert cfg["target_hidden_size"] == H
    assert cfg["tie_word_embeddings"] is False
    assert cfg["norm_before_residual"] is False
    assert cfg["max_position_embeddings"] == 64
    assert cfg["num_hidden_layers"] == 2
    assert cfg["head_dim"] == HD
    t = folder_tensors(tmp_path / "x")
    want = {
        "embed_tokens.weight": [V, H],
        "fc.weight": [H, 3 * H],
        "norm.weight": [H],
        "lm_head.weight": [40, H],
        "d2t": [40],
        "t2d": [V],
        "mask_hidden": [1, 1, 3 * H],
        "midlayer.input_layernorm.weight": [H],
        "midlayer.hidden_norm.weight": [H],
        "midlayer.post_attention_layernorm.weight": [H],
        "midlayer.self_attn.q_proj.weight": [HEADS * HD, 2 * H],
        "midlayer.self_attn.k_proj.weight": [KV * HD, 2 * H],
        "midlayer.self_attn.v_proj.weight": [KV * HD, 2 * H],
        "midlayer.self_attn.o_proj.weight": [H, HEADS * HD],
        "midlayer.mlp.gate_proj.weight": [INTER, H],
        "midlayer.mlp.up_proj.weight": [INTER, H],
        "midlayer.mlp.down_proj.weight": [H, INTER],
        "layers.1.input_layernorm.weight": [H],
        "layers.1.post_attention_layernorm.weight": [H],
        "layers.1.self_attn.q_proj.weight": [HEADS * HD, H],
        "layers.1.self_attn.k_proj.weight": [KV * HD, H],
        "layers.1.self_attn.v_proj.weight": [KV * HD, H],
        "layers.1.self_attn.o_proj.weight": [H, HEADS * HD],
        "layers.1.mlp.gate_proj.weight": [INTER, H],
        "layers.1.mlp.up_proj.weight": [INTER, H],
        "layers.1.mlp.down_proj.weight": [H, INTER],
    }
    assert {k: list(v.shape) for k, v in t.items()} == want
    np.testing.assert_array_equal(t["d2t"], d.d2t)
    np.testing.assert_array_equal(t["t2d"], d.t2d)
    np.testing.assert_array_equal(
        t["fc.weight"].astype(np.float32), d.arrays()[("fc", "kernel")].T.astype(BF16).astype(np.float32)
    )


def test_speculators_export_layout(own, tmp_path, capsys):
    src, d = own
    assert run(capsys, "export", src, tmp_path / "x", "--format", "speculators", "--verifier", "org/target")[0] == 0
    cfg = json.loads((tmp_path / "x/config.json").read_text())
    assert "model_type" not in cfg
    assert cfg["speculators_model_type"] == "peagle"
    assert cfg["mask_token_id"] == V - 3
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "peagle"
    assert sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 6
    assert sc["verifier"] == {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
    keys = set(folder_tensors(tmp_path / "x"))
    assert "layers.0.hidden_norm.weight" in keys
    assert not any(k.startswith("midlayer.") for k in keys)
    assert {"mask_hidden", "embed_tokens.weight", "d2t", "t2d"} <= keys


def test_subprocess_cli(own, tmp_path):
    src, d = own
    cmd = [sys.executable, "-m", "peagle_jax.formats.convert"]
    res = subprocess.run(
        cmd + ["export", str(src), str(tmp_path / "x"), "--format", "vllm"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=HANG_S,
    )
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout
    assert "error" not in res.stderr
    assert "warning" not in res.stderr
    res = subprocess.run(
        cmd + ["inspect", str(tmp_path / "x"), "--json", "--vllm-version", "0.33"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=HANG_S,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["format"] == "vllm"
    assert report["problems"] == []
    assert listing(tmp_path) == ["x"]


def test_help_per_subcommand(capsys):
    for sub in ("export", "import", "inspect", "export-target", "import-target"):
        rc, out, _ = run(capsys, sub, "--help")
        assert rc == 0
        assert "usage:" in out
    assert run(capsys, "--help")[0] == 0


# ---------------------------------------------------------------------------------------
# sharding, atomic writes, --target
def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("8KB") == 8000
    assert parse_size("4096") == 4096
    assert parse_size("1.5MB") == 1_500_000
    for bad in ("", "5XB", "-1", "0", "GB", "5i"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_sharded_export_reads_back(fmt, own, tmp_path, capsys):
    src, d = own
    limit = 16_000
    rc, _, err = run(
        capsys, "export", src, tmp_path / "x", "--format", fmt, "--dtype", "float32", "--max-shard-size", "16KB"
    )
    assert rc == 0, err
    files = listing(tmp_path / "x")
    shards = [f for f in files if f.endswith(".safetensors")]
    assert "model.safetensors" not in files
    assert INDEX_FILE in files
    assert len(shards) >= 2
    assert all(f"-of-{len(shards):05d}.safetensors" in s for s in shards)
    index = json.loads((tmp_path / "x" / INDEX_FILE).read_text())
    tensors = folder_tensors(tmp_path / "x")
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for s in shards:
        part = load_file(str(tmp_path / "x" / s))
        assert sum(t.nbytes for t in part.values()) <= limit or len(part) == 1
    assert run(capsys, "inspect", tmp_path / "x", "--vllm-version", "0.33")[0] == 0
    assert run(capsys, "import", tmp_path / "x", tmp_path / "back")[0] == 0
    same_arrays(load_drafter(tmp_path / "back").arrays(), d.arrays())


def test_existing_output_needs_overwrite(own, tmp_path, capsys):
    src, _ = own
    out = tmp_path / "x"
    assert run(capsys, "export", src, out, "--format", "vllm")[0] == 0
    before = (out / "config.json").read_bytes()
    rc, _, err = run(capsys, "export", src, out, "--format", "speculators")
    assert rc == 1
    assert "--overwrite" in one_error_line(err)
    assert (out / "config.json").read_bytes() == before
    assert run(capsys, "export", src, out, "--format", "speculators", "--overwrite")[0] == 0
    assert "speculators_model_type" in json.loads((out / "config.json").read_text())
    rc, _, err = run(capsys, "import", out, tmp_path / "back")
    assert rc == 0, err
    rc, _, err = run(capsys, "import", out, tmp_path / "back")
    assert rc == 1
    assert "--overwrite" in one_error_line(err)
    assert run(capsys, "import", out, tmp_path / "back", "--overwrite")[0] == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    rc, _, err = run(capsys, "export", src, tmp_path / "other", "--format", "vllm", "--overwrite")
    assert rc == 1
    assert "refusing" in one_error_line(err)
    assert listing(tmp_path) == ["back", "other", "x"]


def test_export_with_target(own, tmp_path, capsys):
    src, _ = own
    tgt = write_target_config(tmp_path / "target")
    rc, out, err = run(capsys, "export", src, tmp_path / "x", "--format", "vllm", "--target", tgt)
    assert rc == 0, err
    assert "max_position_embeddings raised from 64" in out
    assert json.loads((tmp_path / "x/config.json").read_text())["max_position_embeddings"] == 4096
    bad = write_target_config(tmp_path / "bad", hidden_size=48)
    rc, _, err = run(capsys, "export", src, tmp_path / "y", "--format", "vllm", "--target", bad)
    assert rc == 1
    assert "target_hidden_size" in one_error_line(err)
    assert listing(tmp_path) == ["bad", "target", "x"]  # nothing half-written
    rc, _, err = run(capsys, "export", src, tmp_path / "y", "--format", "vllm", "--target", bad, "--force")
    assert rc == 0
    assert "warning: (forced)" in err


# ---------------------------------------------------------------------------------------
# hand-built folders (keys written literally, as section 6 lists them)
VARIANTS = {
    # name: (format, tensor kwargs, config kwargs, expected config fields)
    "vllm-midlayer-draftvocab": (
        "vllm",
        dict(vd=40),
        dict(vd=40),
        dict(mode="parallel", draft_vocab_size=40, mask_token_id=V - 3),
    ),
    "vllm-layers0-fullvocab-ptd-only": (
        "vllm",
        dict(layer0="layers.0."),
        dict(mask_keys=("ptd_token_id",), aux_where="inner"),
        dict(mode="parallel", draft_vocab_size=V, aux_layer_ids=(1, 3, 5)),
    ),
    "vllm-bias-bf16-llama3-rope": (
        "vllm",
        dict(bias=True, num_layers=1, dtype=BF16),
        dict(
            num_layers=1,
            attention_bias=True,
            mask_keys=("pard_token",),
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        dict(attention_bias=True, num_layers=1, rope=RopeConfig(10000.0, "llama3", 8.0, 1.0, 4.0, 16)),
    ),
    "vllm-eagle3-chain": (
        "vllm",
        dict(mask_hidden=False),
        dict(mask_keys=(), norm_before_residual=True),
        dict(mode="chain", mask_token_id=None, norm_before_residual=True),
    ),
    "speculators-peagle": (
        "speculators",
        dict(layer0="layers.0.", vd=40),
        dict(vd=40),
        dict(mode="parallel", k_train=5, verifier="org/target", norm_before_residual=False),
    ),
    "speculators-eagle3": (
        "speculators",
        dict(layer0="layers.0.", mask_hidden=False),
        dict(kind="eagle3"),
        dict(mode="chain", norm_before_residual=True),
    ),  # speculators' eagle3 default
    "speculators-qwen3": (
        "speculators",
        dict(layer0="layers.0.", qk_norm=True),
        dict(tl_type="qwen3"),
        dict(qk_norm=True),
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hand_built_folder_imports(variant, tmp_path, capsys):
    fmt, tkw, ckw, fields = VARIANTS[variant]
    tensors = hand_tensors(**tkw)
    config = vllm_config(**ckw) if fmt == "vllm" else speculators_cfg(**ckw)
    src = write_folder(tmp_path / "src", config, tensors)
    rc, out, err = run(capsys, "inspect", src, "--json", "--vllm-version", "0.33")
    assert rc == 0, out
    report = json.loads(out)
    assert report["format"] == fmt
    assert report["mode"] == fields.get("mode", report["mode"])
    rc, _, err = run(capsys, "import", src, tmp_path / "ours")
    assert rc == 0, err
    d = load_drafter(tmp_path / "ours")
    if fmt == "vllm" and not fields.get("qk_norm"):  # and straight on to the other layout
        rc, _, err = run(capsys, "export", src, tmp_path / "spec", "--format", "speculators", "--dtype", "float32")
        assert rc == 0, err
        assert run(capsys, "import", tmp_path / "spec", tmp_path / "back")[0] == 0
        same_arrays(load_drafter(tmp_path / "back").arrays(), d.arrays())
    got, want = d.arrays(), expected_state(tensors)
    if ("d2t",) not in want:
        want[("d2t",)] = np.zeros(d.config.draft_vocab_size, np.int32)
    same_arrays(got, want)
    for name, value in fields.items():
        assert getattr(d.config, name) == value, name
    assert d.config.rms_norm_eps == 1e-5
    assert d.config.max_position_embeddings == 64


# ---------------------------------------------------------------------------------------
# what vLLM 0.33 loads from an export: its tensors, config flags and verifier, and the printed serve command
PIN = 'pip install "vllm>=0.16,<0.34" && '


def serve_spec(out: str, pinned: bool = False) -> tuple[dict, str]:
    """(the --speculative-config dict, the rest of the line) of the printed vLLM serve command;
    `pinned`: the command must install a vLLM release that serves P-EAGLE heads first."""
    line = next(x for x in out.splitlines() if x.startswith("serve: "))
    head, spec, tail = line.split("'")
    assert head == "serve: " + PIN * pinned + "vllm serve TARGET --speculative-config ", line
    return json.loads(spec), tail


def test_vllm_export_full_vocab_has_no_id_maps(tmp_path, capsys):
    """vLLM creates no draft_id_to_target_id parameter when Vd == V and refuses a d2t tensor."""
    d = random_drafter(vd=V)
    d.save(tmp_path / "own")
    for fmt in ("vllm", "speculators"):
        rc, _, err = run(capsys, "export", tmp_path / "own", tmp_path / fmt, "--format", fmt)
        assert rc == 0, err
        keys = set(folder_tensors(tmp_path / fmt))
        assert "d2t" not in keys, fmt
        assert "t2d" not in keys, fmt
        assert "lm_head.weight" in keys, fmt
        assert run(capsys, "import", tmp_path / fmt, tmp_path / f"back-{fmt}")[0] == 0
        back = load_drafter(tmp_path / f"back-{fmt}")
        assert back.config == d.config
        assert not back.d2t.any()


def test_speculators_export_writes_layer_flags_in_the_layer_config(tmp_path, capsys):
    """vLLM's peagle translation forwards neither fc_norm nor norm_output from the top level: they
    must be inside transformer_layer_config, which vLLM builds the head from."""
    d = random_drafter(fc_norm=True, norm_output=True)
    d.save(tmp_path / "own")
    assert run(capsys, "export", tmp_path / "own", tmp_path / "x", "--format", "speculators")[0] == 0
    cfg = json.loads((tmp_path / "x/config.json").read_text())
    assert cfg["transformer_layer_config"]["fc_norm"] is True
    assert cfg["transformer_layer_config"]["norm_output"] is True
    assert cfg["fc_norm"] is True
    assert cfg["norm_output"] is True  # speculators reads the top level
    assert {f"fc_norm.{j}.weight" for j in range(3)} <= set(folder_tensors(tmp_path / "x"))
    assert run(capsys, "import", tmp_path / "x", tmp_path / "back")[0] == 0
    back = load_drafter(tmp_path / "back")
    assert back.config == d.config
    same_arrays(back.arrays(), bf16_round(d.arrays()))


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
@pytest.mark.parametrize(
    "mode, k_train, want_k", [("parallel", 6, 6), ("parallel", 10, 7), ("parallel", None, 7), ("chain", 3, 3)]
)
def test_export_prints_the_serve_command(fmt, mode, k_train, want_k, tmp_path, capsys):
    """One command for both formats: method eagle3 (a speculators folder without it becomes a plain
    draft model in vLLM), K = the trained depth capped at 7, parallel_drafting for P-EAGLE heads."""
    random_drafter(mode=mode, k_train=k_train).save(tmp_path / "own")
    rc, out, err = run(capsys, "export", tmp_path / "own", tmp_path / "x", "--format", fmt)
    assert rc == 0, err
    spec, tail = serve_spec(out, pinned=mode == "parallel")
    folder = (tmp_path / "x").absolute()
    want = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": want_k}
    if mode == "parallel":
        want["parallel_drafting"] = True
    assert spec == want
    assert tail == ""
    ours = f"serve: python -m infer serve --target TARGET --drafter {folder} --k {want_k}"
    assert [x for x in out.splitlines() if x.startswith("serve: ")][1:] == [ours]
    notes = [x for x in out.splitlines() if "vLLM 0.34 and later refuse P-EAGLE heads" in x]
    assert len(notes) == (mode == "parallel"), out


def test_export_for_a_target_without_aux_capture(tmp_path, capsys):
    """vLLM 0.33's native gemma3 model captures no aux hidden states: the command adds
    --model-impl transformers."""
    random_drafter(target_model_type="gemma3").save(tmp_path / "own")
    rc, out, err = run(capsys, "export", tmp_path / "own", tmp_path / "x", "--format", "vllm")
    assert rc == 0, err
    assert serve_spec(out, pinned=True)[1] == " --model-impl transformers"


def test_export_verifier_is_recorded(own, tmp_path, capsys):
    src, d = own
    for fmt in ("vllm", "speculators"):
        rc, _, err = run(capsys, "export", src, tmp_path / fmt, "--format", fmt, "--verifier", "org/target")
        assert rc == 0, err
        assert "warning" not in err, err
        assert run(capsys, "import", tmp_path / fmt, tmp_path / f"back-{fmt}")[0] == 0
        assert load_drafter(tmp_path / f"back-{fmt}").config.verifier == "org/target", fmt
    cfg = json.loads((tmp_path / "speculators/config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/target"


# ---------------------------------------------------------------------------------------
# bad input: one line on stderr naming the file / key, exit 1 (2 for usage, and for an inspect that
# could not run), nothing left behind
@pytest.fixture
def good_src(tmp_path):
    return write_folder(tmp_path / "src", vllm_config(vd=40), hand_tensors(vd=40))


def expect_failure(capsys, tmp_path, argv, code=None, names=()):
    code = (2 if argv[0] == "inspect" else 1) if code is None else code
    before = listing(tmp_path)
    rc, _, err = run(capsys, *argv)
    line = one_error_line(err)
    assert rc == code, line
    for n in names:
        assert n in line, line
    assert listing(tmp_path) == before  # no partial output, no temporary folder
    return line


def test_truncated_safetensors(good_src, tmp_path, capsys):
    f = good_src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    expect_failure(capsys, tmp_path, ["import", good_src, tmp_path / "out"], names=["model.safetensors"])
    rc, out, _ = run(capsys, "inspect", good_src, "--vllm-version", "0.33")
    assert rc == 1
    assert "model.safetensors" in out


def test_wrong_shape(good_src, tmp_path, capsys):
    t = load_file(str(good_src / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"][:, :-1].copy()
    save_file(t, str(good_src / "model.safetensors"))
    expect_failure(capsys, tmp_path, ["import", good_src, tmp_path / "out"], names=["fc.weight", "shape"])


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"])
def test_missing_config_key(key, good_src, tmp_path, capsys):
    cfg = json.loads((good_src / "config.json").read_text())
    del cfg[key]
    (good_src / "config.json").write_text(json.dumps(cfg))
    expect_failure(capsys, tmp_path, ["import", good_src, tmp_path / "out"], names=[key, "config.json"])
    expect_failure(capsys, tmp_path, ["inspect", good_src], names=[key])


def test_missing_speculators_mask_id(tmp_path, capsys):
    cfg = speculators_cfg()
    del cfg["mask_token_id"]
    src = write_folder(tmp_path / "src", cfg, hand_tensors(layer0="layers.0."))
    expect_failure(capsys, tmp_path, ["import", src, tmp_path / "out"], names=["mask_token_id"])


def test_unknown_architecture(good_src, tmp_path, capsys):
    cfg = json.loads((good_src / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (good_src / "config.json").write_text(json.dumps(cfg))
    for argv in (
        ["import", good_src, tmp_path / "out"],
        ["inspect", good_src],
        ["export", good_src, tmp_path / "out", "--format", "vllm"],
    ):
        expect_failure(capsys, tmp_path, argv, names=["architectures", "FooForCausalLM"])


def test_nonexistent_paths(own, tmp_path, capsys):
    src, _ = own
    missing = tmp_path / "missing"
    for argv in (
        ["import", missing, tmp_path / "out"],
        ["inspect", missing],
        ["export", missing, tmp_path / "out", "--format", "vllm"],
        ["export-target", missing, tmp_path / "out"],
        ["import-target", missing, tmp_path / "out"],
        ["inspect", src, "--target", missing],
    ):
        expect_failure(capsys, tmp_path, argv, names=["missing"])
    empty = tmp_path / "empty"
    empty.mkdir()
    expect_failure(capsys, tmp_path, ["import", empty, tmp_path / "out"], names=["config.json"])


def test_broken_own_checkpoint(own, tmp_path, capsys):
    import shutil

    src, _ = own
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "drafter.json").write_text("{not json")
    expect_failure(capsys, tmp_path, ["export", broken, tmp_path / "out", "--format", "vllm"], names=["drafter.json"])


def _bytes_of(folder: Path) -> dict:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_output_onto_its_input_is_refused(own, good_src, tmp_path, capsys):
    """`export V V --overwrite` would rewrite a float32 head onto itself in bf16, and replacing a
    folder that holds the input would delete it: one line naming OUT, exit 2, every input byte kept."""
    own_src, _ = own
    run_dir = tmp_path / "run"
    head = write_folder(run_dir / "v", vllm_config(vd=40), hand_tensors(vd=40))
    (run_dir / "config.json").write_text("{}")  # the marker --overwrite would accept
    (tmp_path / "link").symlink_to(head)
    before = {f: _bytes_of(f) for f in (head, own_src, good_src)}
    for argv, what in (
        (["export", head, head, "--format", "vllm", "--overwrite"], "is the input folder"),
        (["export", head, tmp_path / "link", "--format", "speculators", "--overwrite"], "is the input folder"),
        (["export", head, run_dir / "v" / ".." / "v", "--format", "vllm", "--overwrite"], "is the input folder"),
        (["export", head, run_dir, "--format", "vllm", "--overwrite"], "holds the input folder"),
        (["import", own_src, own_src, "--overwrite"], "is the input folder"),
        (["import-target", good_src, good_src, "--overwrite"], "is the input folder"),
        (["export-target", good_src, good_src, "--overwrite"], "is the input folder"),
    ):
        expect_failure(capsys, tmp_path, argv, code=2, names=["OUT", what])
    assert {f: _bytes_of(f) for f in (head, own_src, good_src)} == before


def test_output_destination_checked_before_any_work(own, good_src, tmp_path, capsys):
    """OUT below a file, or a file itself: one line naming OUT and the file, exit 2, before the head
    is read (export-target of a head folder would fail on its config only later)."""
    src, _ = own
    f = tmp_path / "file"
    f.write_text("x")
    for argv, what in (
        (["export", src, f / "out", "--format", "vllm"], f"OUT {f / 'out'}: {f} is a file, not a folder"),
        (["export", src, f / "a" / "b", "--format", "speculators"], f"OUT {f / 'a' / 'b'}: {f} is a file"),
        (["export", src, f, "--format", "vllm", "--overwrite"], f"OUT {f}: exists and is a file"),
        (["import", src, f / "out"], f"OUT {f / 'out'}: {f} is a file"),
        (["export-target", good_src, f / "out"], f"OUT {f / 'out'}: {f} is a file"),
    ):
        expect_failure(capsys, tmp_path, argv, code=2, names=[what])
    assert f.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_output_in_an_unwritable_folder(own, tmp_path, capsys):
    src, _ = own
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        line = expect_failure(capsys, tmp_path, ["export", src, locked / "out", "--format", "vllm"], code=2)
    finally:
        locked.chmod(0o700)
    assert f"folder {locked} is not writable" in line


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["export"],
        ["export", "a", "b"],
        ["export", "a", "b", "--format", "gguf"],
        ["export", "a", "b", "--format", "vllm", "--max-shard-size", "lots"],
        ["import", "a"],
        ["inspect"],
        ["frobnicate"],
        ["export-target", "a", "b", "--dtype", "int8"],
    ],
)
def test_usage_errors_exit_2(argv, tmp_path, capsys):
    expect_failure(capsys, tmp_path, argv, code=2)


# ---------------------------------------------------------------------------------------
# targets: the HF round trip as CLI
@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    hf_tiny = _hf_tiny()
    folder = tmp_path_factory.mktemp("hf") / "llama"
    model = hf_tiny.build("llama-mha-untied", folder)
    return folder, model


def test_target_roundtrip(hf_llama, tmp_path, capsys):
    import torch
    import transformers

    hf_tiny = _hf_tiny()
    src, model = hf_llama
    rc, _, err = run(capsys, "import-target", src, tmp_path / "ours")
    assert rc == 0, err
    rc, _, err = run(capsys, "export-target", tmp_path / "ours", tmp_path / "hf", "--max-shard-size", "100KB")
    assert rc == 0, err
    files = listing(tmp_path / "hf")
    assert INDEX_FILE in files
    assert sum(f.endswith(".safetensors") for f in files) >= 2
    original = load_file(str(src / "model.safetensors"))
    same_arrays(folder_tensors(tmp_path / "hf"), original)  # bit-exact, every key
    reloaded = (
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
        .eval()
        .float()
    )
    ids = hf_tiny.tokens(1, 9, seed=3)
    with torch.no_grad():
        a = model(torch.as_tensor(ids, dtype=torch.long)).logits
        b = reloaded(torch.as_tensor(ids, dtype=torch.long)).logits
    assert torch.equal(a, b)
    rc, _, err = run(capsys, "export-target", src, tmp_path / "bf", "--dtype", "bfloat16")
    assert rc == 0, err
    t = load_file(str(tmp_path / "bf" / "model.safetensors"))
    assert {v.dtype for v in t.values()} == {BF16}
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_target_bad_weights(hf_llama, tmp_path, capsys):
    import shutil

    src, _ = hf_llama
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    t = load_file(str(bad / "model.safetensors"))
    del t["model.norm.weight"]
    save_file(t, str(bad / "model.safetensors"))
    expect_failure(capsys, tmp_path, ["import-target", bad, tmp_path / "out"], names=["model.norm.weight"])


# ---------------------------------------------------------------------------------------
# the imported head drives the inference API
def test_imported_head_runs_in_the_inference_api(hf_llama, tmp_path, capsys):
    import peagle_jax as pj
    from infer import SpeculativeDecoder

    src, _ = hf_llama
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    target = pj.load_target(src, dtype="float32", aux_layer_ids=(0, 1, n - 1))  # tiny: (2, L//2, L-3) is invalid
    d = pj.new_drafter(target, num_layers=1, mode="parallel", seed=3, k_train=4)
    d.save(tmp_path / "own")
    assert run(capsys, "export", tmp_path / "own", tmp_path / "vllm", "--format", "vllm", "--dtype", "float32")[0] == 0
    assert run(capsys, "import", tmp_path / "vllm", tmp_path / "back")[0] == 0
    back = pj.load_drafter(tmp_path / "back")
    same_arrays(back.arrays(), d.arrays())
    prompt = [5, 17, 33, 2, 9, 41]
    got = SpeculativeDecoder(target, back, k=3, mode="parallel").propose(prompt)
    assert got == SpeculativeDecoder(target, d, k=3, mode="parallel").propose(prompt)
    assert len(got) == 4


def test_import_chain_head_without_embeddings_takes_the_targets(tmp_path, capsys):
    """An EAGLE-3 head that ships no embed_tokens (vLLM shares the target's): `import --target`."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=6,  # the head reads aux layers (1, 3, 5): import checks them
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HD,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "target"))
    capsys.readouterr()  # its progress bar
    src = write_folder(tmp_path / "src", vllm_config(mask_keys=()), hand_tensors(mask_hidden=False, embed=False))
    rc, _, err = run(capsys, "import", src, tmp_path / "o")
    assert rc == 1
    assert "embed_tokens.weight" in one_error_line(err)
    rc, _, err = run(capsys, "import", src, tmp_path / "o", "--target", tmp_path / "target")
    assert rc == 0, err
    d = load_drafter(tmp_path / "o")
    emb = load_file(str(tmp_path / "target" / "model.safetensors"))["model.embed_tokens.weight"]
    assert d.config.mode == "chain"
    np.testing.assert_array_equal(d.arrays()[("embed_tokens", "embedding")], emb)
