"""Host-side batches: examples -> padded token rows + COD row metadata, in static buckets.

Row space of one sequence x[0..n): row t (the EAGLE shift) holds token x[t+1] and the
target's aux state at t; its teacher is the target's distribution at t+1 (which predicts
x[t+2]); it is supervised when x[t+2] is an assistant token. Rows t >= n-1 are padding
(doc -1). COD rows (anchor, depth) come from `kernels.layouts.cod_sample` (the one sampler),
seeded per (seed, step, sequence), so a resumed run draws exactly the same rows.

Shapes: the sequence length is padded to a bucket (max_len/4, max_len/2, max_len) and the
COD rows to row_factor x bucket (the deepest rows beyond that are dropped, which keeps the
chains nested); chain mode has k_train x bucket rows (every anchor at every step).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kernels.layouts import cod_sample
from train.spec import BatchSpec

__all__ = [
    "Batch",
    "buckets",
    "bucket_for",
    "row_space",
    "cut_rows",
    "row_bucket",
    "chain_rows",
    "make_batch",
    "pad_rows",
]


@dataclasses.dataclass
class Batch:
    tokens: np.ndarray  # int32 [B, L] input ids (0 = padding)
    positions: np.ndarray  # int32 [B, L] (-1 = padding)
    sup: np.ndarray  # bool [B, L] row t supervised (predicts an assistant token)
    anchor: np.ndarray  # int32 [B, N]
    depth: np.ndarray  # int32 [B, N]
    doc: np.ndarray  # int32 [B, N] (-1 = padding row)
    n_tokens: int  # real tokens in the batch


def buckets(max_len: int, count: int = 3) -> tuple[int, ...]:
    return tuple(sorted({max(16, max_len // 4), max(16, max_len // 2), max_len}))[3 - count :]


def bucket_for(n: int, max_len: int, count: int = 3) -> int:
    return next(b for b in buckets(max_len, count) if b >= n)


def row_space(ids: np.ndarray, mask: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(sup [length] bool, doc [length] int32) of one sequence in row space."""
    n = len(ids)
    sup = np.zeros(length, bool)
    if n > 2:
        sup[: n - 2] = mask[2:n]
    doc = np.where(np.arange(length) < n - 1, 0, -1).astype(np.int32)
    return sup, doc


def n_rows(length: int, row_factor: float) -> int:
    return int(np.ceil(row_factor * length / 8.0)) * 8


def row_bucket(real: int, cap: int, granularity: int) -> int:
    """Rows of a batch: its real row count rounded up to `granularity` (0 = always `cap`), at most cap."""
    if granularity <= 0:
        return cap
    return min(cap, int(np.ceil(max(real, 1) / granularity)) * granularity)


def cut_rows(anchor, depth, doc, rows: int):
    """(anchor, depth, doc) int32 [rows] of one sequence's sampled layout, cut to `rows`
    keeping the (depth, anchor) order (so chains stay nested), padded with doc -1 rows."""
    anchor, depth = anchor[:rows], depth[:rows]
    rdoc = doc[anchor]
    pad = rows - len(anchor)
    return (
        np.concatenate([anchor, np.zeros(pad, np.int32)]).astype(np.int32),
        np.concatenate([depth, np.zeros(pad, np.int32)]).astype(np.int32),
        np.concatenate([rdoc, np.full(pad, -1, np.int32)]).astype(np.int32),
    )


def chain_rows(doc, k: int):
    """EAGLE-3 training-time test: every anchor at every step j < k, ordered by (step, anchor);
    row (a, j) is real when a + j is still in a's document."""
    length = len(doc)
    a = np.tile(np.arange(length, dtype=np.int32), k)
    d = np.repeat(np.arange(k, dtype=np.int32), length)
    ref = a + d
    ok = (ref < length) & (doc[a] >= 0)
    ok[ok] &= doc[ref[ok]] == doc[a[ok]]
    return a, d, np.where(ok, doc[a], -1).astype(np.int32)


def make_batch(examples, spec: BatchSpec, step: int, first_row: int = 0, length: int | None = None) -> Batch:
    """A batch of examples (one per row) at `step`, sampled as `spec` says (its mode parallel or
    chain), in the bucket of the longest; COD rows in the row bucket of the longest sampled layout.
    A process building rows [first_row, ...) of a larger batch passes that offset (row seeds are
    global) and the whole batch's `length` bucket."""
    if length is None:
        length = bucket_for(max(len(e.ids) for e in examples), spec.max_len, spec.length_buckets)
    b, mode, k = len(examples), spec.mode, spec.k
    layouts = []
    if mode == "parallel":
        cap = n_rows(length, spec.row_factor)
        for i, e in enumerate(examples):
            sup, doc = row_space(e.ids, e.mask, length)
            rng = np.random.default_rng([spec.seed, step, first_row + i, e.index])
            layouts.append(cod_sample(sup, doc, k, spec.r, spec.r_min, rng, spec.max_anchors))
        rows = row_bucket(max(len(lay[0]) for lay in layouts), cap, spec.row_granularity)
    else:
        rows = k * length
    out = Batch(
        np.zeros((b, length), np.int32),
        np.full((b, length), -1, np.int32),
        np.zeros((b, length), bool),
        np.zeros((b, rows), np.int32),
        np.zeros((b, rows), np.int32),
        np.full((b, rows), -1, np.int32),
        sum(len(e.ids) for e in examples),
    )
    for i, e in enumerate(examples):
        n = len(e.ids)
        out.tokens[i, :n] = e.ids
        out.positions[i, :n] = np.arange(n)
        sup, doc = row_space(e.ids, e.mask, length)
        out.sup[i] = sup
        if mode == "parallel":
            out.anchor[i], out.depth[i], out.doc[i] = cut_rows(*layouts[i], doc, rows)
        else:
            out.anchor[i], out.depth[i], out.doc[i] = chain_rows(doc, k)
    return out


def pad_rows(b: Batch, rows: int) -> Batch:
    """`b` with its COD rows padded (doc -1) to `rows` (processes agree on one row bucket)."""
    pad = rows - b.anchor.shape[1]
    if pad <= 0:
        return b
    z = np.zeros((b.anchor.shape[0], pad), np.int32)
    return dataclasses.replace(
        b,
        anchor=np.concatenate([b.anchor, z], 1),
        depth=np.concatenate([b.depth, z], 1),
        doc=np.concatenate([b.doc, z - 1], 1),
    )
