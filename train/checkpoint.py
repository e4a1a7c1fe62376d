"""Training checkpoints: orbax CheckpointManager under OUT/checkpoints, keep-N.

One checkpoint = the trainable params, the optimizer state (its leaves, restored into the
run's own optimizer structure), and a JSON record: step (= the data position: batches are a
pure function of (seed, step)), the seeds, the config, the draft vocabulary and the metrics
summary so far. Orbax writes into a temporary folder and renames it when complete, so a run
killed mid-save keeps its previous checkpoint.

Sharded: the arrays are saved as they lie on the mesh (each process writes its own shards; every
process calls `save`) and restored onto the shardings of the templates given to `restore`, so
a checkpoint written on one mesh shape (or number of hosts) resumes on another.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["Checkpoints"]


class Checkpoints:
    def __init__(self, folder: Path, keep: int):
        self.folder = Path(folder).absolute()
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.folder, options=opts, item_names=("state", "meta"))

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: dict, opt_state, meta: dict) -> None:
        leaves = jax.tree.leaves(opt_state)
        tree = {"params": params, "opt": {f"{i:04d}": x for i, x in enumerate(leaves)}}
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)), force=True
        )
        self.manager.wait_until_finished()

    def restore(self, step: int, params: dict, opt_state) -> tuple[dict, object, dict]:
        """(params, opt_state, meta) of `step`, shaped like the given templates."""
        leaves, treedef = jax.tree.flatten(opt_state)
        abstract = {
            "params": jax.tree.map(ocp.utils.to_shape_dtype_struct, params),
            "opt": {f"{i:04d}": ocp.utils.to_shape_dtype_struct(x) for i, x in enumerate(leaves)},
        }
        got = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        tree = got["state"]
        opt = jax.tree.unflatten(treedef, [tree["opt"][f"{i:04d}"] for i in range(len(leaves))])
        return tree["params"], opt, dict(got["meta"])

    def close(self) -> None:
        self.manager.close()


def host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)
