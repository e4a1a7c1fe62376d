"""The programs users run on an accelerator, assembled for one on this CPU: the trainer's step
(P-EAGLE and EAGLE-3, flat and partitioned, float32 and bfloat16 compute) and the speculative
round (both draft modes, over the KV cache) traced under `kernels.for_platform` and lowered for
CUDA and TPU. The lowered text must hold the Pallas kernels (Triton / Mosaic custom calls: the
"auto" backends really picked them), no float64 and no host callbacks; lowered for the CPU, the
same step holds none of those kernels (the XLA path), which is what the count tells apart. On a
(2, 2, 2) mesh the step and a round lower for both, each kernel inside a shard_map region
(`kernels.partitioned`: Mosaic refuses XLA's automatic partitioning), and the partitioned kernels
compute what the unpartitioned ones do."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import xla_env

import peagle_jax as pj
from infer import SpeculativeDecoder
from peagle_jax.engine import speculative as sp
from train.data import Example
from train.flags import parse_args
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


def has_float64(text: str) -> bool:
    """Whether a type of the program is float64 (`f64`, `4xf64`). Quoted strings are left out: a
    Pallas call carries its kernel's body base64-encoded (hundreds of kB for a train step), where
    the letters "f64" turn up by chance (the body holds source locations: an edit elsewhere changes it)."""
    code = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return re.search(r"(?<![A-Za-z_])f64\b|\dxf64\b", code) is not None


def test_float64_is_found_in_types_and_not_in_a_kernels_encoded_body():
    assert has_float64("%0 = stablehlo.add %a, %b : tensor<2x3xf64>") and has_float64("-> tensor<f64>")
    assert not has_float64(
        '%0 = stablehlo.custom_call @tpu_custom_call() {backend_config = "{\\22body\\22: \\22a/f64+\\22}"}'
    )
    assert not has_float64("%0 = stablehlo.add %a, %b : tensor<2x3xf32>")


def assert_accelerator_program(text: str, platform: str, least: int) -> None:
    assert text.count(KERNEL_CALL[platform]) >= least, "the program does not use the platform's Pallas kernels"
    assert not has_float64(text), "float64 in the program"
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
PARTITION_PROGRAM = Path(__file__).resolve().parent / "programs" / "partitioned_kernels.py"


def run_on_8_devices(program, *args) -> dict:
    return xla_env.run_program(program, *args, devices=8)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_train_step_and_a_round_lower_on_a_mesh(tiny_folder, platform):
    got = run_on_8_devices(MESH_PROGRAM, tiny_folder, platform)
    assert got["kernel_calls"] >= 3 and got["round_kernel_calls"] >= 1, got
    assert got["manual"] >= 1 and got["round_manual"] >= 1, got  # the kernels run per shard


def test_partitioned_kernels_match_the_unpartitioned_ones():
    got = run_on_8_devices(PARTITION_PROGRAM)
    assert got["manual_attention"] >= 1 and got["manual_decode"] >= 1, got
    for name in ("out", "lse", "grads", "decode"):
        assert got[name] <= 1e-5, (name, got)
    assert got["local_rows"] == [1, 3]  # 4 rows over data 2 x fsdp 2; 3 rows do not split


ROWS_PROGRAM = Path(__file__).resolve().parent / "programs" / "target_rows_on_mesh.py"


def test_the_target_runs_on_its_own_rows_on_each_device(tiny_folder):
    """8 sequences on 8 devices, weights and rows split over the same devices (fsdp): the target's
    MLP runs over one device's rows (`peagle_jax.models.rows.rows_sharded`), not over every
    sequence on every device, which XLA chose without the constraint (8x the target's work, and
    2.6x the temporaries of one device's step for Llama-3.1-8B at 16k tokens on 8 H100s)."""
    got = run_on_8_devices(ROWS_PROGRAM, tiny_folder)
    assert got["global_rows"] == 0 and got["device_rows"] > 0, got
