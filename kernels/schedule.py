"""Block schedules: which KV blocks each query block must visit, computed inside jit.

Rows are cut into blocks (``block_q`` query rows, ``block_k`` key rows). A block pair
(i, j) is *non-empty* when some query row of block i may see some key row of block j, and
*full* when every query row of i sees every key row of j (then the kernels skip the mask
arithmetic). The schedule is computed from per-block summaries of the metadata, never
from a dense mask: O(T) to summarise, O(nQ * nK) small integer ops to pair up.

Summaries. The valid rows (doc >= 0) of a block are split in two segments: the rows at the
block's smallest depth ("lo") and the rest ("hi"). Each segment keeps count, min/max of
depth, anchor and doc. A segment pair may hold a visible pair when the docs overlap and

* (causal branch) the key segment contains depth-0 rows, ``min anchor_k <= max anchor_q``
  and, with a window, ``min ref_q - max anchor_k < window`` (ref = anchor + depth, the
  reference position the window counts from, `kernels.spec.visible`); or
* (chain branch) ``min depth_k <= max depth_q`` and the anchor ranges overlap.

These tests are conservative (a superset of the non-empty pairs) for ANY row order, so
every backend is correct for any layout. They are tight when the rows of a COD layout are
sorted by (depth, anchor) with anchors = positions in the packed row (what
`kernels.layouts.cod_layout` returns): a block then spans at most two depths, each segment
covers a contiguous run of anchors, and each query block needs at most ~K contiguous
KV-block ranges (depth-0 causal prefix + one range per depth for the row's own chain), at
most 2K - 1 for a block that straddles two depths. Unsorted layouts stay correct but skip
fewer blocks.

Representation (`BlockSchedule`): for each (batch, query block) up to ``num_ranges``
half-open KV-block ranges, their total count, and one range of full blocks; the same,
transposed (for each KV block the query blocks that see it) for the dK/dV pass. When a row
has more runs than ``num_ranges`` the overflow runs are merged into the last range (less
sparse, still correct).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from .spec import AttentionSpec

__all__ = [
    "BlockSchedule",
    "make_schedule",
    "build_schedule",
    "block_masks",
    "flat_ids",
    "range_offsets",
    "pad_rows",
    "DEFAULT_NUM_RANGES",
]

DEFAULT_NUM_RANGES = 16
_BIG = 1 << 30


@dataclasses.dataclass(frozen=True)
class BlockSchedule:
    """Block-sparse schedule (a pytree; block sizes are static)."""

    fwd_ranges: Any  # [B, nQ, R, 2] int32 (start, end) KV-block ranges, non-empty ones first
    fwd_count: Any  # [B, nQ] int32 number of KV blocks to visit
    fwd_full: Any  # [B, nQ, 2] int32 (start, end): KV blocks fully visible (no mask)
    bwd_ranges: Any  # [B, nK, R, 2] int32 query-block ranges per KV block (dK/dV pass)
    bwd_count: Any  # [B, nK] int32
    bwd_full: Any  # [B, nK, 2] int32
    block_q: int
    block_k: int

    @property
    def num_q_blocks(self) -> int:
        return self.fwd_count.shape[1]

    @property
    def num_kv_blocks(self) -> int:
        return self.bwd_count.shape[1]

    def visited_fraction(self):
        """Fraction of the (query block, KV block) pairs that the kernels visit."""
        B, nq = self.fwd_count.shape
        return jnp.sum(self.fwd_count) / (B * nq * self.num_kv_blocks)

    def skipped_fraction(self):
        return 1.0 - self.visited_fraction()


jax.tree_util.register_dataclass(
    BlockSchedule,
    data_fields=["fwd_ranges", "fwd_count", "fwd_full", "bwd_ranges", "bwd_count", "bwd_full"],
    meta_fields=["block_q", "block_k"],
)


# ---------------------------------------------------------------------------------------
def pad_rows(x, multiple: int, value: int):
    """Pad the last axis of an int array [B, T] up to a multiple of ``multiple``."""
    T = x.shape[-1]
    Tp = -(-T // multiple) * multiple
    if Tp == T:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, Tp - T)], constant_values=value)


def _pad_meta(anchor, depth, doc, block):
    return (pad_rows(anchor, block, 0), pad_rows(depth, block, 0), pad_rows(doc, block, -1))


def _seg_stats(anchor, depth, doc, sel):
    """min/max statistics over the rows selected by ``sel``; arrays [B, n, b] -> [B, n]."""

    def mn(x):
        return jnp.min(jnp.where(sel, x, _BIG), axis=-1)

    def mx(x):
        return jnp.max(jnp.where(sel, x, -_BIG), axis=-1)

    return dict(
        cnt=jnp.sum(sel, axis=-1, dtype=jnp.int32),
        amin=mn(anchor),
        amax=mx(anchor),
        dmin=mn(depth),
        dmax=mx(depth),
        rmin=mn(anchor + depth),  # reference positions (the window counts from them)
        rmax=mx(anchor + depth),
        cmin=mn(doc),
        cmax=mx(doc),
    )


def _summaries(anchor, depth, doc, block):
    """Whole-block stats [B, n] and segment stats [B, n, 2] (segments lo, hi)."""
    B, T = anchor.shape
    n = T // block
    a, d, c = (x.reshape(B, n, 1, block) for x in (anchor, depth, doc))
    valid = c >= 0
    whole = _seg_stats(a[:, :, 0], d[:, :, 0], c[:, :, 0], valid[:, :, 0])
    dlo = whole["dmin"][:, :, None, None]
    seg = jnp.concatenate([valid & (d == dlo), valid & (d > dlo)], axis=2)  # [B, n, 2, b]
    return whole, _seg_stats(a, d, c, seg)


def block_masks(q_meta, kv_meta, block_q: int, block_k: int, sliding_window=None):
    """(nonempty, full) bool [B, nQ, nK] from padded metadata (T multiples of the blocks).

    ``nonempty`` is a superset of the truly non-empty block pairs; ``full`` a subset of the
    truly full ones (see the module docstring)."""
    qw, qs = _summaries(*q_meta, block_q)
    kw, ks = _summaries(*kv_meta, block_k)
    W = sliding_window

    def qx(f):  # [B, nQ, 1, 2, 1]: query segments
        return qs[f][:, :, None, :, None]

    def kx(f):  # [B, 1, nK, 1, 2]: key segments
        return ks[f][:, None, :, None, :]

    both = (qx("cnt") > 0) & (kx("cnt") > 0) & (qx("cmin") <= kx("cmax")) & (kx("cmin") <= qx("cmax"))
    causal = (kx("dmin") <= 0) & (kx("dmax") >= 0) & (kx("amin") <= qx("amax"))
    if W is not None:
        causal = causal & (qx("rmin") - kx("amax") < W)
    chain = (kx("dmin") <= qx("dmax")) & (kx("amin") <= qx("amax")) & (qx("amin") <= kx("amax"))
    nonempty = jnp.any(both & (causal | chain), axis=(3, 4))

    def qw_(f):
        return qw[f][:, :, None]

    def kw_(f):
        return kw[f][:, None, :]

    full = (
        (qw_("cnt") == block_q)
        & (kw_("cnt") == block_k)
        & (kw_("dmin") == 0)
        & (kw_("dmax") == 0)
        & (qw_("cmin") == qw_("cmax"))
        & (kw_("cmin") == kw_("cmax"))
        & (qw_("cmin") == kw_("cmin"))
        & (kw_("amax") <= qw_("amin"))
    )
    if W is not None:  # inside the causal range is not enough: every key within every query's window
        full = full & (qw_("rmax") - kw_("amin") < W)
    return nonempty, full & nonempty


def _runs_to_ranges(mask, num_ranges: int):
    """bool [..., n] -> (ranges [..., R, 2], count [...]) covering every set entry.

    The r-th run starts at #{p : cumsum(starts)[p] <= r} (the index of the (r+1)-th start);
    runs past the R-th are merged into the last range."""
    R = num_ranges
    prev = jnp.concatenate([jnp.zeros_like(mask[..., :1]), mask[..., :-1]], axis=-1)
    nxt = jnp.concatenate([mask[..., 1:], jnp.zeros_like(mask[..., :1])], axis=-1)
    cs = jnp.cumsum(mask & ~prev, axis=-1, dtype=jnp.int32)  # runs started so far
    ce = jnp.cumsum(mask & ~nxt, axis=-1, dtype=jnp.int32)  # runs ended so far
    r = jnp.arange(R, dtype=jnp.int32)
    st = jnp.sum(cs[..., None, :] <= r[:, None], axis=-1, dtype=jnp.int32)
    en = jnp.sum(ce[..., None, :] <= r[:, None], axis=-1, dtype=jnp.int32) + 1
    nruns = cs[..., -1:]
    last = ce.shape[-1] - jnp.sum(
        jnp.cumsum(mask[..., ::-1], axis=-1) == 0, axis=-1, dtype=jnp.int32
    )  # last set index + 1
    en = jnp.where((r == R - 1) & (nruns > R), last[..., None], en)
    ok = r < nruns
    st = jnp.where(ok, st, 0)
    en = jnp.where(ok, en, 0)
    return jnp.stack([st, en], axis=-1), jnp.sum(en - st, axis=-1)


def _first_run(mask):
    """bool [..., n] -> [..., 2] (start, end) of the first run of True (0, 0 if none)."""
    prev = jnp.concatenate([jnp.zeros_like(mask[..., :1]), mask[..., :-1]], axis=-1)
    nxt = jnp.concatenate([mask[..., 1:], jnp.zeros_like(mask[..., :1])], axis=-1)
    any_ = jnp.any(mask, axis=-1)
    s = jnp.argmax(mask & ~prev, axis=-1).astype(jnp.int32)
    e = jnp.argmax(mask & ~nxt, axis=-1).astype(jnp.int32) + 1
    return jnp.stack([jnp.where(any_, s, 0), jnp.where(any_, e, 0)], axis=-1)


def build_schedule(
    q_meta, kv_meta, block_q: int, block_k: int, sliding_window=None, num_ranges: int = DEFAULT_NUM_RANGES
) -> BlockSchedule:
    """Schedule from metadata whose lengths are already multiples of the block sizes."""
    nonempty, full = block_masks(q_meta, kv_meta, block_q, block_k, sliding_window)
    f_ranges, f_count = _runs_to_ranges(nonempty, num_ranges)
    b_ranges, b_count = _runs_to_ranges(jnp.swapaxes(nonempty, 1, 2), num_ranges)
    return BlockSchedule(
        fwd_ranges=f_ranges,
        fwd_count=f_count.astype(jnp.int32),
        fwd_full=_first_run(full),
        bwd_ranges=b_ranges,
        bwd_count=b_count.astype(jnp.int32),
        bwd_full=_first_run(jnp.swapaxes(full, 1, 2)),
        block_q=block_q,
        block_k=block_k,
    )


def make_schedule(
    spec: AttentionSpec, block_q: int, block_k: int, num_ranges: int = DEFAULT_NUM_RANGES
) -> BlockSchedule:
    """Schedule for ``spec`` (rows padded internally to block multiples with doc = -1)."""
    qm = _pad_meta(*spec.q_meta, block_q)
    km = _pad_meta(*spec.kv_meta, block_k)
    return build_schedule(qm, km, block_q, block_k, spec.sliding_window, num_ranges)


def range_offsets(ranges):
    """ranges [..., R, 2] -> (starts [..., R], exclusive step offsets [..., R], lengths)."""
    st = ranges[..., 0]
    ln = ranges[..., 1] - st
    off = jnp.cumsum(ln, axis=-1) - ln
    return st, off, ln


def flat_ids(ranges, count, steps: int):
    """Block id visited at each step: [..., steps] int32. Steps past ``count`` repeat the last
    visited block (so a pipelined kernel does not fetch anything new); 0 when count == 0."""
    st, off, ln = range_offsets(ranges)
    s = jnp.arange(steps, dtype=jnp.int32)
    s = jnp.minimum(s, jnp.maximum(count[..., None] - 1, 0))  # [..., steps]
    cum = off + ln  # inclusive ends
    r = jnp.sum(s[..., :, None] >= cum[..., None, :], axis=-1)  # range index of s
    r = jnp.minimum(r, ranges.shape[-2] - 1)
    st_r = jnp.take_along_axis(st, r, axis=-1)
    off_r = jnp.take_along_axis(off, r, axis=-1)
    return (st_r + s - off_r).astype(jnp.int32)
