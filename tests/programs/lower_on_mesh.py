"""`python tests/programs/lower_on_mesh.py FOLDER PLATFORM`: the tiny preset's train step on a
(2, 2, 2) mesh of 8 simulated CPU devices (XLA_FLAGS set by the caller), lowered for PLATFORM with
its kernels, and one speculative round (parallel mode) of the engine on that mesh; prints one JSON
line: the Pallas custom calls in each lowered text (`kernel_calls`, `round_kernel_calls`) and
their shard_map regions (`manual`, `round_manual`: each kernel runs per shard of the mesh)."""

import json
import sys

import numpy as np

import peagle_jax as pj
from peagle_jax.engine import SpeculativeDecoder
from peagle_jax.engine import speculative as sp
from peagle_jax.runtime.sharding import device_mesh
from train.data import Example
from train.flags import parse_args
from train.step import batch_arrays
from train.trainer import Trainer

KERNEL_CALL = {"cuda": "xla.gpu.triton", "tpu": "tpu_custom_call"}
MANUAL = "sdy.manual_computation"


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
    res = {"kernel_calls": text.count(KERNEL_CALL[platform]), "manual": text.count(MANUAL)}

    target = pj.load_target(folder, dtype="float32", mesh=device_mesh(2, 2, 2))
    dec = SpeculativeDecoder(target, pj.new_drafter(target, num_layers=1, k_train=4), k=3, mode="parallel")
    cfg, _, state = dec.start([[2, 5, 7, 9, 11], [3, 4], [6], [8, 9]], max_new_tokens=8)
    text = sp.lower_round(cfg, *dec.modules(), state, platform).as_text()
    res |= {"round_kernel_calls": text.count(KERNEL_CALL[platform]), "round_manual": text.count(MANUAL)}
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
