"""The programs a user runs, built by `peagle_jax.plan` over abstract weights at Llama-3.1-8B's
widths and compiled for one device: the train step of each head mode on a TPU v5e (Mosaic) and an
H100 (Triton and ptxas), the speculative round of each mode plus the plain decode step on the v5e,
the P-EAGLE round and the decode step on the H100. Three target layers, the fewest the heads allow (they read 3
distinct target layers): the layers are one program repeated. Each must compile and plan fewer
bytes than the device holds."""

from __future__ import annotations

import dataclasses

import pytest

from kernels.limits import on_device
from peagle_jax.hardware.devices import parse_device
from peagle_jax.models.presets import target_config
from plan.programs import abstract_target, compile_program, mesh_of
from plan.run import MODES, job_programs

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


PROGRAMS = {}  # (platform, job, mode) -> Program: each compiled once in this module


def compiled(targets, platform: str, job: str, mode: str):
    if (platform, job, mode) not in PROGRAMS:
        PROGRAMS[platform, job, mode] = compile_once(targets, platform, job, mode)
    return PROGRAMS[platform, job, mode]


def compile_once(targets, platform: str, job: str, mode: str):
    device = DEVICE[platform]
    target = targets[platform, job]
    flags = TRAIN_FLAGS[mode] if job == "train" else []
    ((name, trace),) = job_programs(job, [mode], target, tokens=TOKENS, batch=1, k=7, cache_len=CACHE, flags=flags)
    with on_device(device.kind):
        program = compile_program(name, trace)
    assert program.compiled, program.error
    assert program.argument_bytes > 0 and program.output_bytes > 0
    assert 0 < program.peak_bytes < device.memory_bytes
    return program


@pytest.mark.slow  # minutes each on 2 cores: `pytest -m slow -p no:xdist tests/compile`
@pytest.mark.parametrize("mode", MODES["train"])
def test_train_step_compiles_on_a_v5e(targets, mode):
    program = compiled(targets, "tpu", "train", mode)
    assert program.temp_bytes > 0  # activations and gradients


@pytest.mark.parametrize(
    "mode", [m if m == "dflash" else pytest.param(m, marks=pytest.mark.slow) for m in MODES["train"]]
)
def test_train_step_compiles_on_an_h100(targets, mode):
    """Every head's train step through Triton at a bf16 target (DFlash: its block queries and keys
    leave RoPE in f32 beside bf16 values, which Triton's product refused before the kernels
    promoted them to one dtype)."""
    program = compiled(targets, "cuda", "train", mode)
    assert program.temp_bytes > 0


# the chain and DFlash rounds differ from the parallel one in the head only: the slow tier (~30 s)
V5E_SERVE = [pytest.param(m, marks=pytest.mark.slow) if m in ("chain", "dflash") else m for m in MODES["serve"]]


@pytest.mark.parametrize("mode", V5E_SERVE)
def test_serving_round_and_decode_step_compile_on_a_v5e(targets, mode):
    program = compiled(targets, "tpu", "serve", mode)
    assert "peagle_decode_attention" in program.kernels


@pytest.mark.parametrize("mode", ["parallel", "none"])  # the other rounds differ in the head only
def test_round_and_decode_step_compile_on_an_h100(targets, mode):
    compiled(targets, "cuda", "serve", mode)


def test_the_decode_steps_estimate_counts_every_product_and_reads_no_embedding(targets):
    """The roofline estimate of the plain decode step (batch 1, a full cache): its FLOPs are the
    hand count of Llama's products and the decode kernel's pairs; its bytes leave out the untied
    embedding table (rows gathered, never read whole); a P-EAGLE round costs more than one step."""
    from kernels.cost import causal_pairs
    from plan.run import program_estimate

    c = targets["tpu", "serve"].config
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = 2 * h * (q + 2 * kv) + 2 * q * h + 3 * 2 * h * c.intermediate_size
    attention = 4 * c.num_heads * c.head_dim * causal_pairs(1, CACHE)
    step = compiled(targets, "tpu", "serve", "none")
    assert step.flops == c.num_layers * (layer + attention) + 2 * h * c.vocab_size
    assert step.gathered_bytes == c.vocab_size * h * 2  # the bf16 embedding, on one device
    one = dataclasses.replace(DEVICE["tpu"], count=1)
    est = program_estimate(step, one)
    moved = step.argument_bytes - step.gathered_bytes + step.output_bytes - step.alias_bytes
    assert est.bound == "memory" and est.bytes == moved
    round_ = program_estimate(compiled(targets, "tpu", "serve", "parallel"), one)
    assert round_.seconds > est.seconds and round_.flops > 8 * est.flops  # 8 rows verified a round
