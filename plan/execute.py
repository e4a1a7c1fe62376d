"""`python -m peagle_jax.plan --run`: each planned program, compiled for this machine's own devices,
executed on inputs of its shapes (weights and activations ~ N(0, 0.02^2), token ids and positions
0, fresh random keys: dummy weights, as `load_format="dummy"`) and timed, so that the plan's bytes
and roofline estimate stand beside what the device does: the median step time and the process's
peak device memory (`memory_stats()["peak_bytes_in_use"]`, a running maximum: programs run in the
plan's order). Inputs a program donates are made again before each call, outside the timing."""

from __future__ import annotations

import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp

RUN_STEPS = 5


@functools.cache
def _maker(shape: tuple, dtype, sharding):
    def make(key):
        if jnp.issubdtype(dtype, jax.dtypes.prng_key):
            return jax.random.split(jax.random.key(0), math.prod(shape)).reshape(shape)
        if jnp.issubdtype(dtype, jnp.floating):
            return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        return jnp.zeros(shape, dtype)

    return jax.jit(make, out_shardings=sharding)


def concrete_inputs(compiled, seed: int = 0):
    """(args, kwargs) of `compiled` (a jax Compiled): one array per argument of its shape, dtype and
    input sharding (the default device's for an argument the program never reads)."""
    infos, tree = jax.tree.flatten(compiled.args_info)
    # an argument the program does not read has no sharding (None): flattened as the arguments are
    shardings = tree.flatten_up_to(compiled.input_shardings)
    key = jax.random.key(seed)
    import sys

    for i, (info, sh) in enumerate(zip(infos, shardings)):
        if len(getattr(sh, "spec", ())) > len(info.shape):
            print("BAD", i, info, sh, file=sys.stderr)
    made = [
        _maker(tuple(info.shape), info.dtype, sharding)(jax.random.fold_in(key, i))
        for i, (info, sharding) in enumerate(zip(infos, shardings))
    ]
    return jax.tree.unflatten(tree, made)


def peak_bytes() -> int | None:
    """The process's peak device memory so far (None where the backend does not say: the CPU)."""
    try:
        return (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None


def run_compiled(compiled, steps: int = RUN_STEPS) -> dict:
    """Executes `compiled` `steps` + 1 times (the first is not timed): {"step_ms" (median),
    "steps", "peak_bytes_in_use"}."""
    donated = any(info.donated for info in jax.tree.leaves(compiled.args_info))
    args, kwargs = concrete_inputs(compiled)
    times = []
    for i in range(steps + 1):
        if donated and i:
            args, kwargs = concrete_inputs(compiled, seed=i)
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args, **kwargs))
        times.append(time.perf_counter() - t)
    return {"step_ms": 1e3 * statistics.median(times[1:]), "steps": steps, "peak_bytes_in_use": peak_bytes()}
