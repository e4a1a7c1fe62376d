"""An MoE target compiled for an H100 (Qwen3-30B-A3B's widths, a few layers, abstract weights):
the forward at a decode step's rows, where "auto" must not pick `ragged_dot`, which XLA's GPU compiler expands
into a product over every expert, with temporaries of [experts, rows, width]; and the forward of
a long sequence (the train step's features), whose temporaries must not grow with the layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import kernels
from kernels.limits import on_device
from peagle_jax.handles.target import target_apply
from peagle_jax.hardware.devices import parse_device
from peagle_jax.models import moe as moe_mod
from peagle_jax.models.presets import target_config
from plan.programs import abstract_target, compile_program, mesh_of

BATCH = 64


def test_the_gpu_moe_product_is_not_one_over_every_expert(topologies, monkeypatch):
    """The target's forward over a decode step's rows (BATCH rows of one token; the step's cache
    writes and sampling rows left out, whose [rows, vocab] temporaries would hide the MoE's)."""
    c = target_config("Qwen3-30B-A3B", 3)
    every_expert = c.num_experts * BATCH * c.num_experts_per_tok * c.hidden_size * 2  # bf16 [E, rows, H]
    assert features_temp_bytes(topologies, 3, BATCH) < every_expert / 4
    monkeypatch.setattr(moe_mod, "resolve_impl", lambda _="auto": "ragged")
    jax.clear_caches()  # the impl is chosen while tracing: the shipped trace must not be reused
    assert features_temp_bytes(topologies, 3, BATCH) > every_expert  # why "auto" does not pick it on a GPU


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
