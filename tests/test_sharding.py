"""Tensor-parallel placement: the speculative engine on 8 simulated CPU devices gives the
same tokens as on one device (plain greedy decoding there: the engine is lossless). Runs in a subprocess (the device count is fixed at start)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import hf_tiny
import xla_env

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    import peagle_jax as pj
    from infer import SpeculativeDecoder
    from peagle_jax.sharding import make_mesh

    folder = sys.argv[1]
    assert len(jax.devices()) == 8, jax.devices()
    mesh = make_mesh(tensor=4, fsdp=2)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    out = {}
    for sharded in (False, True):
        target = pj.load_target(folder, dtype="float32", aux_layer_ids=(0, 1, 2),
                                mesh=mesh if sharded else None)
        q = target.state["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
        out[f"q_shards_{sharded}"] = len({str(s.index) for s in q.addressable_shards})
        out[f"none_{sharded}"] = SpeculativeDecoder(target, mode="none").generate(prompts, max_new_tokens=12).tokens
    # the speculative modes on the mesh only: lossless, so one device's tokens are its plain greedy ones
    for mode in ("parallel", "chain"):
        drafter = pj.new_drafter(target, num_layers=2, mode=mode, seed=4)
        res = SpeculativeDecoder(target, drafter, k=3, mode=mode).generate(prompts, max_new_tokens=12)
        out[f"{mode}_True"], out[f"{mode}_rounds"] = res.tokens, res.stats["rounds"]
    print(json.dumps(out))
""")


def test_sharded_engine_equals_single_device(tmp_path):
    hf_tiny.build("llama-gqa2-tied-llama3", tmp_path / "t")
    env = xla_env.simulated_devices(8)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "t")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["q_shards_False"] == 1 and out["q_shards_True"] == 8  # really spread over the mesh
    for mode in ("parallel", "chain", "none"):
        assert out[f"{mode}_True"] == out["none_False"], mode
    assert out["parallel_rounds"] > 0 and out["chain_rounds"] > 0
