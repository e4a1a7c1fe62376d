"""Where a head can be served (peagle_jax.formats.engines): the release table, the lines the
converter prints (one builder, `serving.serve_lines`), `inspect --vllm-version` and its default
(the vLLM installed beside this project, else the newest release the table knows), and
`export --as eagle3`. What vLLM itself makes of the exports: tests/test_vllm_oracle.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from head_folders import bf16_round, folder_tensors, random_drafter, run, same_arrays
from limits import HANG_S

from peagle_jax.formats import serve_lines
from peagle_jax.formats.convert import main as convert_main
from peagle_jax.formats.engines import (
    NEWEST_VLLM,
    PEAGLE_VLLM_REQUIREMENT,
    parse_vllm_version,
    vllm_refusal,
)
from peagle_jax.handles.drafter import load_drafter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """Our checkpoints of a P-EAGLE and an EAGLE-3 head, and their vLLM-native exports."""
    root = tmp_path_factory.mktemp("engines")
    for mode in ("parallel", "chain"):
        random_drafter(mode=mode).save(root / f"own-{mode}")
        assert convert_main(["export", str(root / f"own-{mode}"), str(root / mode), "--format", "vllm"]) == 0
    return root


def test_the_table_knows_which_release_serves_which_kind():
    assert parse_vllm_version("0.34.0") == parse_vllm_version("0.34") == (0, 34)
    assert parse_vllm_version("0.33.1rc2+cu130") == (0, 33)
    for bad in ("", "x", "0", "0.x", "1.2.3.4 extra"):
        with pytest.raises(ValueError, match="MAJOR.MINOR"):
            parse_vllm_version(bad)
    for v in ((0, 16), (0, 20), (0, 33)):
        assert all(
            vllm_refusal(v, m, f) is None for m in ("parallel", "chain", "dflash") for f in ("vllm", "speculators")
        )
    assert "parallel_drafting is only supported" in vllm_refusal((0, 34), "parallel", "vllm")
    assert "P-EAGLE (parallel drafting EAGLE-3) is not supported" in vllm_refusal((0, 34), "parallel", "speculators")
    assert vllm_refusal((0, 40), "parallel", "vllm") == vllm_refusal((0, 34), "parallel", "vllm")  # to date
    assert vllm_refusal((0, 34), "chain", "vllm") is None and vllm_refusal((0, 34), "dflash", "speculators") is None
    assert "predates parallel drafting" in vllm_refusal((0, 15), "parallel", "vllm")
    assert NEWEST_VLLM == (0, 34) and PEAGLE_VLLM_REQUIREMENT == "vllm>=0.16,<0.34"


def test_serve_lines_pin_a_peagle_head_and_name_this_engine():
    par = serve_lines("/h", "parallel", 5, "llama", "org/t")
    assert par[0].startswith('pip install "vllm>=0.16,<0.34" && vllm serve org/t --speculative-config ')
    assert json.loads(par[0].split("'")[1])["parallel_drafting"] is True
    assert par[1] == "python -m infer serve --target org/t --drafter /h --k 5"
    chain = serve_lines("/h", "chain", 10, "qwen3")
    assert chain[0].startswith("vllm serve TARGET ") and chain[1].endswith(" --k 7")  # capped at SERVE_K
    dflash = serve_lines("/h", "dflash", 15, "qwen3")
    assert json.loads(dflash[0].split("'")[1])["method"] == "dflash" and dflash[1].endswith(" --k 15")


@pytest.mark.parametrize(
    "version, mode, rc, says",
    [
        (
            "0.34",
            "parallel",
            1,
            "vLLM 0.34 refuses P-EAGLE heads: SpeculativeConfig raises ValueError: parallel_drafting",
        ),
        ("0.34.0", "chain", 0, None),
        ("0.33", "parallel", 0, None),
        ("0.16", "parallel", 0, None),
        ("0.15", "parallel", 1, "vLLM 0.15 predates parallel drafting (vLLM 0.16)"),
        ("0.41", "parallel", 1, "vLLM 0.41 refuses P-EAGLE heads"),
        ("0.41", "chain", 0, "vLLM 0.41 is newer than the releases this lint was checked against"),
    ],
)
def test_inspect_checks_serving_with_the_release_asked_for(heads, capsys, version, mode, rc, says):
    code, out, err = run(capsys, "inspect", heads / mode, "--vllm-version", version)
    assert code == rc, out + err
    assert f"  vLLM         {'.'.join(version.split('.')[:2])} (--vllm-version)" in out
    if says:
        assert says in out, out
    if mode == "parallel":
        assert '  serve        pip install "vllm>=0.16,<0.34" && vllm serve TARGET' in out, out
        assert "python -m infer serve --target TARGET --drafter " in out


def test_inspect_rejects_a_version_that_is_none(heads, capsys):
    code, out, err = run(capsys, "inspect", heads / "parallel", "--vllm-version", "latest")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--vllm-version" in err and "'latest'" in err, err


def cli(*argv, pythonpath=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (pythonpath, REPO) if p))
    cmd = [sys.executable, "-m", "peagle_jax.convert", *map(str, argv)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=HANG_S)


def test_inspect_checks_the_installed_vllm_else_the_newest_known(heads, tmp_path):
    """The default release: `importlib.metadata` finds a vLLM distribution on the path (here one
    made by hand: its metadata alone), else the table's newest."""
    r = cli("inspect", heads / "parallel", "--json")
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert (report["vllm_version"], report["vllm_version_source"]) == ("0.34", "the newest release known")
    dist = tmp_path / "site" / "vllm-0.33.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.1\n")
    r = cli("inspect", heads / "parallel", "--json", pythonpath=tmp_path / "site")
    assert r.returncode == 0, r.stdout
    report = json.loads(r.stdout)
    assert (report["vllm_version"], report["vllm_version_source"]) == ("0.33", "installed")


def test_export_as_eagle3_writes_a_plain_eagle3_head(heads, tmp_path, capsys):
    code, out, err = run(
        capsys, "export", heads / "own-parallel", tmp_path / "e3", "--format", "vllm", "--as", "eagle3"
    )
    assert code == 0, err
    assert "written as plain EAGLE-3" in err and "accepts fewer" in err, err
    tensors = folder_tensors(tmp_path / "e3")
    assert "mask_hidden" not in tensors
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert not {"mask_token_id", "pard_token", "ptd_token_id"} & set(cfg), cfg
    serve = [x for x in out.splitlines() if x.startswith("serve: ")]
    assert serve[0].startswith("serve: vllm serve TARGET ") and "parallel_drafting" not in serve[0]
    assert run(capsys, "inspect", tmp_path / "e3", "--vllm-version", "0.34")[0] == 0
    back, own = load_drafter(tmp_path / "e3"), load_drafter(heads / "own-parallel")
    assert back.config.mode == "chain" and back.config.mask_token_id is None
    same_arrays(back.arrays(), bf16_round({p: a for p, a in own.arrays().items() if p != ("mask_hidden",)}))


def test_export_as_eagle3_of_a_head_of_another_kind_is_one_line(heads, tmp_path, capsys):
    code, out, err = run(capsys, "export", heads / "own-chain", tmp_path / "x", "--format", "vllm", "--as", "eagle3")
    assert code == 1 and not (tmp_path / "x").exists()
    assert err.count("\n") == 1 and "--as eagle3" in err and "'chain'" in err, err
