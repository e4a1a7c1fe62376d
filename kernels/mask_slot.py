"""P-EAGLE attention over COD rows whose deeper rows all read one input: the mask slot.

In the drafter's first layer a row of depth >= 1 reads the mask token and `fc(mask_hidden)`,
so before RoPE every such row has the same q, k and v: its query is the slot's q rotated at
the row's reference position p = anchor + depth, its key the slot's k rotated at p, its value
the slot's v. Two rows with the same p then score every depth-0 key alike; they differ only
in how far their context reaches (anchor = p - depth). So, with W >= every row's depth:

* the depth-0 keys up to p - W - 1 (the *base* of p) are attended once per position, by the
  slot's query at p, in one blockwise call together with the depth-0 rows' own queries
  (2L queries over the L depth-0 keys instead of one query per row);
* each deeper row adds the W + 1 keys at positions p - W .. p: the depth-0 key of a position
  <= its anchor, its own chain's key (anchor, s - anchor) above it (the slot's k rotated at s,
  the same for every chain through s); those are gathered per row and attended densely;
* the two parts are merged through their log-sum-exps (`kernels.chain.merge`).

The result is the P-EAGLE rule of `kernels.spec` exactly, for the rows of a COD layout
(`kernels.layouts.cod_sample`; `check_layout` says what that means): unique (anchor, depth)
rows, depth-0 anchors in [0, L), documents that are contiguous position ranges, and a deeper
row (a, d) with the rows (a, 0..d-1) of its document, a + d < L and d <= W. On other rows it is
wrong: use `kernels.attention`.

At 4096 tokens, K = 8 (~13k COD rows) the blockwise part visits ~2L instead of ~3.3L queries.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from . import dense
from .api import attention
from .chain import merge
from .spec import AttentionSpec

__all__ = ["slot_attention", "check_layout"]


def _take(x, idx):
    """x [B, T, ...] at idx [B, ...] (clipped) -> [B, *idx.shape[1:], ...]."""
    b = x.shape[0]
    flat = jnp.clip(idx, 0, x.shape[1] - 1).reshape(b, -1)
    out = x[jnp.arange(b)[:, None], flat]
    return out.reshape(*idx.shape, *x.shape[2:])


def position_docs(spec: AttentionSpec, length: int):
    """[B, L] int32: the document of each position's depth-0 row (-1: none, or padding)."""
    anchor, depth, doc = spec.q_meta
    rows = jnp.arange(anchor.shape[0])[:, None]
    at = jnp.where((depth == 0) & (doc >= 0) & (anchor >= 0) & (anchor < length), anchor, length)
    return jnp.full((anchor.shape[0], length), -1, jnp.int32).at[rows, at].set(doc, mode="drop")


def slot_attention(q0, k0, v0, q_slot, k_slot, v_slot, spec: AttentionSpec, *, sinks=None, backend="auto", **blocks):
    """Attention of the COD rows of ``spec`` (``AttentionSpec.peagle``; its ``chain_depth`` W
    must be >= every row's depth and >= 1) -> out [B, N, Hq, D] in q0.dtype.

    q0 [B, L, Hq, D], k0 / v0 [B, L, Hkv, D]: the depth-0 row of each position (index =
    anchor = position), q and k rotated. q_slot [B, L, Hq, D], k_slot [B, L, Hkv, D]: the
    slot's q and k rotated at each position; v_slot [B, 1, Hkv, D] (its value has no
    position). ``sinks``, ``backend`` and ``blocks`` (block_q, block_k, interpret,
    num_ranges) as in `kernels.attention`, which runs the base part.
    """
    width = spec.chain_depth
    if width < 1:
        raise ValueError("slot_attention needs spec.chain_depth >= 1 (the deepest row's depth)")
    b, length, hq, d = q0.shape
    if q_slot.shape != q0.shape or k_slot.shape != k0.shape or v_slot.shape != (b, 1, *v0.shape[2:]):
        raise ValueError(
            f"slot_attention: q_slot {q_slot.shape} / k_slot {k_slot.shape} / v_slot {v_slot.shape} do not "
            f"match q0 {q0.shape} / k0 {k0.shape} (v_slot [B, 1, Hkv, D])"
        )
    anchor, depth, doc = spec.q_meta
    window = spec.sliding_window
    pos_doc = position_docs(spec, length)
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))

    real = doc >= 0
    deep = real & (depth >= 1)
    ref = anchor + depth

    # the blockwise part: the depth-0 rows' queries, then the slot's query at each position p over
    # the depth-0 keys up to p - W - 1 (anchor p - W - 1, depth W + 1: the window counts from p; the
    # rule's own-anchor clause would let the key at p - W - 1 through a window <= W + 1, which hides
    # every base key anyway). Positions no deeper row refers to (a prompt) are padding: their
    # query blocks are skipped.
    base = pos - width - 1
    referred = (
        jnp.zeros((b, length), bool).at[jnp.arange(b)[:, None], jnp.where(deep, ref, length)].set(True, mode="drop")
    )
    base_doc = jnp.where((base >= 0) & referred, _take(pos_doc, base), -1)
    if window is not None and window <= width + 1:
        base_doc = jnp.full_like(base_doc, -1)
    zeros = jnp.zeros_like(pos)
    block_spec = dataclasses.replace(
        spec,
        q_anchor=jnp.concatenate([pos, jnp.maximum(base, 0)], 1),
        q_depth=jnp.concatenate([zeros, zeros + width + 1], 1),
        q_doc=jnp.concatenate([pos_doc, base_doc], 1),
        kv_anchor=pos,
        kv_depth=zeros,
        kv_doc=pos_doc,
        chain_depth=0,
    )
    out_b, lse_b = attention(
        jnp.concatenate([q0, q_slot], 1), k0, v0, block_spec, sinks=sinks, backend=backend, return_lse=True, **blocks
    )

    row_block = jnp.where(deep, length + ref, anchor)
    out1 = _take(out_b, row_block)
    lse1 = jnp.moveaxis(_take(jnp.moveaxis(lse_b, 1, 2), row_block), 2, 1)  # [B, Hq, N]
    # a deeper row's base holds keys only when its document reaches back to p - W - 1 (documents
    # are contiguous ranges); a padding row sees nothing
    ok1 = real & (~deep | (_take(base_doc, ref) == doc))
    floor = -jnp.inf if sinks is None else jnp.asarray(sinks, jnp.float32)[None, :, None]
    lse1 = jnp.where(ok1[:, None, :], lse1, floor)
    out1 = jnp.where(ok1[..., None, None], out1, 0)

    # the gathered part of the deeper rows: position s = p - o, o = 0..W
    o = jnp.arange(width + 1, dtype=jnp.int32)
    s = ref[..., None] - o  # [B, N, W + 1]
    chain = o < depth[..., None]  # s > anchor: the row's own chain key (anchor, s - anchor)
    inside = deep[..., None] & (s >= 0) & (s < length)
    seen0 = (_take(pos_doc, s) == doc[..., None]) & (
        (o == depth[..., None]) | (True if window is None else o < window)
    )  # the depth-0 key at s: inside the window, or the row's own anchor (its chain)
    found = inside & (chain | seen0)
    keys = jnp.where(chain[..., None, None], _take(k_slot, s), _take(k0, s))  # [B, N, W + 1, Hkv, D]
    values = jnp.where(chain[..., None, None], v_slot[:, :, None], _take(v0, s))
    n = anchor.shape[1]
    hkv = k0.shape[2]
    out2, lse2 = dense.attention(
        _take(q_slot, ref).reshape(b * n, 1, hq, d),
        keys.reshape(b * n, width + 1, hkv, d),
        values.reshape(b * n, width + 1, hkv, d),
        found.reshape(b * n, 1, width + 1),
        scale=spec.resolved_scale(d),
        softcap=spec.softcap,
    )
    out2, lse2 = out2.reshape(b, n, hq, d), jnp.moveaxis(lse2.reshape(b, n, hq), 1, 2)
    out, _ = merge(out1, lse1, out2, lse2)
    return out.astype(q0.dtype)


def check_layout(anchor, depth, doc, length: int, width: int) -> None:
    """Raise ValueError (naming the batch row and the COD row) unless the rows (numpy [B, N] or
    [N]) are what `slot_attention` is exact for: real rows (doc >= 0) with unique (anchor,
    depth), depth-0 anchors in [0, length), each document's depth-0 rows one contiguous position
    range, and every row (a, d >= 1) with d <= width, a + d < length and the rows (a, 0..d-1) of
    its own document."""
    anchor, depth, doc = (np.atleast_2d(np.asarray(x, np.int64)) for x in (anchor, depth, doc))
    for i in range(anchor.shape[0]):
        a, dd, c = anchor[i], depth[i], doc[i]
        real = np.nonzero(c >= 0)[0]
        rows = {(int(a[j]), int(dd[j])): int(c[j]) for j in real}
        if len(rows) != real.size:
            raise ValueError(f"batch row {i}: two rows share an (anchor, depth)")
        pos_doc = np.full(length, -1, np.int64)
        for j in real[dd[real] == 0]:
            if not 0 <= a[j] < length:
                raise ValueError(f"batch row {i}, COD row {j}: depth-0 anchor {a[j]} outside [0, {length})")
            pos_doc[a[j]] = c[j]
        for x in np.unique(pos_doc[pos_doc >= 0]):
            at = np.nonzero(pos_doc == x)[0]
            if at[-1] - at[0] + 1 != at.size:
                raise ValueError(f"batch row {i}: document {x} is not one contiguous position range")
        for j in real[dd[real] >= 1]:
            x, y = int(a[j]), int(dd[j])
            if y > width or x < 0 or x + y >= length:
                raise ValueError(
                    f"batch row {i}, COD row {j}: (anchor {x}, depth {y}) needs depth <= {width} and "
                    f"0 <= anchor < anchor + depth < {length}"
                )
            if any(rows.get((x, e)) != c[j] for e in range(y)):
                raise ValueError(f"batch row {i}, COD row {j}: (anchor {x}, depth {y}) lacks a row of its chain")
