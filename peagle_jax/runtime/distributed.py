"""Several processes (hosts) as one JAX program (`jax.distributed`, multi-controller JAX): the
settings of the `--dist.*` flags, their checks and the start-up, one definition for the trainer
(`python -m train --dist.*`) and the server (`python -m infer serve --dist.*`).

Every process runs the same program over the global device mesh. A process that stops sending
heartbeats (a lost host) makes the coordination service stop every other one after
`heartbeat_timeout` seconds, instead of a hang in a collective.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap

__all__ = ["DistConfig", "checks", "field_help", "setup"]


@dataclasses.dataclass
class DistConfig:
    coordinator: str | None = None
    """host:port of process 0 for jax.distributed (several hosts); None = one process, unless auto."""
    num_processes: int = 1
    """Processes (hosts) in the run."""
    process_id: int = 0
    """This process's id, 0 .. num_processes-1 (process 0 leads: the trainer's writes and exports, the server's HTTP)."""
    auto: bool = False
    """Let jax.distributed.initialize() detect the cluster (TPU pod slices, SLURM, Open MPI, JAX_COORDINATOR_ADDRESS)."""
    heartbeat_timeout: int = 100
    """Seconds without a peer's heartbeat before the other processes stop with an error (a lost host)."""
    initialization_timeout: int = 300
    """Seconds to wait for every process to join."""


@functools.cache
def field_help() -> dict[str, str]:
    """Each field's docstring (the line under it), for a command line's help (tyro reads them too)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(DistConfig))).body[0].body
    return {
        field.target.id: text.value.value
        for field, text in zip(body, body[1:])
        if isinstance(field, ast.AnnAssign) and isinstance(text, ast.Expr) and isinstance(text.value, ast.Constant)
    }


def checks(dc: DistConfig) -> list[tuple[bool, str]]:
    """(holds, what the flags must be) of each rule the settings follow."""
    return [
        (
            dc.num_processes >= 1 and 0 <= dc.process_id < dc.num_processes,
            "dist.process_id must lie in [0, dist.num_processes)",
        ),
        (
            dc.num_processes == 1 or bool(dc.coordinator) or dc.auto,
            "dist.num_processes > 1 needs --dist.coordinator HOST:PORT (or --dist.auto true)",
        ),
        (dc.heartbeat_timeout >= 1 and dc.initialization_timeout >= 1, "dist timeouts must be >= 1 second"),
    ]


def setup(dc: DistConfig, *, shutdown_timeout: int) -> None:
    """`jax.distributed.initialize` when the run spans several processes (call before any JAX op).
    `shutdown_timeout`: how long a process that ends waits for the others at the exit barrier."""
    if dc.num_processes == 1 and not dc.auto:
        return
    import jax  # here: the flags are parsed and checked before JAX loads

    # CPU hosts need a collectives backend for cross-process all-reduces (GPU/TPU bring their own)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kw = dict(
        heartbeat_timeout_seconds=dc.heartbeat_timeout,
        initialization_timeout=dc.initialization_timeout,
        shutdown_timeout_seconds=shutdown_timeout,
    )
    where = (
        "--dist.auto"
        if dc.auto
        else f"--dist.coordinator {dc.coordinator} (process {dc.process_id} of {dc.num_processes})"
    )
    try:
        if dc.auto:
            jax.distributed.initialize(**kw)
        else:
            jax.distributed.initialize(dc.coordinator, dc.num_processes, dc.process_id, **kw)
    except Exception as e:  # noqa: BLE001 - a peer that never came, a bad address: one line naming the flags
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"jax.distributed.initialize failed for {where}: {msg}") from None
