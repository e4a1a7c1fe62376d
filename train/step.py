"""The jitted train step: pure functions of (trainable params, frozen params, target state, batch).

Parameters are flat dicts {"a.b.c": array} (plain pytrees for optax and orbax); `Parts.merge`
rebuilds the NNX drafter inside the trace (the functional form: no `nnx.jit`). Frozen: d2t,
plus embed_tokens / lm_head when the config freezes them.

Teacher (online): the frozen target runs inside the step over the token rows and gives the
aux states (drafter inputs) and the final-norm states y; the teacher logits are y times the
target's lm_head rows of the draft vocabulary only (gathered once on the host, [Vd, H]), one
[L, Vd] product per sequence, then gathered per COD row by its reference position.

Objectives: "parallel" = P-EAGLE COD rows through `cod_rows_forward(mask="kernels")` with the
forward KL of `train.loss.draft_loss` (one global normalisation, or per depth); "chain" =
EAGLE-3 training-time test: step j feeds the head's own pre-norm states of step j-1 back as
the hidden input of rows (anchor, j) (same P-EAGLE attention rule over the rows of steps
<= j), loss = sum_j decay**j * KL_j / count_j (speculators' per-step weights).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import kernels
from peagle_jax.models.drafter import cod_rows_forward, flat_state
from peagle_jax.target import target_apply
from train.loss import draft_loss, teacher_logits

__all__ = ["Parts", "split_params", "make_optimizer", "features", "loss_and_metrics", "TrainStep"]


def key(path) -> str:
    return ".".join(map(str, path))


@dataclasses.dataclass(frozen=True)
class Parts:
    """Static description of the drafter: graphdef + variable templates (hashable by id)."""

    graphdef: Any
    template: tuple  # ((path, Variable), ...)

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other

    def merge(self, params: dict, frozen: dict):
        flat = {**params, **frozen}
        state = nnx.from_flat_state([(p, var.replace(flat[key(p)])) for p, var in self.template])
        return nnx.merge(self.graphdef, state)


def path_of(k: str) -> tuple:
    """ "layers.0.mlp" -> ("layers", 0, "mlp") (the drafter's state paths)."""
    return tuple(int(p) if p.isdigit() else p for p in k.split("."))


def split_params(drafter, freeze_embed: bool, freeze_lm_head: bool) -> tuple[Parts, dict, dict]:
    """(Parts, trainable {key: array}, frozen {key: array}) of a Drafter handle."""
    flat = flat_state(drafter.state)
    frozen_keys = {"d2t"}
    if freeze_embed:
        frozen_keys.add("embed_tokens.embedding")
    if freeze_lm_head:
        frozen_keys.add("lm_head.kernel")
    params, frozen = {}, {}
    for p, var in flat.items():
        (frozen if key(p) in frozen_keys else params)[key(p)] = jnp.asarray(var[...])
    return Parts(drafter.graphdef, tuple(flat.items())), params, frozen


def make_optimizer(
    lr: float,
    warmup: int,
    total: int,
    min_ratio: float,
    b1: float,
    b2: float,
    wd: float,
    clip: float,
    norm_lr_scale: float = 1.0,
) -> optax.GradientTransformation:
    """AdamW with linear warmup + cosine decay after global-norm clipping; the final norm's
    updates are multiplied by `norm_lr_scale` (it sets the logit scale, see docs/training.md)."""
    warmup = max(0, min(warmup, total - 1))
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total, warmup + 1), lr * min_ratio)
    parts = [optax.clip_by_global_norm(clip), optax.adamw(sched, b1=b1, b2=b2, weight_decay=wd)]
    if norm_lr_scale != 1.0:
        parts.append(optax.masked(optax.scale(norm_lr_scale), lambda p: {k: k == "norm.weight" for k in p}))
    return optax.chain(*parts)


def features(target_def, target_state, tokens, positions, aux_layer_ids):
    """Target aux states [B, L, 3H] and final-norm states [B, L, H] (no logits computed)."""
    out = target_apply(
        target_def, target_state, tokens, positions, None, aux_layer_ids=aux_layer_ids, compute_logits=False
    )
    return jax.lax.stop_gradient(out.aux_hidden), jax.lax.stop_gradient(out.hidden)


def _take(x, idx):
    """x [B, L, ...] gathered at idx [B, N] along axis 1."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def _teacher_logp(y, head_w, softcap):
    """log-softmax teacher [B, L, Vd] of row t = target distribution at t + 1."""
    y_next = jnp.concatenate([y[:, 1:], jnp.zeros_like(y[:, :1])], axis=1)
    zeros = jnp.zeros((head_w.shape[0],), jnp.int32)
    return jax.nn.log_softmax(teacher_logits(y_next, head_w, zeros, softcap=softcap), axis=-1)


def _row_tokens(tokens):
    """Row t holds token x[t + 1] (0 past the end)."""
    return jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)


def loss_and_metrics(
    parts: Parts,
    params,
    frozen,
    aux,
    y,
    head_w,
    batch,
    *,
    mode: str,
    k: int,
    per_depth: bool,
    chain_decay: float,
    softcap,
    attention: str = "kernels",
):
    """(loss, metrics) of one batch from target features aux [B, L, 3H], y [B, L, H]."""
    model = parts.merge(params, frozen)
    anchor, depth, doc = batch["anchor"], batch["depth"], batch["doc"]
    if attention == "auto":  # a [rows, rows] mask is cheap below a few thousand rows and compiles faster
        attention = "dense" if anchor.shape[1] <= 4096 else "kernels"
    ref = jnp.clip(anchor + depth, 0, aux.shape[1] - 1)
    row_tok = _row_tokens(batch["tokens"])
    logp_t = _teacher_logp(y, head_w, softcap)
    sup = _take(batch["sup"], ref) & (doc >= 0)
    if mode == "parallel":
        logits = cod_rows_forward(model, _take(row_tok, ref), _take(aux, ref), anchor, depth, doc, mask=attention)
        teacher = _take(logp_t, ref)
        out = draft_loss(logits, teacher, sup, depth, num_depths=k, per_depth=per_depth)
        loss = out.loss
        hit = jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)
        correct, total = out.correct, out.total
    else:
        length = aux.shape[1]
        g = model.fuse(aux.astype(jnp.float32))
        hidden = [g]
        loss = jnp.zeros((), jnp.float32)
        hits, corrects, totals = [], [], []
        for j in range(k):
            n = (j + 1) * length
            a, d, c = anchor[:, :n], depth[:, :n], doc[:, :n]
            r = jnp.clip(a + d, 0, length - 1)
            pos = jnp.where(c >= 0, a + d, -1)
            spec = kernels.AttentionSpec.peagle(a, d, c)
            res = model(
                _take(row_tok, r),
                jnp.concatenate(hidden, axis=1),
                pos,
                None,
                spec,
                "auto" if attention == "kernels" else "dense",
            )
            pre = res.prenorm[:, j * length :]
            logits = model.head(pre)
            teacher = logp_t[:, j:]
            teacher = jnp.concatenate([teacher, jnp.zeros_like(logp_t[:, :j])], axis=1)
            s = sup[:, j * length : (j + 1) * length]
            o = draft_loss(logits, teacher, s, None, num_depths=1)
            loss = loss + (chain_decay**j) * o.loss
            hidden.append(model.feedback(pre))
            hits.append(jnp.argmax(logits, -1) == jnp.argmax(teacher, -1))
            corrects.append(o.correct[0])
            totals.append(o.total[0])
        hit = jnp.concatenate(hits, axis=1)
        correct, total = jnp.stack(corrects), jnp.stack(totals)
    metrics = {"loss": loss, "correct": correct, "total": total, "hit": hit, "sup": sup}
    return loss, metrics


class TrainStep:
    """Jitted train / eval steps for one run (online teacher, or cached features)."""

    def __init__(
        self,
        parts: Parts,
        optimizer,
        target,
        head_w,
        *,
        mode: str,
        k: int,
        per_depth: bool,
        chain_decay: float,
        attention: str = "kernels",
    ):
        self.parts, self.optimizer = parts, optimizer
        self.target_def, self.target_state = target.graphdef, target.state
        self.aux_ids = tuple(target.aux_layer_ids)
        self.head_w = head_w
        softcap = target.config.final_logit_softcapping
        kw = dict(mode=mode, k=k, per_depth=per_depth, chain_decay=chain_decay, softcap=softcap, attention=attention)
        lossf = functools.partial(loss_and_metrics, parts, **kw)
        aux_ids = self.aux_ids
        opt = optimizer

        def from_features(params, opt_state, frozen, head_w, aux, y, batch):
            (loss, m), grads = jax.value_and_grad(lossf, has_aux=True)(params, frozen, aux, y, head_w, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            m["grad_norm"] = optax.global_norm(grads)
            return params, opt_state, m

        def online(params, opt_state, frozen, head_w, tstate, batch):
            aux, y = features(target.graphdef, tstate, batch["tokens"], batch["positions"], aux_ids)
            return from_features(params, opt_state, frozen, head_w, aux, y, batch)

        def evaluate(params, frozen, head_w, tstate, batch):
            aux, y = features(target.graphdef, tstate, batch["tokens"], batch["positions"], aux_ids)
            return lossf(params, frozen, aux, y, head_w, batch)[1]

        def feats(tstate, tokens, positions):
            return features(target.graphdef, tstate, tokens, positions, aux_ids)

        self._online = jax.jit(online, donate_argnums=(0, 1))
        self._cached = jax.jit(from_features, donate_argnums=(0, 1))
        self._eval = jax.jit(evaluate)
        self._feats = jax.jit(feats)

    def __call__(self, params, opt_state, frozen, batch: dict, feats=None):
        if feats is None:
            return self._online(params, opt_state, frozen, self.head_w, self.target_state, batch)
        return self._cached(params, opt_state, frozen, self.head_w, feats[0], feats[1], batch)

    def evaluate(self, params, frozen, batch: dict):
        return self._eval(params, frozen, self.head_w, self.target_state, batch)

    def features(self, tokens, positions):
        return self._feats(self.target_state, tokens, positions)


def batch_arrays(b) -> dict[str, np.ndarray]:
    return {
        "tokens": b.tokens,
        "positions": b.positions,
        "sup": b.sup,
        "anchor": b.anchor,
        "depth": b.depth,
        "doc": b.doc,
    }


def conditional_hits(
    hit: np.ndarray, sup: np.ndarray, anchor: np.ndarray, depth: np.ndarray, doc: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per depth: supervised rows whose whole chain (same anchor, depths 0..d) is right, and
    the supervised rows (host numpy; rows sorted by (depth, anchor) within a sequence)."""
    cond = np.zeros(k)
    tot = np.zeros(k)
    for b in range(hit.shape[0]):
        ok: dict[int, bool] = {}
        for h, s, a, d, c in zip(hit[b], sup[b], anchor[b], depth[b], doc[b]):
            if c < 0:
                continue
            chain = bool(h) and (d == 0 or ok.get(int(a), False))
            ok[int(a)] = chain  # rows come depth by depth: this is what depth d + 1 reads
            if s:
                tot[d] += 1
                cond[d] += chain
    return cond, tot
