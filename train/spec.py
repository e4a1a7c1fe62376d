"""One run's settings as the step and its batches read them: frozen specs, built once from a
`TrainConfig` and the target (`TrainSpec.of`) and passed down.

`LossSpec`: the objective of one batch (`train.step.loss_and_metrics`, `train.segments`,
`train.blocks.block_loss_and_metrics`); `StepSpec`: the jitted step (`train.step.TrainStep`): its
loss and how a sequence's COD rows split into segments; `BatchSpec`: how examples become a step's
rows (`train.cod.make_batch`, `train.blocks.make_block_batch`). Frozen and hashable: a spec is a
static part of the programs it shapes.
"""

from __future__ import annotations

import dataclasses

__all__ = ["LossSpec", "StepSpec", "BatchSpec", "TrainSpec"]


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """The objective: mode parallel (P-EAGLE COD rows), chain (EAGLE-3 training-time test of k
    steps) or dflash (anchored blocks); k depths or steps; attention auto | kernels | dense;
    per_depth: the KL averaged within each depth, then over depths; chain_decay: step j weighs
    chain_decay**j; ce_weight: the share of cross-entropy on the teacher's top token
    (`train.loss.loss_target`); softcap: the target's final logit softcapping (None: none);
    DFlash: slot k weighs exp(-(k - 1) / dflash_gamma), or D-PACE (dflash_weights dpace,
    smoothing dpace_alpha: `train.blocks.dpace_weights`)."""

    mode: str = "parallel"
    k: int = 1
    attention: str = "kernels"
    per_depth: bool = False
    chain_decay: float = 1.0
    ce_weight: float = 0.0
    softcap: float | None = None
    dflash_gamma: float = 4.0
    dflash_weights: str = "exp"
    dpace_alpha: float = 0.5

    @classmethod
    def of(cls, cfg, softcap: float | None) -> LossSpec:
        """The loss of a TrainConfig on a target whose logits are softcapped at `softcap`."""
        mc, lc = cfg.model, cfg.loop
        return cls(
            mode=mc.mode, k=mc.k_train, attention=mc.attention, softcap=softcap,
            per_depth=lc.per_depth_loss, chain_decay=lc.chain_decay, ce_weight=lc.ce_weight,
            dflash_gamma=lc.dflash_gamma, dflash_weights=lc.dflash_weights, dpace_alpha=lc.dpace_alpha,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The train step: its loss, and the segments each sequence's COD rows run as (`train.segments`:
    an int, or auto = ceil(rows / max_rows_per_segment))."""

    loss: LossSpec
    segments: int | str = 1
    max_rows_per_segment: int = 8192


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """How a step's examples become its rows: sequences padded to a length bucket (`train.cod.buckets`:
    length_buckets of max_len); COD rows (mode parallel: depth d keeps max(r**d, r_min) of the
    supervised positions, at most max_anchors per depth, row_factor x length rows padded to a multiple
    of row_granularity (0: always the most); mode chain: every anchor at each of k steps); or
    DFlash blocks of block_size from up to max_anchors anchors. Seeded per (seed, step, row)."""

    mode: str = "parallel"
    k: int = 8
    seed: int = 0
    max_len: int = 256
    length_buckets: int = 3
    r: float = 0.7
    r_min: float = 0.2
    max_anchors: int | None = None
    row_factor: float = 3.5
    row_granularity: int = 0
    block_size: int = 8

    @classmethod
    def of(cls, cfg) -> BatchSpec:
        """The batches of a TrainConfig (model.mode, k_train, block_size and the data section's sampling)."""
        mc, dc = cfg.model, cfg.data
        return cls(
            mode=mc.mode, k=mc.k_train, block_size=mc.block_size, seed=dc.seed, max_len=dc.max_len,
            length_buckets=dc.length_buckets, r=dc.cod_r, r_min=dc.cod_r_min, max_anchors=dc.max_anchors,
            row_factor=dc.row_factor, row_granularity=dc.row_granularity,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """A run's step and batches, built once (`of`) from its TrainConfig and the target's config."""

    step: StepSpec
    batch: BatchSpec

    @classmethod
    def of(cls, cfg, target_config) -> TrainSpec:
        loss = LossSpec.of(cfg, target_config.final_logit_softcapping)
        step = StepSpec(loss, cfg.loop.segments, cfg.loop.max_rows_per_segment)
        return cls(step, BatchSpec.of(cfg))
