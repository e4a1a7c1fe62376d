"""Placement of model weights on a device mesh with axes (data, fsdp, tensor).

One rule table maps parameter roles to PartitionSpecs (Megatron-style tensor parallelism:
column-parallel q/k/v/gate/up and lm_head, row-parallel o/down, vocab-parallel embedding;
the other matrix dimension goes over `fsdp`; MoE expert stacks [E, in, out] are expert-parallel:
experts over `fsdp`, the expert width over `tensor`). A dimension that the mesh axis does not
divide stays replicated, so any model fits any mesh. Activations and caches follow from
the weights through XLA's sharding propagation inside the jitted engine.
"""

from __future__ import annotations

import contextlib
import re

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kernels

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


# role -> axes of the leading dimensions (the rest replicated)
ROLES: dict[str, tuple] = {
    "batch": (("data", "fsdp"),),  # [B, ...] token rows, COD rows, features, per-row metrics
    "replicated": (),  # scalars, per-depth counts, held-out batches
    "vocab_rows": ("tensor", "fsdp"),  # [V, H] rows of an output head (the teacher's lm_head rows)
}


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


def tensor_problem(config, tensor: int) -> str | None:
    """Why `tensor`-way tensor parallelism would not split a target (a TargetConfig) as the rule
    table means to, or None. The attention heads (q/o projections), the hidden size (a head's fc)
    and the vocabulary (embedding rows, lm_head columns) must divide by it: the rule table would
    leave them whole on every device. The KV heads may divide by it (each device holds its own)
    or divide it (fewer KV heads than devices: each is kept by tensor / KV heads devices, as vLLM
    does; the KV cache then lies whole on every device of a data group)."""
    if tensor == 1:
        return None
    sizes = (
        (config.num_heads, f"{config.num_heads} attention heads are"),
        (config.hidden_size, f"hidden size {config.hidden_size} is"),
        (config.vocab_size, f"vocabulary ({config.vocab_size} tokens) is"),
    )
    for n, what in sizes:
        if n % tensor:
            return f"the target's {what} not divisible by {tensor}"
    kv = config.num_kv_heads
    if kv % tensor and tensor % kv:
        return f"the target's {kv} KV heads are neither divisible by {tensor} nor a divisor of it"
    return None


def spec_for(path: str, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> P:
    """The PartitionSpec of one parameter: its rule, minus axes that do not divide it."""
    path = path.replace(".", "/")
    for pattern, axes in RULES:
        if re.search(pattern, path) and len(axes) == len(shape):
            return P(*(a if a is not None and dim % mesh.shape[a] == 0 else None for a, dim in zip(axes, shape)))
    return P()


def state_shardings(state, mesh: jax.sharding.Mesh):
    """The NamedSharding of every array (or ShapeDtypeStruct) of an NNX state pytree by the rule table."""

    def one(path, x):
        # dict keys and list indices name the parameter; attribute keys (a Variable's value) do not
        name = "/".join(
            str(k.key if hasattr(k, "key") else k.idx) for k in path if hasattr(k, "key") or hasattr(k, "idx")
        )
        return NamedSharding(mesh, spec_for(name, x.shape, mesh))

    return jax.tree_util.tree_map_with_path(one, state)


def shard_state(state, mesh: jax.sharding.Mesh):
    """Places every array of an NNX state pytree on `mesh` by the rule table."""
    return jax.device_put(state, state_shardings(state, mesh))


def mesh_shape(data: int, fsdp: int, tensor: int, devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) with one -1 resolved to the devices left; the product must be `devices`."""
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh.data={data} mesh.fsdp={fsdp} mesh.tensor={tensor}: sizes must be >= 1, one may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        sizes[sizes.index(-1)] = devices // known if devices % known == 0 else -1
    if -1 in sizes or int(np.prod(sizes)) != devices:
        raise ValueError(
            f"mesh.data={data} x mesh.fsdp={fsdp} x mesh.tensor={tensor} does not fit the {devices} devices "
            "(the product must equal the device count; -1 = the rest)"
        )
    return sizes[0], sizes[1], sizes[2]


def device_mesh(data: int, fsdp: int, tensor: int) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes over every device of every process (jax.make_mesh
    orders them by the physical topology on TPU/GPU: tensor innermost = the fastest links)."""
    shape = mesh_shape(data, fsdp, tensor, jax.device_count())
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def role_spec(role: str, ndim: int) -> P:
    axes = ROLES[role][:ndim]
    return P(*axes, *([None] * (ndim - len(axes))))


def role_sharding(mesh: jax.sharding.Mesh, role: str, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, role_spec(role, ndim))


def tree_shardings(tree, mesh: jax.sharding.Mesh):
    """NamedShardings of a pytree of parameter-like arrays: each leaf is named by its nearest dict
    key (flat parameter dicts, and optimizer states that mirror them: optax's mu / nu), placed
    by RULES; leaves no rule names (step counters, norms) are replicated."""

    def one(path, x):
        names = [str(k.key) for k in path if hasattr(k, "key")]
        return NamedSharding(mesh, spec_for(names[-1] if names else "", x.shape, mesh))

    return jax.tree_util.tree_map_with_path(one, tree)


def kernels_partitioned(mesh: jax.sharding.Mesh | None):
    """The Pallas attention kernels traced per shard of `mesh` (`kernels.partitioned`): batch rows
    over data x fsdp (as the "batch" role), heads over tensor (as the column-parallel q/k/v
    projections split them). No effect without a mesh."""
    if mesh is None:
        return contextlib.nullcontext()
    return kernels.partitioned(mesh, batch=ROLES["batch"][0], heads=("tensor",))
