"""`AttentionSpec`: per-row metadata that defines which key each query row may see.

Every row (query or key) carries three int32 numbers:

* ``anchor``: the position the row hangs off. For plain causal attention ``anchor`` is the
  token position; for P-EAGLE COD rows it is the anchor of the row's chain (the reference
  position is ``anchor + depth``).
* ``depth``: 0 for ordinary rows, ``d >= 1`` for the P-EAGLE rows of depth ``d``.
* ``doc``: document id; ``doc < 0`` marks a padding row, which never attends and is never
  attended.

The rule (P-EAGLE, docs/method.md section 5; plain causal is the case "all depths 0"):

    visible(q, k) = doc_q == doc_k  and  doc_q >= 0  and  doc_k >= 0  and
                    ( (depth_k == 0 and anchor_k <= anchor_q and in_window)
                      or (anchor_k == anchor_q and depth_k <= depth_q) )
    in_window     = sliding_window is None or (anchor_q + depth_q) - anchor_k < sliding_window

A sliding window counts from the query's *reference position* ``anchor_q + depth_q`` (the
position id of the row): a row sees the depth-0 rows inside the window of its reference
position, and its own chain always (speculators' P-EAGLE mask, `create_peagle_mask_mod`). For
plain causal rows (depth 0, anchor = position) it is the positional window of Hugging Face and
vLLM: ``pos_q - pos_k < sliding_window``.

Anchors are compared across the whole row of a packed batch, so use positions in the
*packed* sequence (or per-document positions: the rule is still correct because ``doc``
must match; only the block schedule may be less sparse, see `kernels.schedule`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["AttentionSpec", "visible"]


def visible(q_anchor, q_depth, q_doc, kv_anchor, kv_depth, kv_doc, sliding_window=None):
    """The attention rule on broadcastable int arrays (e.g. [Tq, 1] against [1, Tk]).

    Pure elementwise jnp, so it runs unchanged inside the XLA path and inside the Pallas
    kernels (Triton and Mosaic lowerings).
    """
    same_doc = (q_doc == kv_doc) & (q_doc >= 0) & (kv_doc >= 0)
    causal0 = (kv_depth == 0) & (kv_anchor <= q_anchor)
    if sliding_window is not None:  # the window of the query's reference position
        causal0 = causal0 & (q_anchor + q_depth - kv_anchor < sliding_window)
    chain = (kv_anchor == q_anchor) & (kv_depth <= q_depth)
    return same_doc & (causal0 | chain)


def _as_i32(x, name):
    a = jnp.asarray(x)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError(f"AttentionSpec.{name} must be [B, T] (or [T]); got shape {a.shape}")
    if not jnp.issubdtype(a.dtype, jnp.integer):
        raise ValueError(f"AttentionSpec.{name} must be an integer array; got dtype {a.dtype}")
    return a.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Per-row metadata (arrays) + static configuration of one attention call.

    Array fields (pytree children): ``q_anchor, q_depth, q_doc`` [B, Tq] int32 and
    ``kv_anchor, kv_depth, kv_doc`` [B, Tk] int32. Static fields (pytree aux data, part of
    the jit cache key): ``sliding_window`` (a depth-0 key outside the window of the query's
    reference position, ``q_anchor + q_depth - kv_anchor >= window``, is hidden), ``softcap``
    (scores become ``c * tanh(s / c)``), ``scale`` (default ``1/sqrt(D)``), ``chain_depth`` (a
    speed setting of the blockwise backends, the same result for any value: the keys of depth
    1..chain_depth of each query's own chain are gathered outside the block loop, `kernels.chain`;
    0 = none; a COD layout with depths < K wants K - 1).

    Build it with :meth:`causal`, :meth:`peagle` or :meth:`block` (DFlash); the dataclass constructor takes the
    arrays as they are (use :meth:`make` to validate and broadcast 1-D inputs).
    """

    q_anchor: Any
    q_depth: Any
    q_doc: Any
    kv_anchor: Any
    kv_depth: Any
    kv_doc: Any
    sliding_window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    chain_depth: int = 0

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def make(
        cls,
        q_anchor,
        q_depth,
        q_doc,
        kv_anchor,
        kv_depth,
        kv_doc,
        *,
        sliding_window=None,
        softcap=None,
        scale=None,
        chain_depth=0,
    ) -> AttentionSpec:
        """Validating constructor: accepts [T] or [B, T] integer arrays, casts to int32."""
        arrs = dict(
            q_anchor=q_anchor, q_depth=q_depth, q_doc=q_doc, kv_anchor=kv_anchor, kv_depth=kv_depth, kv_doc=kv_doc
        )
        arrs = {k: _as_i32(v, k) for k, v in arrs.items()}
        qs = {arrs[k].shape for k in ("q_anchor", "q_depth", "q_doc")}
        ks = {arrs[k].shape for k in ("kv_anchor", "kv_depth", "kv_doc")}
        if len(qs) != 1 or len(ks) != 1:
            raise ValueError(f"AttentionSpec: q metadata shapes {qs} / kv metadata shapes {ks} differ")
        (bq, _), (bk, _) = qs.pop(), ks.pop()
        if bq != bk:
            raise ValueError(f"AttentionSpec: q batch {bq} != kv batch {bk}")
        if sliding_window is not None:
            sliding_window = int(sliding_window)
            if sliding_window < 1:
                raise ValueError(f"AttentionSpec.sliding_window must be >= 1, got {sliding_window}")
        if softcap is not None:
            softcap = float(softcap)
            if softcap <= 0:
                raise ValueError(f"AttentionSpec.softcap must be > 0, got {softcap}")
        if scale is not None:
            scale = float(scale)
        if isinstance(chain_depth, bool) or int(chain_depth) != chain_depth or chain_depth < 0:
            raise ValueError(f"AttentionSpec.chain_depth must be an integer >= 0, got {chain_depth!r}")
        return cls(**arrs, sliding_window=sliding_window, softcap=softcap, scale=scale, chain_depth=int(chain_depth))

    @classmethod
    def causal(
        cls,
        q_positions,
        kv_positions=None,
        *,
        q_doc=None,
        kv_doc=None,
        q_valid=None,
        kv_valid=None,
        sliding_window=None,
        softcap=None,
        scale=None,
    ) -> AttentionSpec:
        """Plain causal attention: depth 0 everywhere, anchor = position.

        ``q_doc``/``kv_doc``: document ids (packed sequences); default one document.
        ``q_valid``/``kv_valid``: bool masks; invalid rows become padding (doc = -1).
        ``kv_positions`` defaults to ``q_positions`` (self-attention).
        """
        qp = _as_i32(q_positions, "q_positions")
        self_attn = kv_positions is None
        kp = qp if self_attn else _as_i32(kv_positions, "kv_positions")

        def docs(doc, valid, pos, name):
            d = jnp.zeros_like(pos) if doc is None else jnp.broadcast_to(_as_i32(doc, name), pos.shape)
            if valid is not None:
                v = jnp.broadcast_to(jnp.asarray(valid, bool).reshape(-1, pos.shape[-1]), pos.shape)
                d = jnp.where(v, d, -1)
            return d

        qd = docs(q_doc, q_valid, qp, "q_doc")
        if self_attn and kv_doc is None and kv_valid is None:
            kd = qd
        else:
            kd = docs(
                kv_doc if kv_doc is not None else (q_doc if self_attn else None),
                kv_valid if kv_valid is not None else (q_valid if self_attn else None),
                kp,
                "kv_doc",
            )
        return cls.make(
            qp,
            jnp.zeros_like(qp),
            qd,
            kp,
            jnp.zeros_like(kp),
            kd,
            sliding_window=sliding_window,
            softcap=softcap,
            scale=scale,
        )

    @classmethod
    def peagle(
        cls, anchor, depth, doc, *, sliding_window=None, softcap=None, scale=None, chain_depth=0
    ) -> AttentionSpec:
        """P-EAGLE self-attention over COD rows (queries and keys are the same rows)."""
        a, d, c = _as_i32(anchor, "anchor"), _as_i32(depth, "depth"), _as_i32(doc, "doc")
        return cls.make(
            a, d, c, a, d, c, sliding_window=sliding_window, softcap=softcap, scale=scale, chain_depth=chain_depth
        )

    @classmethod
    def block(cls, block_anchor, block_doc, context_positions, context_doc, *, block_size, scale=None) -> AttentionSpec:
        """DFlash block attention: queries are ``n`` blocks of ``block_size`` rows, keys are the
        context rows followed by the same blocks (``[context | blocks]``, the order the drafter
        concatenates its keys in).

        ``block_anchor`` / ``block_doc`` [B, n]: the anchor position of each block (its first row,
        the bonus token) and its document (-1: a padding block); ``context_positions`` /
        ``context_doc`` [B, S]: each context row's position and document. A block sees the
        context rows of its document strictly before its anchor and every row of its own block
        (bidirectional); blocks never see each other. That is the P-EAGLE rule with every block
        row at anchor ``a - 1`` and depth 1: the context rows ``p <= a - 1`` are its depth-0 keys,
        its own block is its "chain" (same anchor, same depth). Anchors must differ within a
        document (two blocks at one anchor would see each other).
        """
        a, bd = _as_i32(block_anchor, "block_anchor"), _as_i32(block_doc, "block_doc")
        cp, cd = _as_i32(context_positions, "context_positions"), _as_i32(context_doc, "context_doc")
        rows = lambda x: jnp.repeat(x, int(block_size), axis=1)  # noqa: E731 - [B, n] -> [B, n * block_size]
        qa, qd = rows(a - 1), rows(bd)
        return cls.make(
            qa,
            jnp.ones_like(qa),
            qd,
            jnp.concatenate([cp, qa], axis=1),
            jnp.concatenate([jnp.zeros_like(cp), jnp.ones_like(qa)], axis=1),
            jnp.concatenate([cd, qd], axis=1),
            scale=scale,
        )

    # -- helpers ------------------------------------------------------------------------
    @property
    def q_meta(self):
        return self.q_anchor, self.q_depth, self.q_doc

    @property
    def kv_meta(self):
        return self.kv_anchor, self.kv_depth, self.kv_doc

    def resolved_scale(self, head_dim: int) -> float:
        return float(self.scale) if self.scale is not None else 1.0 / float(np.sqrt(head_dim))

    def dense_mask(self):
        """[B, Tq, Tk] bool mask (small sizes only: tests, the reference, the dense bench)."""
        return visible(
            self.q_anchor[:, :, None],
            self.q_depth[:, :, None],
            self.q_doc[:, :, None],
            self.kv_anchor[:, None, :],
            self.kv_depth[:, None, :],
            self.kv_doc[:, None, :],
            self.sliding_window,
        )


jax.tree_util.register_dataclass(
    AttentionSpec,
    data_fields=["q_anchor", "q_depth", "q_doc", "kv_anchor", "kv_depth", "kv_doc"],
    meta_fields=["sliding_window", "softcap", "scale", "chain_depth"],
)
