"""The EAGLE-3 (chain) objective's step time: this tree's `train.step.loss_and_metrics` against the
same function at an older commit (loaded from `git show REV:train/step.py`, with that commit's
train/loss.py, whose API it calls), alternating, one run.

Until 813967c the training-time test re-ran every earlier step's rows at each step (k(k+1)/2 row
passes); since then step j runs its own L rows over the earlier steps' keys and values (k passes).
Both are timed as one jitted value-and-grad on the same random features and rows (Gemma-3-270M's
width: one layer, H 640, 4 x 256 heads, 1 KV head, MLP 2048; Vd 8192, K 8), and their losses and
gradients are compared.

    python -m bench.chain_objective_speed [--old 4e7007d] [--length 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.handles.drafter import Drafter
from peagle_jax.runtime.timing import side_by_side, wall
from train.cod import chain_rows
from train.spec import LossSpec
from train.step import loss_and_metrics, split_params

ROOT = Path(__file__).resolve().parents[1]


def _module_at(rev: str, path: str, name: str):
    """The module of file `path` at commit `rev`, imported as `name`."""
    src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True)
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(src.stdout)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def old_loss(rev: str):
    """`loss_and_metrics` of train/step.py at commit `rev`, over train/loss.py of `rev` (beside this
    tree's other modules): its keyword form, (parts, params, frozen, aux, y, head_w, batch, **kw)."""
    today = sys.modules["train.loss"]
    sys.modules["train.loss"] = _module_at(rev, "train/loss.py", "old_loss")
    try:
        return _module_at(rev, "train/step.py", "old_step").loss_and_metrics
    finally:
        sys.modules["train.loss"] = today


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.chain_objective_speed", description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="4e7007d", help="the commit whose chain objective is compared")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="runs/bench/chain_objective_speed.json")
    args = ap.parse_args()
    k, h, v, vd, length = 8, 640, 32000, 8192, args.length
    cfg = DrafterConfig(
        hidden_size=h, target_hidden_size=h, num_layers=1, num_heads=4, num_kv_heads=1, head_dim=256,
        intermediate_size=2048, vocab_size=v, draft_vocab_size=vd, mode="chain", mask_token_id=None, k_train=k,
    )  # fmt: skip
    parts, params, frozen = split_params(Drafter.random(cfg, seed=0), False, False)
    rng = np.random.default_rng(0)
    a, d, c = (np.asarray(x)[None].astype(np.int32) for x in chain_rows(np.zeros(length, np.int32), k))
    batch = dict(
        tokens=rng.integers(1, v, (1, length)).astype(np.int32),
        sup=np.ones((1, length), bool),
        anchor=a,
        depth=d,
        doc=c,
    )
    aux = jnp.asarray(rng.normal(size=(1, length, 3 * h)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(1, length, h)), jnp.float32)
    head_w = jnp.asarray(rng.normal(size=(vd, h)), jnp.float32)
    kw = dict(mode="chain", k=k, per_depth=False, chain_decay=0.8, softcap=None, attention="auto")
    old = old_loss(args.old)
    losses = {
        f"old ({args.old})": lambda p: old(parts, p, frozen, aux, y, head_w, batch, **kw)[0],
        "new": lambda p: loss_and_metrics(parts, p, frozen, aux, y, head_w, batch, LossSpec(**kw))[0],
    }
    grads = {name: jax.jit(jax.value_and_grad(f)) for name, f in losses.items()}
    steps = {name: functools.partial(g, params) for name, g in grads.items()}
    outs = {name: wall(step)[1] for name, step in steps.items()}  # compile + first call
    (l0, g0), (l1, g1) = outs.values()
    rel = max(float(jnp.max(jnp.abs(g1[n] - g0[n])) / jnp.max(jnp.abs(g0[n]))) for n in g0)
    med = {name: t.ms / 1000 for name, t in side_by_side(steps, args.repeats, first=False).items()}  # alternating
    old, new = med.values()
    print(
        f"L {length}, K {k}: " + ", ".join(f"{n} {t:.2f} s" for n, t in med.items()) + f"; old / new {old / new:.2f}x"
    )
    print(f"loss old {float(l0):.6f} new {float(l1):.6f}; gradients max relative difference {rel:.2e}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    result = dict(length=length, k=k, seconds=med, ratio=old / new, loss=[float(l0), float(l1)], grad_rel=rel)
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
