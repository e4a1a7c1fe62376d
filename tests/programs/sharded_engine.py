"""`python tests/programs/sharded_engine.py FOLDER`: the speculative engine on a tensor 4 x fsdp 2
mesh of the 8 devices this process must see, against one device, for the tiny dense target in
the HF folder FOLDER; prints one JSON line: how many distinct shards the first q_proj has on
each placement (`q_shards_False`, `q_shards_True`), the plain greedy tokens on each
(`none_False`, `none_True`), and on the mesh the tokens and round counts of the parallel and
chain modes (`parallel_True`, `parallel_rounds`, `chain_True`, `chain_rounds`)."""

import json
import sys

import jax

import peagle_jax as pj
from infer import SpeculativeDecoder
from peagle_jax import make_mesh  # the public name the README uses


def main(argv: list[str]) -> int:
    folder = argv[0]
    assert len(jax.devices()) == 8, jax.devices()
    mesh = make_mesh(tensor=4, fsdp=2)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    out = {}
    for sharded in (False, True):
        target = pj.load_target(folder, dtype="float32", aux_layer_ids=(0, 1, 2), mesh=mesh if sharded else None)
        q = target.state["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
        out[f"q_shards_{sharded}"] = len({str(s.index) for s in q.addressable_shards})
        out[f"none_{sharded}"] = SpeculativeDecoder(target, mode="none").generate(prompts, max_new_tokens=12).tokens
    # the speculative modes on the mesh only: lossless, so one device's tokens are its plain greedy ones
    for mode in ("parallel", "chain"):
        drafter = pj.new_drafter(target, num_layers=2, mode=mode, seed=4)
        res = SpeculativeDecoder(target, drafter, k=3, mode=mode).generate(prompts, max_new_tokens=12)
        out[f"{mode}_True"], out[f"{mode}_rounds"] = res.tokens, res.stats["rounds"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
