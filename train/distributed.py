"""Several hosts through JAX's own runtime (`jax.distributed`): start-up (`peagle_jax.runtime.distributed`,
shared with the server) and the few host-side collectives the loop needs.

Every process runs the same program over the global device mesh (multi-controller JAX): it
tokenizes the whole (small) dataset, builds only its own rows of each global batch and feeds
them with `jax.make_array_from_process_local_data`; process 0 alone writes metrics, summary
and exports (orbax coordinates the sharded checkpoint writes itself). A process that stops
sending heartbeats (a lost host) makes the coordination service stop every other process with
an error after `dist.heartbeat_timeout` seconds, instead of a hang in a collective.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from peagle_jax.runtime import distributed

__all__ = [
    "setup",
    "is_main",
    "multi_process",
    "barrier",
    "to_host",
    "local_rows",
    "sum_over_processes",
    "max_over_processes",
]


# process 0 runs the final speculative evaluation alone while the others wait at shutdown
SHUTDOWN_TIMEOUT_S = 3600


def setup(dc) -> None:
    """`jax.distributed.initialize` when the run spans several processes (call before any JAX op)."""
    distributed.setup(dc, shutdown_timeout=SHUTDOWN_TIMEOUT_S)


def multi_process() -> bool:
    return jax.process_count() > 1


def is_main() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    if multi_process():
        multihost_utils.sync_global_devices(name)


def to_host(tree):
    """numpy copies of every (possibly sharded over processes) array, on every process."""
    if multi_process():
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def local_rows(x) -> np.ndarray:
    """This process's rows of an array split over batch rows (all of it in one process)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    blocks = {s.index[0].indices(x.shape[0])[:2]: s.data for s in x.addressable_shards}
    return np.concatenate([np.asarray(blocks[b]) for b in sorted(blocks)])


def sum_over_processes(x: np.ndarray, block: int) -> np.ndarray:
    """The sum of a host array over processes, each contributing its rows' share; processes
    holding the same rows (same first row `block`: the batch replicated over them) count once."""
    if not multi_process():
        return np.asarray(x)
    x = np.asarray(x, np.float64)
    got = np.asarray(multihost_utils.process_allgather(np.concatenate([[block], x.ravel()])))
    firsts = {int(r[0]): r[1:] for r in got}
    return np.sum(list(firsts.values()), axis=0).reshape(x.shape)


def max_over_processes(n: int) -> int:
    if not multi_process():
        return int(n)
    return int(np.max(multihost_utils.process_allgather(np.asarray(n, np.int64))))
