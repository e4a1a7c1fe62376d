"""COD (conditional-on-depth) row layouts for tests and benchmarks.

`cod_sample` is THE COD sampler of docs/method.md section 5: the trainer (`train.cod`) and the
kernel tests/benchmarks (`cod_layout`) both call it:

    depth 0: one row per position (anchor a = t)
    pool   = supervised positions (loss mask), excluding the document's first position
    for d in 1..K-1:
        size = int(max(0, |valid| - d) * max(r**d, r_min)); stop if size <= 0
        sampled = sorted random subset of pool of that size (all of pool if smaller)
        emit rows (anchor = s - d, depth = d) for s in sampled
        pool = {s + 1 for s in sampled} intersected with supervised positions

``|valid|`` is the number of supervised positions of the document. Sampling runs per
document; anchors are positions in the packed row (global), so documents occupy
contiguous anchor ranges. Rows come back sorted by (depth, anchor), the order for which
`kernels.schedule` is tight.
"""

from __future__ import annotations

import numpy as np

__all__ = ["cod_layout", "cod_sample", "doc_ids", "pad_layout"]


def doc_ids(n_positions: int, docs, rng) -> np.ndarray:
    """Per-position document ids. ``docs``: None (one document), an int (that many
    contiguous documents of random lengths >= 1), or an explicit [n_positions] array."""
    if docs is None:
        return np.zeros(n_positions, np.int32)
    if np.ndim(docs) == 0:
        n = int(docs)
        if not 1 <= n <= n_positions:
            raise ValueError(f"docs={n} must be in [1, n_positions={n_positions}]")
        cuts = (
            np.sort(rng.choice(np.arange(1, n_positions), size=n - 1, replace=False))
            if n > 1
            else np.array([], np.int64)
        )
        out = np.zeros(n_positions, np.int32)
        for c in cuts:
            out[c:] += 1
        return out
    out = np.asarray(docs, np.int32)
    if out.shape != (n_positions,):
        raise ValueError(f"docs array must have shape ({n_positions},), got {out.shape}")
    return out


def cod_layout(
    n_positions: int,
    K: int,
    r: float = 0.7,
    r_min: float = 0.2,
    rng=None,
    loss_mask=None,
    docs=None,
    max_anchors: int | None = None,
    pad_to: int | None = None,
):
    """Return numpy int32 (anchor, depth, doc), sorted by (depth, anchor).

    n_positions: tokens in the packed row. K: depths 0..K-1. loss_mask: bool [n_positions]
    (default all supervised). docs: see `doc_ids` (rows of a document with doc id < 0 are
    padding and get no deeper rows). max_anchors: cap on rows per depth >= 1 per document.
    pad_to: append padding rows (doc = -1) up to this many rows.
    """
    rng = np.random.default_rng(rng)
    doc = doc_ids(n_positions, docs, rng)
    sup = np.ones(n_positions, bool) if loss_mask is None else np.asarray(loss_mask, bool)
    if sup.shape != (n_positions,):
        raise ValueError(f"loss_mask must have shape ({n_positions},), got {sup.shape}")
    anchor, depth = cod_sample(sup, doc, K, r, r_min, rng, max_anchors)
    out = anchor, depth, doc[anchor].astype(np.int32)
    if pad_to is not None:
        out = pad_layout(*out, pad_to)
    return out


def cod_sample(loss_mask, docs, K: int, r: float = 0.7, r_min: float = 0.2, rng=None, max_anchors: int | None = None):
    """COD rows of one packed row: numpy int32 (anchor, depth), sorted by (depth, anchor).

    loss_mask: bool [n] (supervised positions); docs: int [n] document ids (< 0 = padding,
    never supervised, no deeper rows). Depth 0 is every position; deeper rows follow the
    nested sampling per document, so a depth-d row (anchor a) exists only with its rows
    (a, 0..d-1), its reference a + d is supervised and in the same document, and no anchor
    precedes its document (never -1). max_anchors caps the rows per depth >= 1 per document.
    rng: a numpy Generator or seed (the only source of randomness).
    """
    rng = np.random.default_rng(rng)
    doc = np.asarray(docs, np.int64)
    n_positions = doc.shape[0]
    sup = np.asarray(loss_mask, bool).copy()
    if sup.shape != (n_positions,):
        raise ValueError(f"loss_mask must have shape ({n_positions},), got {sup.shape}")
    sup &= doc >= 0
    anchors = [np.arange(n_positions, dtype=np.int64)]
    depths = [np.zeros(n_positions, np.int64)]
    for dval in np.unique(doc[doc >= 0]):
        pos = np.nonzero(doc == dval)[0]
        first = pos[0]
        sup_d = np.zeros(n_positions, bool)
        sup_d[pos] = sup[pos]
        n_valid = int(sup_d.sum())
        pool = np.nonzero(sup_d)[0]
        pool = pool[pool != first]
        for d in range(1, K):
            size = int(max(0, n_valid - d) * max(r**d, r_min))
            if max_anchors is not None:
                size = min(size, max_anchors)
            if size <= 0 or pool.size == 0:
                break
            if size >= pool.size:
                sampled = pool
            else:
                sampled = np.sort(rng.choice(pool, size=size, replace=False))
            anchors.append(sampled - d)
            depths.append(np.full(sampled.size, d, np.int64))
            nxt = sampled + 1
            nxt = nxt[nxt < n_positions]
            pool = nxt[sup_d[nxt]]
    anchor = np.concatenate(anchors)
    depth = np.concatenate(depths)
    order = np.lexsort((anchor, depth))
    return anchor[order].astype(np.int32), depth[order].astype(np.int32)


def pad_layout(anchor, depth, doc, length: int):
    """Append padding rows (anchor 0, depth 0, doc -1) up to ``length`` rows."""
    n = len(anchor)
    if length < n:
        raise ValueError(f"pad_to={length} is smaller than the {n} rows of the layout")
    pad = length - n
    return (
        np.concatenate([anchor, np.zeros(pad, np.int32)]).astype(np.int32),
        np.concatenate([depth, np.zeros(pad, np.int32)]).astype(np.int32),
        np.concatenate([doc, np.full(pad, -1, np.int32)]).astype(np.int32),
    )
