"""`python tests/programs/target_rows_on_mesh.py FOLDER`: the tiny preset's train step over 8
sequences on 8 simulated CPU devices (fsdp: weights and rows over the same devices, as `python -m
train` places them; XLA_FLAGS set by the caller), compiled; prints one JSON line: how many of the
program's arrays have the target MLP's intermediate width over every sequence's tokens
(`global_rows`) and over one device's (`device_rows`); for an MoE target, also how many have the
hidden width over the (token, expert) pairs of every sequence (`moe_global_pairs`) and of one
device's (`moe_device_pairs`), and how far the step's target states move when each device routes
its own rows from one global sort (`moe_rows_sharded_max_diff`)."""

import json
import re
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import peagle_jax as pj
from peagle_jax.models.rows import rows_sharded
from peagle_jax.runtime.sharding import device_mesh
from train.data import Example
from train.flags import parse_args
from train.step import batch_arrays, features
from train.trainer import Trainer

TOKENS, SEQUENCES = 256, 8


def target_states(target, ids, rows) -> np.ndarray:
    """The train step's final-norm target states of ids, traced inside `rows_sharded(rows)`."""
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    with rows_sharded(rows):  # a fresh jit: the context is read while tracing
        _, y = jax.jit(features, static_argnums=(0, 4))(target.graphdef, target.state, ids, positions, (0, 1, 2))
    return np.asarray(y)


def main(folder: str) -> None:
    target = pj.load_target(folder, dtype="float32")
    cfg = parse_args(["--preset", "tiny", "--data.batch_size", str(SEQUENCES), "--data.max_len", str(TOKENS)])
    counts = np.ones(target.config.vocab_size, np.int64)
    mesh = device_mesh(1, SEQUENCES, 1)
    t = Trainer(cfg, target, 10, token_counts=counts, mesh=mesh)
    rng = np.random.default_rng(0)
    mask = np.arange(TOKENS) > 10
    examples = [Example(rng.integers(5, 200, TOKENS).astype(np.int32), mask, i) for i in range(SEQUENCES)]
    batch = t.stepper.place_batch(batch_arrays(t.cod_batch(examples, 0)))
    text = t.stepper.lower(t.params, t.opt_state, t.frozen, batch, "cpu").compile().as_text()
    c = target.config
    count = lambda rows, width: len(re.findall(rf"\[(?:1,)?{rows},{width}\]", text))  # noqa: E731
    got = {
        "global_rows": count(SEQUENCES * TOKENS, c.intermediate_size),
        "device_rows": count(TOKENS, c.intermediate_size),
    }
    if c.num_experts:
        pairs = TOKENS * c.num_experts_per_tok
        got |= {
            "moe_global_pairs": count(SEQUENCES * pairs, c.hidden_size),
            "moe_device_pairs": count(pairs, c.hidden_size),
        }
        ids = np.stack([e.ids for e in examples]) % c.vocab_size  # the tiny MoE has 96 ids
        placed = pj.load_target(folder, dtype="float32", mesh=mesh)
        rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
        diff = target_states(placed, ids, rows) - target_states(placed, ids, None)
        got["moe_rows_sharded_max_diff"] = float(np.abs(diff).max())
    print(json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1])
