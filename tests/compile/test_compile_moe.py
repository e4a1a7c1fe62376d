"""An MoE target's plain decode step compiled for an H100 (Qwen3-30B-A3B's widths, 3 layers,
abstract weights): "auto" must not pick `ragged_dot` there, which XLA's GPU compiler expands into
a product over every expert, with temporaries of [experts, rows, width]."""

from __future__ import annotations

import jax
import pytest

from kernels.limits import on_device
from peagle_jax.models import moe as moe_mod
from peagle_jax.plan.devices import parse_device
from peagle_jax.plan.presets import target_config
from peagle_jax.plan.programs import abstract_target, compile_program, mesh_of
from peagle_jax.plan.run import job_programs

BATCH = 64


def decode_step(topologies, monkeypatch, impl: str):
    """The decode step's Program with "auto" resolving to `impl` (None: as shipped)."""
    if impl is not None:
        monkeypatch.setattr(moe_mod, "resolve_impl", lambda _="auto": impl)
    jax.clear_caches()  # the impl is chosen while tracing: no trace of the other case may be reused
    cfg = target_config("Qwen3-30B-A3B", 3)
    target = abstract_target(cfg, "bfloat16", mesh_of(topologies["cuda"][:1], "serve"))
    ((name, trace),) = job_programs("serve", ["none"], target, tokens=0, batch=BATCH, k=7, cache_len=2048, flags=[])
    with on_device(parse_device("h100").kind):
        program = compile_program(name, trace)
    assert program.compiled, program.error
    return program, cfg


@pytest.mark.parametrize("impl", [None, "ragged"])
def test_the_gpu_moe_product_is_not_one_over_every_expert(topologies, monkeypatch, impl):
    program, c = decode_step(topologies, monkeypatch, impl)
    every_expert = c.num_experts * BATCH * c.num_experts_per_tok * c.hidden_size * 2  # bf16 [E, rows, H]
    if impl == "ragged":  # the reason "auto" does not pick it on a GPU (this test can fail)
        assert program.temp_bytes > every_expert
    else:
        assert program.temp_bytes < every_expert / 4
