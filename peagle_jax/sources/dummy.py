"""Dummy weights, as vLLM's `--load-format dummy`: a target of the right shapes and dtype whose
values are random at a sane scale, made on the device, with no checkpoint read.

For speed and memory runs, where the weights' values do not matter (a bare GPU or TPU machine
that cannot fetch a checkpoint; sizing a job before downloading one). Outputs are meaningless:
a head made for such a target says so (`DrafterConfig.dummy_target`; `inspect` warns).

Matrices, embeddings and expert stacks ~ N(0, 0.02^2) (Hugging Face's `initializer_range`),
norms at their identity (1, or 0 for Gemma's (1 + w) form), biases and attention sinks 0, so
activations stay finite through every layer. One compiled program per distinct (shape,
sharding), not per leaf: a 32-layer model has about ten.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from peagle_jax.config.dtypes import numpy_dtype
from peagle_jax.config.target_config import TargetConfig
from peagle_jax.models.layers import RMSNorm
from peagle_jax.sources.weights import abstract_model

__all__ = ["DUMMY_STD", "LOAD_FORMATS", "dummy_params"]

LOAD_FORMATS = ("auto", "dummy")
DUMMY_STD = 0.02


@functools.cache
def _filler(shape: tuple, dtype, value: float | None, sharding):
    """A jitted program making one leaf: N(0, DUMMY_STD^2) when `value` is None, else constant."""

    def make(key):
        if value is not None:
            return jnp.full(shape, value, dtype)
        return jax.random.normal(key, shape, dtype) * jnp.asarray(DUMMY_STD, dtype)

    return jax.jit(make, out_shardings=sharding)


def _constants(graphdef, abstract) -> dict[tuple, float]:
    """Leaf path -> the constant it starts at: norms at identity; other 1-D leaves (biases,
    sinks) 0. Every other leaf is random."""
    model = nnx.merge(graphdef, abstract)
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, RMSNorm):
            out[(*path, "weight")] = 0.0 if node.offset else 1.0
    for path, var in nnx.to_flat_state(abstract):
        if len(var.get_value().shape) <= 1:
            out.setdefault(tuple(path), 0.0)
    return out


def dummy_params(cfg: TargetConfig, dtype="float32", seed: int = 0, mesh=None):
    """(graphdef, state) of the target Decoder of `cfg` with dummy weights in `dtype`; with a
    `mesh`, every leaf is made in place with the sharding rule table's sharding."""
    from peagle_jax.runtime.sharding import state_shardings

    graphdef, abstract = abstract_model(cfg, numpy_dtype(dtype))
    constants = _constants(graphdef, abstract)
    placed = nnx.to_flat_state(state_shardings(abstract, mesh)) if mesh is not None else []
    shardings = {path: sharding.get_value() for path, sharding in placed}  # each in its Variable
    key = jax.random.key(seed)
    leaves = []
    for i, (path, var) in enumerate(nnx.to_flat_state(abstract)):
        spec = var.get_value()
        sharding = shardings.get(path)
        fill = _filler(tuple(spec.shape), spec.dtype, constants.get(tuple(path)), sharding)
        leaves.append((path, var.replace(fill(jax.random.fold_in(key, i)))))
    return graphdef, nnx.from_flat_state(leaves)
