"""Placement of model weights on a device mesh with axes (data, fsdp, tensor).

One rule table maps parameter roles to PartitionSpecs (Megatron-style tensor parallelism:
column-parallel q/k/v/gate/up and lm_head, row-parallel o/down, vocab-parallel embedding;
the other matrix dimension goes over `fsdp`; MoE expert stacks [E, in, out] are expert-parallel:
experts over `fsdp`, the expert width over `tensor`). A dimension that the mesh axis does not
divide stays replicated, so any model fits any mesh. Activations and caches follow from
the weights through XLA's sharding propagation inside the jitted engine.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")

# (regex over the '/'-joined parameter path, spec by dimension); first match wins
RULES: tuple[tuple[str, tuple], ...] = (
    (r"experts/(gate_up_proj|gate_proj|up_proj)$", ("fsdp", None, "tensor")),
    (r"experts/down_proj$", ("fsdp", "tensor", None)),
    (r"experts/gate_up_proj_bias$", ("fsdp", "tensor")),
    (r"experts/down_proj_bias$", ("fsdp", None)),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", ("fsdp", "tensor")),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/bias$", ("tensor",)),
    (r"(o_proj|down_proj)/kernel$", ("tensor", "fsdp")),
    (r"embed_tokens/embedding$", ("tensor", "fsdp")),
    (r"lm_head/kernel$", ("fsdp", "tensor")),
    (r"fc/kernel$", ("fsdp", "tensor")),
)


def make_mesh(tensor: int | None = None, fsdp: int = 1, data: int = 1, devices=None) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes (sharding propagates through plain jit).

    tensor None = all devices not used by data * fsdp."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor is None:
        tensor = len(devices) // (data * fsdp)
    n = data * fsdp * tensor
    if n > len(devices) or n < 1:
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} needs {n} devices, {len(devices)} available"
        )
    grid = np.asarray(devices[:n]).reshape(data, fsdp, tensor)
    return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def spec_for(path: str, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> P:
    """The PartitionSpec of one parameter: its rule, minus axes that do not divide it."""
    for pattern, axes in RULES:
        if re.search(pattern, path) and len(axes) == len(shape):
            return P(*(a if a is not None and dim % mesh.shape[a] == 0 else None for a, dim in zip(axes, shape)))
    return P()


def shard_state(state, mesh: jax.sharding.Mesh):
    """Places every array of an NNX state pytree on `mesh` by the rule table."""

    def place(path, x):
        # dict keys and list indices name the parameter; attribute keys (a Variable's value) do not
        name = "/".join(
            str(k.key if hasattr(k, "key") else k.idx) for k in path if hasattr(k, "key") or hasattr(k, "idx")
        )
        return jax.device_put(x, NamedSharding(mesh, spec_for(name, x.shape, mesh)))

    return jax.tree_util.tree_map_with_path(place, state)
