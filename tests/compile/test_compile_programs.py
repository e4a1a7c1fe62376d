"""The programs a user runs, built by `peagle_jax.plan` over abstract weights at Llama-3.1-8B's
widths and compiled for one device: the train step of each head mode and the speculative round of
each mode plus the plain decode step on a TPU v5e (Mosaic), the P-EAGLE round and the decode step
on an H100 (Triton and ptxas). Three target layers, the fewest the heads allow (they read 3
distinct target layers): the layers are one program repeated. Each must compile and plan fewer
bytes than the device holds."""

from __future__ import annotations

import pytest

from kernels.limits import on_device
from peagle_jax.plan.devices import parse_device
from peagle_jax.plan.presets import target_config
from peagle_jax.plan.programs import abstract_target, compile_program, mesh_of
from peagle_jax.plan.run import MODES, job_programs

TARGET, LAYERS, TOKENS, CACHE = "Llama-3.1-8B", 3, 128, 2048
# the trainer's depths and segments repeat one program: 2 depths, one segment compile it once
ONCE = ["--model.k_train", "2", "--loop.segments", "1"]
TRAIN_FLAGS = {"parallel": ONCE, "chain": ONCE, "dflash": []}
DEVICE = {"tpu": parse_device("v5e-8"), "cuda": parse_device("h100x8")}


@pytest.fixture(scope="module")
def targets(topologies):
    """{(platform, job): an abstract Llama-3.1-8B target on one device of that platform}."""
    cfg = target_config(TARGET, LAYERS)
    return {
        (platform, job): abstract_target(cfg, "bfloat16", mesh_of(devices[:1], job))
        for platform, devices in topologies.items()
        for job in ("train", "serve")
    }


def compiled(targets, platform: str, job: str, mode: str):
    device = DEVICE[platform]
    target = targets[platform, job]
    flags = TRAIN_FLAGS[mode] if job == "train" else []
    ((name, lower),) = job_programs(job, [mode], target, tokens=TOKENS, batch=1, k=7, cache_len=CACHE, flags=flags)
    with on_device(device.kind):
        program = compile_program(name, lower)
    assert program.compiled, program.error
    assert program.argument_bytes > 0 and program.output_bytes > 0
    assert 0 < program.peak_bytes < device.memory_bytes
    return program


@pytest.mark.slow  # minutes each on 2 cores: `pytest -m slow -p no:xdist tests/compile`
@pytest.mark.parametrize("mode", MODES["train"])
def test_train_step_compiles_on_a_v5e(targets, mode):
    program = compiled(targets, "tpu", "train", mode)
    assert program.temp_bytes > 0  # activations and gradients


@pytest.mark.parametrize("mode", MODES["serve"])
def test_serving_round_and_decode_step_compile_on_a_v5e(targets, mode):
    program = compiled(targets, "tpu", "serve", mode)
    assert "peagle_decode_attention" in program.kernels


@pytest.mark.parametrize("mode", ["parallel", "none"])  # the other rounds differ in the head only
def test_round_and_decode_step_compile_on_an_h100(targets, mode):
    compiled(targets, "cuda", "serve", mode)
