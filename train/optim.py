"""The optimizer of a run, built from its `OptimConfig`.

AdamW after global-norm clipping, the learning rate on a linear warmup + cosine decay. The
schedule's value sits in the optimizer state (`optax.inject_hyperparams`), so the learning rate a
step used is read back from the state (`learning_rate`) instead of being computed a second time.
"""

from __future__ import annotations

import optax

from train.config import OptimConfig

__all__ = ["make_optimizer", "schedule", "learning_rate"]

NORM_KEY = "norm.weight"  # the head's final norm: its own learning-rate multiplier


def schedule(oc: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `oc.lr`, then cosine decay to `oc.lr * oc.min_lr_ratio` at
    `total_steps` (the warmup is cut to leave at least one decay step)."""
    warmup = max(0, min(oc.warmup_steps, total_steps - 1))
    return optax.warmup_cosine_decay_schedule(0.0, oc.lr, warmup, max(total_steps, warmup + 1), oc.lr * oc.min_lr_ratio)


def make_optimizer(oc: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """clip_by_global_norm(oc.clip) -> AdamW(schedule, b1, b2, weight_decay); the final norm's
    updates are scaled by `oc.norm_lr_scale` (it sets how sharp the logits can get)."""
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule(oc, total_steps), b1=oc.b1, b2=oc.b2, weight_decay=oc.weight_decay
    )
    parts = [optax.clip_by_global_norm(oc.clip), adamw]
    if oc.norm_lr_scale != 1.0:
        parts.append(optax.masked(optax.scale(oc.norm_lr_scale), lambda p: {k: k == NORM_KEY for k in p}))
    return optax.chain(*parts)


def learning_rate(opt_state) -> float:
    """The learning rate of the last update made with this state (0 before the first)."""
    return float(opt_state[1].hyperparams["learning_rate"])
