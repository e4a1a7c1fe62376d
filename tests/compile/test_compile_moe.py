"""An MoE target compiled for an H100 (Qwen3-30B-A3B's widths, a few layers, abstract weights):
the plain decode step, where "auto" must not pick `ragged_dot`, which XLA's GPU compiler expands
into a product over every expert, with temporaries of [experts, rows, width]; and the forward of
a long sequence (the train step's features), whose temporaries must not grow with the layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kernels
from kernels.limits import on_device
from peagle_jax.models import moe as moe_mod
from peagle_jax.models.presets import target_config
from peagle_jax.plan.devices import parse_device
from peagle_jax.target import target_apply
from plan.programs import abstract_target, compile_program, mesh_of
from plan.run import job_programs

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


def features_temp_bytes(topologies, layers: int, tokens: int) -> int:
    """Temporaries of the target's forward over one sequence (no cache, no logits) on one H100."""
    target = abstract_target(target_config("Qwen3-30B-A3B", layers), "bfloat16", mesh_of(topologies["cuda"][:1]))
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)

    def trace():
        forward = jax.jit(
            lambda state, ids: target_apply(target.graphdef, state, ids, ids, compute_logits=False).hidden
        )
        with kernels.for_platform("cuda"):  # the GPU's kernels, as the plan's programs trace them
            return forward.trace(target.state, ids)

    with on_device(parse_device("h100").kind):
        program = compile_program(f"features layers={layers}", trace)
    assert program.compiled, program.error
    return program.temp_bytes


def test_the_gpu_moe_layers_temporaries_do_not_add_up(topologies):
    """A layer's MoE buffers live while that layer runs, not from the start: XLA's GPU compiler had
    fused every layer's zeros into one kernel run first (the padded rows [rows, H] scattered into,
    the block loop's outputs, the f32 [tokens, H] the pairs were added into), so each layer added
    about 2 x [rows, H] bf16 + [tokens, H] f32 to the plan (0.19 GiB here). The bound, half of one
    layer's f32 sum, catches any of them."""
    tokens, cfg = 2048, target_config("Qwen3-30B-A3B", 3)
    three, six = (features_temp_bytes(topologies, n, tokens) for n in (3, 6))
    assert six - three < tokens * cfg.hidden_size * 4 / 2, (three, six)
