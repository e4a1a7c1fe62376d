"""A network's shapes without its weights: (graphdef, abstract state), traced once per network,
config and dtypes.

Loading, saving, checking and converting a model each ask for its shapes, and tracing a
network's constructor (`nnx.eval_shape`) takes a fifth of a second even for a tiny head, longer
for a deep one. Every call gets a state of its own: callers fill it with arrays."""

from __future__ import annotations

import functools

import jax
from flax import nnx

from peagle_jax.config.dtypes import numpy_dtype


def abstract_module(network: type, config, dtype="float32", param_dtype=None):
    """(graphdef, abstract state) of `network(config, dtype=dtype, param_dtype=param_dtype or
    dtype)`: shapes only, nothing allocated."""
    compute = numpy_dtype(dtype).name
    graphdef, state = traced_network(network, config, compute, numpy_dtype(param_dtype or dtype).name)
    return graphdef, jax.tree.map(lambda x: x, state)  # new Variables: the cached ones stay as traced


@functools.lru_cache(maxsize=32)
def traced_network(network: type, config, dtype: str, param_dtype: str):
    """The cached (graphdef, abstract state): its state is shared, read it only."""
    d, pd = numpy_dtype(dtype), numpy_dtype(param_dtype)
    return nnx.split(nnx.eval_shape(lambda: network(config, dtype=d, param_dtype=pd, rngs=nnx.Rngs(0))))
