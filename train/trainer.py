"""`Trainer`: one run's drafter head, optimizer, jitted step and checkpoints, built from a
`TrainConfig` and a loaded target.

It owns the parameter split (`train.step.trainable`: every `nnx.Param` but the frozen embedding /
lm_head), the optimizer of `cfg.optim` (`train.optim`), the placement on a mesh, the step, the
held-out evaluation and checkpoint save / restore. `fit` runs the steps left and calls the
`Hook`s after each one and at the end; logging, periodic evaluation, checkpoints and anything a
caller adds (a test's kill switch) are hooks.

Determinism: the batches are a pure function of (data seed, step) (`train.data.batch_examples`,
COD rows or DFlash anchors seeded per step and row), so a run restored at step s continues with
exactly the batches the uninterrupted run would have seen.

Mode "dflash": batches of anchored blocks (`train.blocks`), the head's own context layers as
the target features, embed_tokens and lm_head always frozen, k = block_size - 1 drafts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import jax
import numpy as np

from peagle_jax.models.eagle import draft_vocab_ids, param_path
from train import cod
from train import config as C
from train import data as D
from train import distributed as dist
from train.blocks import block_arrays, block_stats, make_block_batch
from train.checkpoint import Checkpoints
from train.init_head import adopt_head, load_head
from train.metrics import add_stats, stats_record, step_stats
from train.optim import learning_rate, make_optimizer
from train.spec import TrainSpec
from train.step import TrainStep, batch_arrays, compute_parts, split_params
from train.target_checks import TrainError, check_target

__all__ = ["Trainer", "Hook", "TimeBudget", "TrainError", "total_steps", "head_flags"]

HELDOUT_STEP = 10**9  # the COD seed offset of held-out batches: the same rows at every evaluation


def head_flags(mc: C.ModelConfig) -> dict:
    """`new_drafter`'s layer flags of model: the sliding layers, then P-EAGLE / EAGLE-3 input norms,
    or a DFlash block (Qwen3 layers, none of those norms: `new_drafter` sets them)."""
    window = {"sliding_window": mc.sliding_window, "layer_types": layer_types(mc)}
    if mc.mode == "dflash":
        return {**window, "block_size": mc.block_size, "sliding_window_non_causal": mc.sliding_window_non_causal}
    return {
        **window,
        "fc_norm": mc.fc_norm,
        "norm_before_fc": mc.norm_before_fc,
        "qk_norm": mc.qk_norm,
        "norm_before_residual": mc.norm_before_residual,
        "init_layer": mc.init_layer,
    }


def layer_types(mc: C.ModelConfig) -> tuple[str, ...] | None:
    """The head's per-layer attention (HF `layer_types`): with a window, every layer slides but
    model.full_attention_layers; None without one (all full)."""
    if mc.sliding_window is None:
        return None
    full = set(mc.full_attention_layers)
    return tuple("full_attention" if i in full else "sliding_attention" for i in range(mc.num_layers))


def fresh_head(mc: C.ModelConfig, target, token_counts=None):
    """A new head of model's settings for `target` (`new_drafter`); its draft vocabulary the top
    model.draft_vocab ids of `token_counts` [V] (the training data's supervised tokens)."""
    import peagle_jax as pj

    v = target.config.vocab_size
    vd = C.draft_vocab_size(mc.draft_vocab, v)
    vd = vd if vd < v else None  # None: the whole vocabulary
    return pj.new_drafter(
        target,
        num_layers=mc.num_layers,
        mode=mc.mode,
        draft_vocab=vd,
        seed=mc.seed,
        mask_token_id=mc.mask_token_id,
        k_train=mc.k_train,
        token_counts=token_counts if vd else None,
        dtype=mc.dtype,
        **head_flags(mc),
    )


class Hook:
    """Called by `Trainer.fit`: `after_step` with the step's record (step = steps done), `at_end`
    once the last step is done (or the loop was left by an exception, `failed` True)."""

    def after_step(self, trainer: Trainer, rec: dict) -> None:
        pass

    def at_end(self, trainer: Trainer, failed: bool) -> None:
        pass


class TimeBudget(Hook):
    """Stops `fit` once `seconds` of training have passed (0: never); the run then ends as usual."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def after_step(self, trainer, rec):
        if self.seconds and time.perf_counter() - self.start >= self.seconds:
            trainer.request_stop()


def total_steps(cfg: C.TrainConfig, n_train: int) -> int:
    """loop.steps, or loop.epochs passes over a training split of n_train sequences."""
    return cfg.loop.steps or max(1, math.ceil(cfg.loop.epochs * n_train / cfg.data.batch_size))


class Trainer:
    """A head for `target` trained by `cfg` over `steps` optimizer steps: a fresh one
    (`fresh_head`), or model.init_head's (`train.init_head`: its settings adopted into cfg).

    token_counts [V]: supervised token counts of the training data (a fresh head's draft
    vocabulary is their top model.draft_vocab ids). mesh: a (data, fsdp, tensor) Mesh; the state
    is placed on it and batches are this process's rows (`rows`). `spec`: the run's step and
    batches (`train.spec.TrainSpec`), built once here from cfg and the target."""

    def __init__(self, cfg: C.TrainConfig, target, steps: int, *, token_counts=None, mesh=None):
        cfg = adopt_head(cfg)  # model.init_head's settings (the command line has them already)
        mc = cfg.model
        check_target(cfg, target, getattr(target, "path", "the target"))
        self.cfg, self.steps, self.step = cfg, steps, 0
        self.spec = TrainSpec.of(cfg, target.config)
        self.stop_requested = False  # a hook sets it (`request_stop`): fit ends after this step
        self.dflash = mc.mode == "dflash"
        self.k = mc.block_size - 1 if self.dflash else mc.k_train  # drafts a round
        self.eval_k = min(7, self.k)
        self.drafter = load_head(mc, target) if mc.init_head else fresh_head(mc, target, token_counts)
        # the teacher: the target's lm_head rows of the draft vocabulary, gathered once
        head_w = jax.numpy.asarray(target.embedding_arrays()[1][draft_vocab_ids(self.drafter.d2t)], self.drafter.dtype)
        # DFlash trains neither embed_tokens nor lm_head (speculators: the verifier's)
        freeze_embed, freeze_head = mc.freeze_embed or self.dflash, mc.freeze_lm_head or self.dflash
        parts, params, frozen = split_params(self.drafter, freeze_embed, freeze_head)
        parts = compute_parts(parts, self.drafter.config, mc.compute_dtype, mc.dtype)
        if mc.norm_from_target:
            tnorm = np.asarray(target.state["norm"]["weight"][...], np.float32) + target.config.norm_offset
            params["norm.weight"] = jax.numpy.asarray(tnorm, params["norm.weight"].dtype)
        self.optimizer = make_optimizer(cfg.optim, steps)
        opt_state = self.optimizer.init(params)
        self.stepper = TrainStep(
            parts,
            self.optimizer,
            target,
            head_w,
            self.spec.step,
            aux_layer_ids=self.drafter.config.aux_layer_ids,
            mesh=mesh,
            state=(params, opt_state, frozen),
        )
        self.params, self.opt_state, self.frozen = self.stepper.place_state(params, opt_state, frozen)

    # --- batches and steps
    def rows(self) -> tuple[int, int]:
        """[lo, hi): this process's rows of every global batch (all of them in one process)."""
        return self.stepper.rows(self.cfg.data.batch_size)

    def cod_batch(self, examples: list, step: int, first_row: int = 0, length: int | None = None) -> cod.Batch:
        """The COD rows of `examples` at `step` (the spec's sampling: r, r_min, rows, buckets)."""
        return cod.make_batch(examples, self.spec.batch, step, first_row, length)

    def batch(self, examples: list, step: int, first_row: int = 0, length: int | None = None):
        """This run's batch of `examples` at `step`: COD rows (`cod_batch`), or DFlash blocks
        (`train.blocks.make_block_batch`: anchors seeded per (data seed, step, row) alike)."""
        if not self.dflash:
            return self.cod_batch(examples, step, first_row, length)
        bs = self.spec.batch
        if length is None:
            length = cod.bucket_for(max(len(e.ids) for e in examples), bs.max_len, bs.length_buckets)
        return make_block_batch(
            examples,
            step=step,
            seed=bs.seed,
            length=length,
            block_size=bs.block_size,
            max_anchors=bs.max_anchors,
            first_row=first_row,
        )

    def batch_inputs(self, batch) -> dict:
        """The step's input arrays of `batch`."""
        return block_arrays(batch) if self.dflash else batch_arrays(batch)

    def batch_stats(self, m: dict, batch, first_row: int | None = None) -> dict:
        """Host stats (`train.metrics.step_stats` keys) of the step's outputs `m` on `batch`."""
        if self.dflash:
            return block_stats(m, batch, first_row=first_row)
        return step_stats(m, batch, self.k, self.eval_k, first_row=first_row)

    def update(self, arrays: dict, feats=None) -> dict:
        """One optimizer step on batch arrays (`train.step.batch_arrays`): the step's device metrics."""
        self.params, self.opt_state, m = self.stepper(self.params, self.opt_state, self.frozen, arrays, feats)
        self.step += 1
        return m

    def train_step(self, batch, feats=None, first_row: int = 0) -> dict:
        """One optimizer step on this process's rows `batch` (target features `feats`, or the
        target run inside the step): its record (loss, accuracies, grad_norm, learning rate)."""
        m = self.update(self.batch_inputs(batch), feats)
        rec = stats_record(self.batch_stats(m, batch, first_row), self.eval_k)
        norms = {"grad_norm": float(m["grad_norm"]), "param_norm": float(m["param_norm"])}
        return {"step": self.step, **rec, **norms, "lr": self.learning_rate}

    def evaluate(self, examples: list) -> dict | None:
        """{eval_loss, eval_acc, eval_cond_acc, eval_sim_tau} (DFlash: and eval_eal) over `examples`
        (fixed COD rows or anchors)."""
        if not examples:
            return None
        bs, sums = self.cfg.data.batch_size, None
        for i in range(0, len(examples), bs):
            b = self.batch(examples[i : i + bs], step=HELDOUT_STEP + i)
            m = self.stepper.evaluate(self.params, self.frozen, self.batch_inputs(b))
            sums = add_stats(sums, self.batch_stats(m, b))
        return {"step": self.step, **{f"eval_{k}": v for k, v in stats_record(sums, self.eval_k).items()}}

    def fit(self, train: list, hooks: Sequence[Hook] = (), features=None) -> None:
        """The steps from `self.step` to `self.steps` over the training split `train`; `features`:
        a `train.features.FeatureCache` (one process) instead of running the target each step."""
        dc = self.cfg.data
        lo, hi = self.rows()
        tokens, t0 = 0, time.perf_counter()
        failed = True
        try:
            for step in range(self.step, self.steps):
                if self.stop_requested:
                    break
                exs = D.batch_examples(train, step, dc.batch_size, dc.seed)  # the global batch
                length = cod.bucket_for(max(len(e.ids) for e in exs), dc.max_len, dc.length_buckets)
                b = self.batch(exs[lo:hi], step, first_row=lo, length=length)
                if (
                    dist.multi_process() and not self.dflash
                ):  # DFlash: one anchor count per length  # one row bucket for all: the largest (only the row count travels)
                    b = cod.pad_rows(b, dist.max_over_processes(b.anchor.shape[1]))
                f = features.get(exs, b) if features is not None else None
                rec = self.train_step(b, f, first_row=lo)
                n = sum(len(e.ids) for e in exs)
                tokens += n
                rec.update(tokens=n, tokens_per_second=tokens / (time.perf_counter() - t0))
                for h in hooks:
                    h.after_step(self, rec)
            failed = False
        finally:
            for h in hooks:
                h.at_end(self, failed)

    def request_stop(self) -> None:
        """End `fit` after the current step (a time budget, say): the run then ends as if its
        last step were this one (checkpointed, evaluated and exported as usual)."""
        self.stop_requested = True

    # --- state
    @property
    def learning_rate(self) -> float:
        """The learning rate of the last step (read from the optimizer state)."""
        return learning_rate(self.opt_state)

    def save(self, ckpt: Checkpoints) -> None:
        """A checkpoint of this step (every process calls it: each writes its own shards)."""
        meta = {"step": self.step, "seed": self.cfg.data.seed, "config": C.to_dict(self.cfg)}
        ckpt.save(self.step, self.params, self.opt_state, meta)

    def restore(self, ckpt: Checkpoints) -> int | None:
        """The latest checkpoint restored onto this run's mesh (whatever mesh wrote it): its step."""
        latest = ckpt.latest()
        if latest is None:
            return None
        self.params, self.opt_state, meta = ckpt.restore(latest, self.params, self.opt_state)
        self.step = int(meta["step"])
        return self.step

    def head(self):
        """The trained head as a host `Drafter` (gathered from every process: all must call it)."""
        from peagle_jax.handles.drafter import Drafter

        arrays = {**dist.to_host(self.params), **dist.to_host(self.frozen)}
        arrays = {param_path(k): v for k, v in arrays.items()}
        return Drafter.from_arrays(self.drafter.config, arrays, self.cfg.model.dtype)
