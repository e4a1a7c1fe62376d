"""The trainer sharded over a device mesh: on 8 simulated CPU devices, meshes (data, fsdp,
tensor) = (8,1,1), (1,8,1), (2,2,2), (1,4,2) train the same 3 steps as one device (losses and
the trained head within 1e-5; (1,4,2) with the blockwise attention kernels), a checkpoint
written on (2,2,2) resumes on (8,1,1) and ends where the uninterrupted run ends, and a mesh or
batch that does not fit is a one-line error.

All the 8-device runs share one subprocess (the device count is fixed when JAX starts; the
libraries are then loaded once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import train_runs
import xla_env
from limits import HANG_S

ROOT = Path(__file__).resolve().parents[1]
MESHES = [(2, 2, 2), (8, 1, 1), (1, 8, 1), (1, 4, 2)]

PROGRAM = ROOT / "tests" / "programs" / "train_meshes.py"


def eight_devices(tmp_path_factory, meshes):
    """(root of the runs, the one-device reference OUT, the program's report)."""
    target, ref = train_runs.reference(str(tmp_path_factory.getbasetemp() / "train-reference"))
    root = tmp_path_factory.mktemp("meshes")
    env = {**xla_env.simulated_devices(8), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run(
        [sys.executable, str(PROGRAM), str(target), str(root), json.dumps(meshes)],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return root, ref, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    return eight_devices(tmp_path_factory, MESHES)


def check_mesh(root, ref, mesh) -> None:
    out = root / "m{}{}{}".format(*mesh)
    config = json.loads((out / "config.json").read_text())
    assert config["mesh"] == {"data": mesh[0], "fsdp": mesh[1], "tensor": mesh[2]}
    train_runs.assert_same_run(out, ref)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_mesh_equals_one_device(mesh_runs, mesh):
    root, ref, _ = mesh_runs
    check_mesh(root, ref, mesh)


def test_blockwise_attention_on_a_mesh_equals_the_dense_one_device_run(mesh_runs):
    """The (1, 4, 2) run uses `--model.attention kernels` (layer 0 attends the mask slot once per
    position, `kernels.slot_attention`) and trains what the dense mask trains on one device
    (`test_mesh_equals_one_device[1x4x2]` compares them)."""
    root, _, _ = mesh_runs
    assert json.loads((root / "m142" / "config.json").read_text())["model"]["attention"] == "kernels"
    assert json.loads((root / "m222" / "config.json").read_text())["model"]["attention"] == "dense"


def test_checkpoint_from_another_mesh_resumes_identically(mesh_runs):
    root, ref, report = mesh_runs
    assert report["resumed_from"] == 2
    train_runs.assert_same_run(root / "resumed", ref)


def test_mesh_and_batch_that_do_not_fit_are_one_line_errors(mesh_runs):
    _, _, report = mesh_runs
    rc, err = report["errors"]["mesh"]
    assert rc == 1, err
    assert len(err.strip().splitlines()) == 1, err
    assert "mesh.data=3" in err, err
    assert "mesh.fsdp" in err, err
    assert "8 devices" in err, err
    rc, err = report["errors"]["batch"]
    assert rc == 1, err
    assert len(err.strip().splitlines()) == 1, err
    assert "data.batch_size=4" in err, err
    assert "mesh.data x mesh.fsdp = 8" in err, err


def test_state_lies_on_the_mesh_by_the_rule_table(mesh_runs):
    _, _, report = mesh_runs
    params = report["params"]
    q_shape, q_spec = params["layers.0.self_attn.q_proj.kernel"]
    assert q_spec == ["fsdp", "tensor"]  # column-parallel, the other dimension over fsdp
    assert params["layers.0.self_attn.o_proj.kernel"][1] == ["tensor", "fsdp"]  # row-parallel
    assert params["norm.weight"][1] in ([], [None])  # replicated
    # AdamW's mu and nu of q_proj lie like q_proj
    assert sum(1 for shape, spec in report["opt"] if shape == q_shape and spec == q_spec) >= 2
