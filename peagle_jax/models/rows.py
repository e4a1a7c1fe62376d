"""Which devices hold which of the batch's rows while a target is traced: the decoders keep their
hidden states split so, and the MoE layers route each device's tokens on that device."""

from __future__ import annotations

import contextlib
import contextvars

import jax

_ROWS = contextvars.ContextVar("decoder_rows", default=None)


@contextlib.contextmanager
def rows_sharded(sharding):
    """Decoders traced inside keep their hidden states [B, T, H] split by `sharding` (the batch's
    rows over the devices that hold them) from layer to layer. With the weights split over the same
    devices (fsdp), XLA is otherwise free to gather every row's activations to each device instead
    of each layer's weights: a step over 8 sequences on 8 GPUs then ran the target over all 8 on
    every GPU. None: no constraint."""
    token = _ROWS.set(sharding)
    try:
        yield
    finally:
        _ROWS.reset(token)


def rows_sharding():
    """The active `rows_sharded` sharding, or None."""
    return _ROWS.get()


def keep_rows(x: jax.Array) -> jax.Array:
    sharding = _ROWS.get()
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)
