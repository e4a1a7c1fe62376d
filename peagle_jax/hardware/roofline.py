"""A roofline estimate of a program's time per device: max(FLOPs / peak FLOP rate, bytes / HBM
bandwidth), labelled as an estimate everywhere it is printed.

FLOPs are counted on the program's jaxpr, not taken from XLA's cost analysis: a deviceless GPU
compile gives none, and XLA counts a loop body once where the jaxpr knows a scan's length. Counted:
every matrix product (2 x output elements x contracted size) and every Pallas kernel's own
analytic estimate (`kernels.cost`, attached to each kernel as its `pl.CostEstimate`), with a
scan's body times its length, a `shard_map` body times its shards, a `cond` at its costliest
branch and a `while` body once (its trip count is data). Elementwise work is not counted.

Bytes: XLA's plan of the program's buffers per device, every argument read once (but for
arguments only gathered from, such as an untied embedding table: `gathered_inputs`) and every
output not aliased to an argument written once. Both are floors of what the device must do, so the
estimate is a lower bound on the time, with one exception: a Pallas attention kernel's FLOPs are
the causal count over its rows (exact for positions in order: the target's attention, decoding over
a full cache; an over-count on the head's COD and DFlash rows, whose layout is only known at run
time: a Llama-3.1-8B train step's FLOPs 1.5% high at 4,096 tokens, 10% at 65,536; docs/device.md)."""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr

__all__ = ["Estimate", "jaxpr_flops", "gathered_inputs", "gathered_bytes", "estimate"]


def jaxpr_flops(jaxpr) -> float:
    """The FLOPs of a (closed) jaxpr, global (all devices together): see the module doc."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    return float(sum(_eqn_flops(e) for e in jaxpr.eqns))


def _eqn_flops(eqn) -> float:
    name, params = eqn.primitive.name, eqn.params
    if name == "dot_general":
        (contract, _), _ = params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
    if name == "pallas_call":
        cost = params.get("cost_estimate")
        return float(cost.flops) if cost is not None else 0.0
    if name == "scan":
        return params["length"] * jaxpr_flops(params["jaxpr"])
    if name == "cond":
        return max(jaxpr_flops(b) for b in params["branches"])
    if name == "while":
        return jaxpr_flops(params["body_jaxpr"])
    inner = sum(jaxpr_flops(j) for j in _sub_jaxprs(params))
    if name == "shard_map":  # the body sees one shard's shapes
        inner *= math.prod(params["mesh"].shape[a] for a in params["newly_manual_axes"])
    return inner


def _sub_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, (Jaxpr, ClosedJaxpr)):
                yield v


GATHERS = frozenset({"gather", "dynamic_slice"})
CALLS = frozenset({"jit", "pjit", "closed_call", "remat", "checkpoint"})


def gathered_inputs(jaxpr) -> list[int]:
    """The positions of a closed jaxpr's inputs that are only gathered from (rows picked, never
    read whole), followed into nested calls (`jit`, remat) that take them as they are."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    return [i for i, v in enumerate(jaxpr.invars) if _only_gathered(jaxpr, v)]


def _only_gathered(jaxpr, var) -> bool:
    used = False
    for eqn in jaxpr.eqns:
        for pos, x in enumerate(eqn.invars):
            if x is not var:
                continue
            used = True
            if not ((eqn.primitive.name in GATHERS and pos == 0) or _gathered_inside(eqn, pos)):
                return False
    return used and not any(o is var for o in jaxpr.outvars)


def _gathered_inside(eqn, pos: int) -> bool:
    """Whether a call's input `pos` is its body's input `pos`, and only gathered from there."""
    inner = eqn.params.get("jaxpr")
    if eqn.primitive.name not in CALLS or not isinstance(inner, (Jaxpr, ClosedJaxpr)):
        return False
    body = inner.jaxpr if isinstance(inner, ClosedJaxpr) else inner
    return len(body.invars) == len(eqn.invars) and _only_gathered(body, body.invars[pos])


def gathered_bytes(jaxpr, compiled) -> int:
    """Per-device bytes of a compiled program's inputs that are only gathered from."""
    # None: an argument the program does not use (no sharding); kept so the positions line up
    shardings = jax.tree.leaves(compiled.input_shardings[0], is_leaf=lambda x: x is None)
    avals = jaxpr.in_avals
    return sum(
        math.prod(shardings[i].shard_shape(avals[i].shape)) * avals[i].dtype.itemsize for i in gathered_inputs(jaxpr)
    )


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A roofline estimate of one program on one device (per device)."""

    flops: float  # per device: the program's FLOPs over the devices
    bytes: int  # per device: arguments read + outputs written (not aliased)
    peak_flops: float  # the device's dense bf16 FLOP rate
    bandwidth: float  # the device's HBM bytes / s

    @property
    def compute_seconds(self) -> float:
        return self.flops / self.peak_flops

    @property
    def memory_seconds(self) -> float:
        return self.bytes / self.bandwidth

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"

    def as_dict(self) -> dict:
        times = dict(compute_seconds=self.compute_seconds, memory_seconds=self.memory_seconds)
        return dataclasses.asdict(self) | times | dict(estimate_seconds=self.seconds, bound=self.bound)


def estimate(flops: float, devices: int, *, argument_bytes, output_bytes, alias_bytes, gathered_bytes=0, device):
    """The estimate of a program of `flops` (global) over `devices` devices of kind `device`
    (anything with `peak_flops` and `bandwidth`), from XLA's per-device byte counts less the
    per-device bytes of the inputs only gathered from."""
    moved = argument_bytes - gathered_bytes + output_bytes - alias_bytes
    return Estimate(flops / devices, int(moved), device.peak_flops, device.bandwidth)
