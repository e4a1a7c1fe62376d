"""`python tests/programs/moe_sharded.py FOLDER`: a tiny MoE target (the HF folder FOLDER) loaded
on one device and on an fsdp 2 x tensor 4 mesh of the 8 devices this process must see; prints
one JSON line: for each placement (`False`: one device, `True`: the mesh) how many distinct
shards the first expert stack has, the logits of a fixed batch, and the tokens of a parallel
speculative decode."""

import json
import sys

import jax
import numpy as np

import peagle_jax as pj
from peagle_jax.engine import SpeculativeDecoder
from peagle_jax.runtime.sharding import make_mesh


def main(argv: list[str]) -> int:
    folder = argv[0]
    assert len(jax.devices()) == 8, jax.devices()
    mesh = make_mesh(tensor=4, fsdp=2)
    ids = np.arange(24, dtype=np.int32).reshape(2, 12) % 90
    out = {}
    for sharded in (False, True):
        target = pj.load_target(folder, dtype="float32", aux_layer_ids=(0, 1, 2), mesh=mesh if sharded else None)
        w = target.state["layers"][0]["mlp"]["experts"]["gate_up_proj"][...]
        out[f"expert_shards_{sharded}"] = len({str(s.index) for s in w.addressable_shards})
        out[f"logits_{sharded}"] = np.asarray(target.forward(ids).logits).tolist()
        drafter = pj.new_drafter(target, num_layers=1, mode="parallel", seed=4)
        out[f"tokens_{sharded}"] = (
            SpeculativeDecoder(target, drafter, k=3, mode="parallel")
            .generate([[3, 1, 4, 1, 5], [9, 2, 6]], max_new_tokens=8)
            .tokens
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
