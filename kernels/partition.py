"""Pallas kernels on a device mesh: each device runs the kernel on its own batch rows and heads.

XLA cannot split a Pallas call by itself: Mosaic (TPU) refuses to be partitioned, and a Triton
call is run whole on every device (its inputs gathered). Attention is independent across batch
rows and (GQA groups of) heads, so under `partitioned(mesh, batch=..., heads=...)` the kernels are
traced inside a `jax.shard_map`: the batch dimension split over the `batch` mesh axes, the heads
over the `heads` axes (query and key/value heads alike, so each device keeps whole GQA groups).
An axis set whose size does not divide the dimension is dropped (that dimension replicated), so
any shape runs on any mesh. The context is read at trace time, like `kernels.for_platform`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["partitioned", "per_shard", "local_rows"]


@dataclasses.dataclass(frozen=True)
class Partition:
    mesh: jax.sharding.Mesh
    batch: tuple[str, ...]
    heads: tuple[str, ...]


_PARTITION = contextvars.ContextVar("kernels_partition", default=None)


@contextlib.contextmanager
def partitioned(mesh, *, batch: tuple[str, ...] = (), heads: tuple[str, ...] = ()):
    """Trace the Pallas kernels per shard of `mesh`: batch rows over the `batch` axes, heads over
    the `heads` axes. Inside it, a kernel call is one `shard_map` (no effect on the XLA backends,
    which XLA partitions itself)."""
    unknown = [a for a in (*batch, *heads) if a not in mesh.shape]
    if unknown:
        raise ValueError(f"mesh axes {unknown} not in the mesh's axes {tuple(mesh.shape)}")
    token = _PARTITION.set(Partition(mesh, tuple(batch), tuple(heads)))
    try:
        yield
    finally:
        _PARTITION.reset(token)


def _axes_dividing(mesh, axes: tuple[str, ...], *dims: int):
    """`axes` (as one spec entry) when their product divides every dim, else None (replicated)."""
    size = math.prod(mesh.shape[a] for a in axes)
    if not axes or size == 1 or any(d % size for d in dims):
        return None
    return axes if len(axes) > 1 else axes[0]


def local_rows(batch: int) -> int:
    """The rows of a batch of `batch` that each device's kernel call sees under the active
    `partitioned` context (`per_shard` splits them over its batch axes when they divide)."""
    part = _PARTITION.get()
    axes = None if part is None else _axes_dividing(part.mesh, part.batch, batch)
    if axes is None:
        return batch
    return batch // math.prod(part.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


# layouts of kernel operands, by the position of their batch ("b") and head ("h") dimensions
_LAYOUTS = {"bthd": ("b", None, "h", None), "bt": ("b", None), "bht": ("b", "h", None), "h": ("h",)}


def per_shard(fn, args: tuple, layouts: tuple[str, ...], out_layouts, *, batch: int, heads: tuple[int, ...]):
    """fn(*args) under the active `partitioned` context: a shard_map whose specs follow each
    operand's layout ("bthd" [B, T, H, D], "bt" [B, T], "bht" [B, H, T], "h" [H]; None operands
    pass through). `batch`: B; `heads`: every head count that must divide (Hq, Hkv).
    Without a context (or on a one-device mesh) it is fn(*args); when neither the batch nor the
    heads split over the mesh, each device runs the whole call."""
    part = _PARTITION.get()
    if part is None:
        return fn(*args)
    b = _axes_dividing(part.mesh, part.batch, batch)
    h = _axes_dividing(part.mesh, part.heads, *heads)
    if b is None and h is None and part.mesh.size == 1:
        return fn(*args)
    # neither dimension splits: every device runs the whole call (still a shard_map: Mosaic
    # refuses XLA's automatic partitioning, and a Triton call would be gathered anyway)

    def spec(layout):
        return P(*({"b": b, "h": h}.get(d) if d else None for d in _LAYOUTS[layout]))

    present = [i for i, a in enumerate(args) if a is not None]

    def body(*xs):
        full = list(args)
        for i, x in zip(present, xs):
            full[i] = x
        return fn(*full)

    out_specs = jax.tree.map(spec, out_layouts)
    sharded = jax.shard_map(
        body,
        mesh=part.mesh,
        in_specs=tuple(spec(layouts[i]) for i in present),
        out_specs=out_specs,
        check_vma=False,
    )
    return sharded(*(args[i] for i in present))
