"""`python tests/programs/lower_on_mesh.py FOLDER PLATFORM`: the tiny preset's train step on a
(2, 2, 2) mesh of 8 simulated CPU devices (XLA_FLAGS set by the caller), lowered for PLATFORM with
its kernels; prints {"kernel_calls": N} as JSON (the Pallas custom calls in the lowered text)."""

import json
import sys

import numpy as np

import peagle_jax as pj
from peagle_jax.sharding import device_mesh
from train.config import parse_args
from train.data import Example
from train.step import batch_arrays
from train.trainer import Trainer

KERNEL_CALL = {"cuda": "xla.gpu.triton", "tpu": "tpu_custom_call"}


def main(folder: str, platform: str) -> None:
    target = pj.load_target(folder, dtype="float32")
    cfg = parse_args(["--preset", "tiny", "--model.attention", "kernels", "--data.batch_size", "4"])
    counts = np.ones(target.config.vocab_size, np.int64)
    trainer = Trainer(cfg, target, 10, token_counts=counts, mesh=device_mesh(2, 2, 2))
    rng = np.random.default_rng(0)
    examples = [Example(rng.integers(5, 200, 60).astype(np.int32), np.arange(60) > 10, i) for i in range(4)]
    batch = trainer.stepper.place_batch(batch_arrays(trainer.cod_batch(examples, 0)))
    t = trainer
    text = t.stepper.lower(t.params, t.opt_state, t.frozen, batch, platform).as_text()
    print(json.dumps({"kernel_calls": text.count(KERNEL_CALL[platform])}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
