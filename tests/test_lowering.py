"""The programs users run on an accelerator, assembled for one on this CPU: the trainer's step
(P-EAGLE and EAGLE-3, flat and partitioned, float32 and bfloat16 compute) and the speculative
round (both draft modes, over the KV cache) traced under `kernels.for_platform` and lowered for
CUDA and TPU. The lowered text must hold the Pallas kernels (Triton / Mosaic custom calls: the
"auto" backends really picked them), no float64 and no host callbacks; lowered for the CPU, the
same step holds none of those kernels (the XLA path), which is what the count tells apart. On a
(2, 2, 2) mesh the step lowers for CUDA; for TPU it does not yet (Mosaic kernels are not
partitioned automatically: an expected failure that turns into a pass once they are wrapped)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xla_env

import peagle_jax as pj
from infer import SpeculativeDecoder
from peagle_jax import speculative as sp
from train.config import parse_args
from train.data import Example
from train.step import batch_arrays
from train.trainer import Trainer

KERNEL_CALL = {"cuda": "xla.gpu.triton", "tpu": "tpu_custom_call"}
STEPS = [
    ("parallel", "float32", "1"),
    ("parallel", "bfloat16", "2"),
    ("chain", "float32", "2"),
    ("chain", "bfloat16", "1"),
]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from train.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("lowering") / "tiny")


def lowered_step(folder, platform: str, mode: str, compute_dtype: str, segments: str) -> str:
    """The online train step's lowered text (the target runs inside it)."""
    target = pj.load_target(folder, dtype="bfloat16" if compute_dtype == "bfloat16" else "float32")
    flags = ["--preset", "tiny", "--model.attention", "kernels", "--model.mode", mode]
    cfg = parse_args([*flags, "--model.compute_dtype", compute_dtype, "--loop.segments", segments])
    trainer = Trainer(cfg, target, 10, token_counts=np.ones(target.config.vocab_size, np.int64))
    rng = np.random.default_rng(0)
    examples = [Example(rng.integers(5, 200, 60).astype(np.int32), np.arange(60) > 10, i) for i in range(2)]
    batch = batch_arrays(trainer.cod_batch(examples, 0))
    return trainer.stepper.lower(trainer.params, trainer.opt_state, trainer.frozen, batch, platform).as_text()


def assert_accelerator_program(text: str, platform: str, least: int) -> None:
    assert text.count(KERNEL_CALL[platform]) >= least, "the program does not use the platform's Pallas kernels"
    assert "f64" not in text, "float64 in the program"
    assert "callback" not in text, "a host callback in the program"


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("mode,compute_dtype,segments", STEPS, ids=["-".join(s) for s in STEPS])
def test_the_train_step_lowers_with_the_platform_kernels(tiny_folder, platform, mode, compute_dtype, segments):
    text = lowered_step(tiny_folder, platform, mode, compute_dtype, segments)
    assert_accelerator_program(text, platform, least=3)  # forward, dq, dkv of each attention


def test_lowered_for_the_cpu_the_step_holds_no_pallas_kernel(tiny_folder):
    text = lowered_step(tiny_folder, "cpu", "parallel", "float32", "1")
    for call in KERNEL_CALL.values():
        assert text.count(call) == 0, call


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("mode", ["parallel", "chain"])
def test_the_speculative_round_lowers_with_the_decode_kernels(tiny_folder, platform, mode):
    target = pj.load_target(tiny_folder, dtype="float32")
    drafter = pj.new_drafter(target, num_layers=1, mode=mode, k_train=4)
    dec = SpeculativeDecoder(target, drafter, k=3, mode=mode)
    cfg, _, state = dec.start([[2, 5, 7, 9, 11], [3, 4]], max_new_tokens=8)  # ragged batch
    text = sp.lower_round(cfg, *dec.modules(), state, platform).as_text()
    assert_accelerator_program(text, platform, least=1)


MESH_PROGRAM = Path(__file__).resolve().parent / "programs" / "lower_on_mesh.py"
MOSAIC_UNPARTITIONED = (
    "Mosaic kernels cannot be partitioned automatically: on a TPU mesh kernels.attention's TPU path "
    "needs a shard_map around its pallas_call (found by this lowering)"
)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_train_step_lowers_on_a_mesh(tiny_folder, platform):
    env = {**xla_env.simulated_devices(8), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, str(MESH_PROGRAM), str(tiny_folder), platform]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if platform == "tpu" and "Mosaic kernels cannot be automatically partitioned" in res.stderr:
        pytest.xfail(MOSAIC_UNPARTITIONED)  # only this known refusal; anything else fails
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["kernel_calls"] >= 3
