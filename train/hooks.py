"""The hooks `train.loop.run` gives the `Trainer`: stop at a non-finite step (`StopOnNonFinite`),
the progress bar, checkpoints, the metrics log with the held-out evaluation, and the export of
the finished head (`Export`: OUT/head and OUT/vllm)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from train import distributed as dist
from train.checkpoint import Checkpoints
from train.metrics import MetricsLog
from train.target_checks import TrainError
from train.trainer import Hook, Trainer


class StopOnNonFinite(Hook):
    """A TrainError at the first step whose loss, gradient norm or updated parameters are not
    finite: the run stops before that state is checkpointed or exported (the last checkpoint
    stays the latest)."""

    def after_step(self, trainer, rec):
        bad = [k for k in ("loss", "grad_norm", "param_norm") if not np.isfinite(rec[k])]
        if bad:
            raise TrainError(
                f"step {trainer.step}: {bad[0]} is {rec[bad[0]]} (not finite): training stopped, nothing exported; "
                "lower optim.lr or check the data, then rerun (it resumes from the last checkpoint)"
            )


class Progress(Hook):
    """The tqdm bar (process 0, loop.progress)."""

    def __init__(self, trainer: Trainer, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(
            total=trainer.steps, initial=trainer.step, disable=not enabled, dynamic_ncols=True, desc="train"
        )

    def after_step(self, trainer, rec):
        acc = rec["acc"] + [0.0, 0.0]
        self.bar.set_postfix(
            loss=f"{rec['loss']:.3f}", a0=f"{acc[0]:.2f}", a1=f"{acc[1]:.2f}", a2=f"{acc[2]:.2f}",
            tok_s=f"{rec['tokens_per_second']:.0f}",
        )  # fmt: skip
        self.bar.update(1)

    def at_end(self, trainer, failed):
        self.bar.close()


class Checkpointing(Hook):
    """A checkpoint every loop.checkpoint_every steps and after the last one."""

    def __init__(self, ckpt: Checkpoints, every: int):
        self.ckpt, self.every = ckpt, every

    def after_step(self, trainer, rec):
        if trainer.step % self.every == 0 or trainer.step == trainer.steps:
            trainer.save(self.ckpt)

    def at_end(self, trainer, failed):
        if not failed and trainer.stop_requested and self.ckpt.latest() != trainer.step:
            trainer.save(self.ckpt)  # stopped early: the last step is a checkpoint too
        self.ckpt.close()


class Logging(Hook):
    """Every step's record, and the held-out evaluation every loop.eval_every steps and at the end,
    to OUT/metrics.jsonl (`MetricsLog`); `last_eval` holds the final evaluation."""

    def __init__(self, metrics: MetricsLog, heldout: list, every: int):
        self.metrics, self.heldout, self.every = metrics, heldout, every
        self.last_eval = None

    def evaluate(self, trainer) -> None:
        self.last_eval = trainer.evaluate(self.heldout)
        if self.last_eval is not None:
            self.metrics.log(self.last_eval)

    def after_step(self, trainer, rec):
        self.metrics.log(rec)
        if self.every and trainer.step % self.every == 0 and trainer.step < trainer.steps:
            self.evaluate(trainer)

    def at_end(self, trainer, failed):
        if not failed:
            self.evaluate(trainer)


class Export(Hook):
    """At the end of a finished run: the head gathered from every process (`head`), saved as
    OUT/head and exported for vLLM as OUT/vllm in `dtype` by process 0 (`head_dir`, `vllm_dir`,
    `report`)."""

    def __init__(self, out: Path, tpath: Path, dtype: str):
        self.out, self.tpath, self.dtype = out, tpath, dtype
        self.head = self.head_dir = self.vllm_dir = None
        self.report: dict = {}

    def at_end(self, trainer, failed):
        if failed:
            return
        self.head = trainer.head()  # every process takes part in the gather
        if dist.is_main():
            self.head_dir, self.vllm_dir, self.report = export_head(self.head, self.out, self.tpath, self.dtype)


def export_head(head, out: Path, tpath: Path, dtype: str):
    """(head_dir, vllm_dir, inspect report): OUT/head in our format, OUT/vllm for vLLM in `dtype`."""
    from peagle_jax.formats import export_drafter

    head_dir = head.save(out / "head")
    try:
        folder = tpath if Path(tpath).is_dir() else None  # a dummy preset has none
        vllm_dir, report = export_drafter(head_dir, out / "vllm", "vllm", dtype=dtype, target=folder, overwrite=True)
    except Exception as e:  # noqa: BLE001 - export refused (inspect found a problem)
        raise TrainError(f"export refused: {str(e).splitlines()[0]}") from None
    return head_dir, vllm_dir, report
