"""The kernels' analytic costs, attached to every Pallas call as its `pl.CostEstimate`: XLA's TPU
scheduler reads them, and `peagle_jax.hardware.roofline` adds them to a program's FLOPs (a Pallas call
is opaque to every cost analysis).

FLOPs count the visible (query, key) pairs as causal over positions in order, each query row the
last of the rows so far (the rows of a training sequence, a decode step's new rows over a full
cache), within the sliding window. A COD or DFlash layout sees fewer pairs than that; its
metadata is only known at run time. Per pair and head-dim element: 4 FLOPs forward (q.k and p.v),
6 for dQ (q.k again, dO.v, dS.k), 8 for dK / dV (q.k, dO.v, p.dO, dS.q). Bytes: every operand read
once and every result written once: the floor a kernel's HBM traffic cannot go below."""

from __future__ import annotations

import numpy as np
from jax.experimental import pallas as pl

__all__ = ["causal_pairs", "attention_cost"]

FLOPS_PER_PAIR = {"fwd": 4, "dq": 6, "dkv": 8}


def causal_pairs(tq: int, tk: int, window: int | None = None) -> int:
    """Keys seen, summed over `tq` query rows that are the last `tq` of `tk` positions in order."""
    seen = np.arange(tk - tq, tk, dtype=np.int64) + 1
    return int(np.clip(seen, 0, window or tk).sum())


def attention_cost(kind: str, b: int, tq: int, hq: int, tk: int, hkv: int, d: int, itemsize: int, window=None):
    """The cost of one attention kernel ("fwd", "dq" or "dkv") over q [b, tq, hq, d] and k / v
    [b, tk, hkv, d] of `itemsize` bytes (gradients and statistics in float32). A decode step's
    kernel is a "fwd" of its new rows over the whole cache."""
    pairs = b * hq * causal_pairs(tq, tk, window)
    q, kv, stats = b * tq * hq * d, b * tk * hkv * d, b * hq * tq * 4
    moved = {
        "fwd": itemsize * (2 * q + 2 * kv) + stats,  # q, k, v in; o, lse out
        "dq": itemsize * (2 * q + 2 * kv) + 2 * stats + 4 * q,  # q, dO, k, v, lse, delta in; dQ out
        "dkv": itemsize * (2 * q + 2 * kv) + 2 * stats + 8 * kv,  # ... in; dK, dV out
    }[kind]
    return pl.CostEstimate(flops=FLOPS_PER_PAIR[kind] * pairs * d, transcendentals=pairs, bytes_accessed=moved)
