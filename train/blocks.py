"""DFlash training (`--model.mode dflash`, docs/training.md "DFlash"): anchored blocks, their
loss and their metrics, the way speculators 0.9.0 trains `DFlashDraftModel`.

Batches are in token space (COD's are in the shifted row space): tokens, positions, sup (the
loss mask: token t is an assistant token) and doc [B, L]; anchors [B, n] (sorted, padding 0) and
anchor_valid [B, n]. Each anchor a starts a block [tokens[a], MASK x (B - 1)] that sees the whole
sequence before a as context (`peagle_jax.models.dflash.block_rows_states`); row j*B + k is slot
k of anchor j, and slot k >= 1 drafts tokens[a + k].

Anchors (speculators' `select_anchors`): random supervised positions, none of the last
block_size positions of its document (so a block never runs past its document, even in packed
rows), up to max_anchors per sequence, sorted. Drawn from np.random.default_rng([seed, step,
row, example index]) like the COD rows, so a resumed run draws the same ones.

Loss (speculators' `compute_metrics` + `loss_function`): slot k >= 1 of anchor a is supervised
when sup[a + k]; its teacher is the target's distribution at a + k - 1; it weighs
exp(-(k - 1) / gamma) (slot 0: nothing), or with `loop.dflash_weights dpace` speculators' D-PACE
weight (`dpace_weights`). Per sequence sum(weight x KL) / (supervised rows + 1e-5), then the mean
over the sequences. Forward KL, CE on the target's top token, or a mix (`loop.ce_weight`,
`train.loss.loss_target`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.models.dflash import block_rows_states
from train import distributed as dist
from train.loss import EPS, fused_kl, loss_target, take_rows, teacher_logits, top_index
from train.segments import attention_for
from train.spec import LossSpec

__all__ = [
    "BlockBatch",
    "DEFAULT_ANCHORS",
    "anchor_candidates",
    "sample_anchors",
    "anchors_per_row",
    "make_block_batch",
    "block_arrays",
    "slot_weights",
    "dpace_weights",
    "block_loss_and_metrics",
    "block_stats",
    "accepted_lengths",
]

DEFAULT_ANCHORS = 512  # speculators' max_anchors: data.max_anchors unset


@dataclasses.dataclass
class BlockBatch:
    tokens: np.ndarray  # int32 [B, L] input ids (0 = padding)
    positions: np.ndarray  # int32 [B, L] (-1 = padding)
    sup: np.ndarray  # bool [B, L] token t is supervised (an assistant token)
    doc: np.ndarray  # int32 [B, L] (-1 = padding)
    anchor: np.ndarray  # int32 [B, n] sorted anchor positions (0 where invalid)
    anchor_valid: np.ndarray  # bool [B, n]
    n_tokens: int  # real tokens in the batch


def anchor_candidates(sup: np.ndarray, doc: np.ndarray, block_size: int) -> np.ndarray:
    """bool [L]: supervised positions a whose document goes on past a + block_size - 1 by one
    more token (speculators' rule, "not among the last block_size", per document)."""
    length = len(doc)
    ok = np.asarray(sup, bool) & (np.asarray(doc) >= 0)
    inside = np.zeros(length, bool)
    if length > block_size:
        inside[: length - block_size] = doc[block_size:] == doc[: length - block_size]
    return ok & inside


def sample_anchors(sup, doc, block_size: int, max_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted int32 anchors: up to max_anchors of `anchor_candidates`, drawn without replacement."""
    cand = np.flatnonzero(anchor_candidates(sup, doc, block_size))
    pick = rng.permutation(len(cand))[: min(max_anchors, len(cand))]
    return np.sort(cand[pick]).astype(np.int32)


def anchors_per_row(length: int, block_size: int, max_anchors: int | None) -> int:
    """Anchor slots of a batch of this length bucket (one static shape per bucket): at most one
    per position that can hold a block, at most max_anchors."""
    cap = DEFAULT_ANCHORS if max_anchors is None else max_anchors
    return max(1, min(cap, length - block_size))


def make_block_batch(
    examples,
    *,
    step: int,
    seed: int,
    length: int,
    block_size: int,
    max_anchors: int | None,
    first_row: int = 0,
) -> BlockBatch:
    """The DFlash batch of `examples` (one per row, padded to `length`) at `step`. A process
    building rows [first_row, ...) of a larger batch passes that offset (row seeds are global)."""
    b, n = len(examples), anchors_per_row(length, block_size, max_anchors)
    out = BlockBatch(
        np.zeros((b, length), np.int32),
        np.full((b, length), -1, np.int32),
        np.zeros((b, length), bool),
        np.full((b, length), -1, np.int32),
        np.zeros((b, n), np.int32),
        np.zeros((b, n), bool),
        sum(len(e.ids) for e in examples),
    )
    for i, e in enumerate(examples):
        m = len(e.ids)
        out.tokens[i, :m] = e.ids
        out.positions[i, :m] = np.arange(m)
        out.sup[i, :m] = e.mask
        out.doc[i, :m] = 0
        rng = np.random.default_rng([seed, step, first_row + i, e.index])
        a = sample_anchors(out.sup[i], out.doc[i], block_size, n, rng)
        out.anchor[i, : len(a)] = a
        out.anchor_valid[i, : len(a)] = True
    return out


def block_arrays(b: BlockBatch) -> dict[str, np.ndarray]:
    """The step's inputs of a `BlockBatch` (what `train.step.batch_arrays` is for COD rows)."""
    keys = ("tokens", "positions", "sup", "doc", "anchor", "anchor_valid")
    return {k: getattr(b, k) for k in keys}


def slot_weights(block_size: int, gamma: float) -> jax.Array:
    """[block_size] float32: slot 0 (the bonus token) 0, slot k >= 1 exp(-(k - 1) / gamma)."""
    k = jnp.arange(block_size, dtype=jnp.float32)
    return jnp.where(k >= 1, jnp.exp(-jnp.maximum(k - 1.0, 0.0) / gamma), 0.0)


def dpace_weights(ce: jax.Array, sup: jax.Array, block_size: int, alpha: float) -> jax.Array:
    """[B, n*bs] float32 D-PACE weights (speculators' `dpace_loss_decay`) from the per-row
    cross-entropy ce and the supervised rows sup [B, n*bs]: a supervised slot j weighs
    sum over supervised k >= j of prod_{i <= k} s_i, s_i = (1 - alpha) exp(-ce_i) + alpha the
    smoothed confidence (1 on unsupervised slots); 0 elsewhere. No gradient flows through it."""
    b = ce.shape[0]
    m = sup.reshape(b, -1, block_size).astype(jnp.float32)
    q = jnp.exp(-jax.lax.stop_gradient(ce).reshape(m.shape).astype(jnp.float32) * m)  # theirs: CE already masked
    smooth = jnp.where(m > 0, (1.0 - alpha) * q + alpha, 1.0)
    suffix = jnp.flip(jnp.cumsum(jnp.flip(jnp.cumprod(smooth, axis=-1) * m, -1), axis=-1), -1)
    return (suffix * m).reshape(b, -1)


def block_rows(anchor, valid, sup, block_size: int):
    """(drafted position a + k [B, n*bs], supervised bool [B, n*bs], slot [n*bs]) of the block rows."""
    length = sup.shape[1]
    slot = jnp.tile(jnp.arange(block_size, dtype=jnp.int32), anchor.shape[1])
    at = (anchor[..., None] + jnp.arange(block_size, dtype=anchor.dtype)).reshape(anchor.shape[0], -1)
    on = jnp.repeat(valid, block_size, axis=1) & (slot >= 1) & (at < length)
    return at, on & take_rows(sup, jnp.clip(at, 0, length - 1)), slot


def block_loss_and_metrics(parts, params, frozen, aux, y, head_w, batch, spec: LossSpec):
    """(loss, metrics) of one DFlash batch from target features aux [B, L, n*Ht] (the head's
    context layers) and final-norm states y [B, L, Ht]; `head_w` [Vd, Ht]: the target's lm_head
    rows of the draft vocabulary. Slot weights (spec.dflash_weights): exp (`slot_weights` of
    spec.dflash_gamma) or dpace (`dpace_weights` of spec.dpace_alpha). metrics: loss, correct /
    total per draft slot 1..B-1, and per row hit / sup [B, n*bs] (for `block_stats`)."""
    model = parts.merge(params, frozen)
    bs, anchor, valid = model.config.block_size, batch["anchor"], batch["anchor_valid"]
    mask = attention_for(spec.attention, anchor.shape[1] * bs)
    res = block_rows_states(model, batch["tokens"], aux, batch["positions"], batch["doc"], anchor, valid, mask=mask)
    length = aux.shape[1]
    at, sup, slot = block_rows(anchor, valid, batch["sup"], bs)
    teacher = teacher_logits(y, head_w, None, softcap=spec.softcap)  # [B, L, Vd]: the target at each position
    top_t = top_index(teacher)
    ref = jnp.clip(at - 1, 0, length - 1)  # slot k's teacher: the target at a + k - 1
    dist_ = loss_target(teacher, spec.ce_weight, top_t)
    supf = sup.astype(jnp.float32)
    count = jnp.sum(supf, axis=1, keepdims=True)  # per sequence, as speculators' loss_mask.sum(dim=1)
    hn, w = model.head_inputs(res.prenorm)
    top_ref = take_rows(top_t, ref)
    slot_w = slot_weights(bs, spec.dflash_gamma)[slot]
    if (
        spec.dflash_weights == "dpace"
    ):  # a forward-only pass first (one more [rows, Vd] product): weights from each row's CE
        _, ce, _ = fused_kl(jax.lax.stop_gradient(hn), jax.lax.stop_gradient(w), dist_, ref, supf, top_ref)
        slot_w = dpace_weights(ce, sup, bs, spec.dpace_alpha)
    weight = supf * slot_w / (count + EPS) / anchor.shape[0]
    loss, _, hit = fused_kl(hn, w, dist_, ref, weight, top_ref)
    onehot = jax.nn.one_hot(slot, bs, dtype=jnp.float32) * supf[..., None]
    correct = jnp.sum(onehot * hit[..., None].astype(jnp.float32), axis=(0, 1))[1:]
    total = jnp.sum(onehot, axis=(0, 1))[1:]
    return loss, {"loss": loss, "correct": correct, "total": total, "hit": hit, "sup": sup}


def accepted_lengths(hit: np.ndarray, sup: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block [..., drafts] of hits and supervised slots: (accepted length = 1 + the leading
    right supervised drafts, whether the block has a supervised slot): speculators' `eal` counts."""
    right = np.cumprod(hit & sup, axis=-1).sum(axis=-1)
    return 1.0 + right, sup.any(axis=-1)


def block_stats(m: dict, batch: BlockBatch, first_row: int | None = None) -> dict:
    """Host metrics of one DFlash step (the keys of `train.metrics.step_stats`): per-slot accuracy
    of the drafts 1..B-1 ("depths" 0..B-2), conditional accuracy (slots 1..d+1 all right, over
    the supervised slot d+1), and speculators' expected accepted length (eal_sum / eal_blocks)."""
    rows_split = first_row is not None
    hit, sup = (dist.local_rows(m[n]) if rows_split else np.asarray(m[n]) for n in ("hit", "sup"))
    b, n = batch.anchor.shape
    hit, sup = (x.reshape(b, n, -1)[..., 1:].astype(bool) for x in (hit, sup))
    chain = np.cumprod(hit, axis=-1).astype(bool)
    cond, ctot = (chain & sup).sum(axis=(0, 1)).astype(float), sup.sum(axis=(0, 1)).astype(float)
    lengths, blocks = accepted_lengths(hit, sup)
    eal = np.array([float((lengths * blocks).sum()), float(blocks.sum())])
    if rows_split:
        cond, ctot = dist.sum_over_processes(cond, first_row), dist.sum_over_processes(ctot, first_row)
        eal = dist.sum_over_processes(eal, first_row)
    correct, total = np.asarray(m["correct"]), np.asarray(m["total"])
    return {
        "loss": float(m["loss"]),
        "n": 1,
        "correct": correct,
        "total": total,
        "cond": cond,
        "ctot": ctot,
        "eal_sum": eal[0],
        "eal_blocks": eal[1],
    }
