"""The optimizer of a run, built from its `OptimConfig`.

After global-norm clipping: AdamW, or Muon (`optax.contrib.muon`: the 2-D weight matrices get
orthogonalized momentum updates scaled to AdamW's update RMS, everything else AdamW, the split
speculators' Muon recipe uses), the learning rate on a linear warmup then a cosine or linear
decay. The schedule's value sits in the optimizer state (`optax.inject_hyperparams`), so the
learning rate a step used is read back from the state (`learning_rate`) instead of being
computed a second time.
"""

from __future__ import annotations

import optax

from train.config import OptimConfig

__all__ = ["make_optimizer", "schedule", "learning_rate"]

NORM_KEY = "norm.weight"  # the head's final norm: its own learning-rate multiplier


MUON_RMS = 0.2  # Muon's updates scaled to AdamW's typical update RMS (speculators' match_rms_adamw)
NOT_MUON = ("embed_tokens", "lm_head")  # 2-D but vocabulary-indexed: AdamW, as in Muon's recipe


def schedule(oc: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `oc.lr`, then cosine (or linear, `oc.schedule`) decay to
    `oc.lr * oc.min_lr_ratio` at `total_steps` (the warmup is cut to leave one decay step)."""
    warmup = max(0, min(oc.warmup_steps, total_steps - 1))
    end, total = oc.lr * oc.min_lr_ratio, max(total_steps, warmup + 1)
    if oc.schedule == "linear":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, oc.lr, warmup), optax.linear_schedule(oc.lr, end, total - warmup)], [warmup]
        )
    return optax.warmup_cosine_decay_schedule(0.0, oc.lr, warmup, total, end)


def muon_dimensions(params: dict) -> dict:
    """Per parameter: Muon's (input, output) axes for a 2-D weight matrix, None (AdamW) for the
    rest (norms, biases, the [1, N] mask state, the vocabulary-indexed tables; optax also calls it
    on trees whose other leaves are masked out)."""

    def dims(key, x):
        if getattr(x, "ndim", 0) == 2 and min(x.shape) > 1 and not any(n in key for n in NOT_MUON):
            return optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)
        return None

    return {k: dims(k, v) for k, v in params.items()}


def make_optimizer(oc: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """clip_by_global_norm(oc.clip) -> AdamW(schedule, b1, b2, weight_decay), or Muon (momentum
    oc.muon_momentum, weight decay oc.muon_weight_decay on its matrices; AdamW as above on the
    rest); the final norm's updates are scaled by `oc.norm_lr_scale` (it sets how sharp the
    logits can get)."""
    lr = schedule(oc, total_steps)
    if oc.optimizer == "muon":
        opt = optax.inject_hyperparams(optax.contrib.muon, static_args=("muon_weight_dimension_numbers",))(
            learning_rate=lr,
            beta=oc.muon_momentum,
            weight_decay=oc.muon_weight_decay,
            adam_b1=oc.b1,
            adam_b2=oc.b2,
            adam_weight_decay=oc.weight_decay,
            consistent_rms=MUON_RMS,
            muon_weight_dimension_numbers=muon_dimensions,
        )
    else:
        opt = optax.inject_hyperparams(optax.adamw)(learning_rate=lr, b1=oc.b1, b2=oc.b2, weight_decay=oc.weight_decay)
    parts = [optax.clip_by_global_norm(oc.clip), opt]
    if oc.norm_lr_scale != 1.0:
        parts.append(optax.masked(optax.scale(oc.norm_lr_scale), lambda p: {k: k == NORM_KEY for k in p}))
    return optax.chain(*parts)


def learning_rate(opt_state) -> float:
    """The learning rate of the last update made with this state (0 before the first)."""
    return float(opt_state[1].hyperparams["learning_rate"])
