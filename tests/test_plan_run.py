"""`python -m peagle_jax.plan --run` (`plan.execute`): a planned program compiled for this
machine's devices runs on inputs of its shapes and is timed; the CLI refuses to run a plan for a
device this machine does not have, before compiling anything."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from in_process import run_module

from peagle_jax.models.presets import target_config
from plan.execute import concrete_inputs, run_compiled
from plan.programs import abstract_target, compile_traced, mesh_of
from plan.run import job_programs, run_line

SMALL = dict(hidden_size=128, intermediate_size=256, vocab_size=1024, num_heads=4, num_kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def target():
    cfg = dataclasses.replace(target_config("Llama-3.1-8B", 4), **SMALL)
    return abstract_target(cfg, "float32", mesh_of(jax.devices()[:1]))


@pytest.mark.parametrize("job, mode", [("serve", "parallel"), ("serve", "none"), ("train", "parallel")])
def test_a_planned_program_runs_on_inputs_of_its_shapes(target, job, mode):
    ((name, trace),) = job_programs(job, [mode], target, tokens=128, batch=1, k=3, cache_len=256)
    program, compiled = compile_traced(name, trace)
    assert program.compiled and compiled is not None, program.error
    args, kwargs = concrete_inputs(compiled)
    shapes = [(x.shape, x.dtype) for x in jax.tree.leaves((args, kwargs))]
    assert shapes == [(tuple(i.shape), i.dtype) for i in jax.tree.leaves(compiled.args_info)]
    measured = run_compiled(compiled, steps=2)
    assert measured["step_ms"] > 0 and measured["steps"] == 2
    assert measured["peak_bytes_in_use"] is None  # the CPU keeps no statistics; a GPU / TPU does


def test_the_run_line_sets_measurement_beside_plan():
    rec = {"estimate": {"estimate_seconds": 0.004}, "peak_bytes": 2 << 30}
    text = run_line("serve/decode step", {"step_ms": 5.0, "steps": 5, "peak_bytes_in_use": 3 << 30}, rec)
    assert text == (
        "ran serve/decode step: 5 ms a step (median of 5), estimate (roofline) 4 ms: measured / estimate 1.25; "
        "peak 3.00 GiB in use, planned 2.00 (1.50x)"
    )


def test_run_refuses_a_device_this_machine_has_not():
    r = run_module("peagle_jax.plan", ["--target", "Llama-3.1-8B", "--device", "h200", "--job", "serve", "--run"])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: --run: this machine has 1 x cpu")


def test_the_server_programs_compile_and_run(target):
    """`--job server`: what `python -m infer serve` runs (its prefill calls at their extremes, a step
    over every slot), built over abstract weights and run on inputs of its shapes."""
    programs = job_programs("server", ["parallel"], target, tokens=128, batch=4, k=3, cache_len=256)
    names = [name for name, _ in programs]
    assert names == [
        "server/prefill/parallel rows=1 piece=128 batch=4 cache=256",
        "server/prefill/parallel rows=4 piece=32 batch=4 cache=256",
        "server/step/parallel k=3 batch=4 cache=256",
    ]
    for name, trace in programs:
        program, compiled = compile_traced(name, trace)
        assert program.compiled, program.error
        assert run_compiled(compiled, steps=1)["step_ms"] > 0
