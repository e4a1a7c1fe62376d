"""`python tests/programs/partitioned_kernels.py`: the Pallas kernels (interpreted on CPU) run per
shard of a (data 2, fsdp 2, tensor 2) mesh of 8 simulated devices (`kernels.partitioned`) against
the same kernels unpartitioned: the P-EAGLE attention's output, lse and gradients, and decode
attention. Prints one JSON line: the largest absolute difference of each, how many shard_map
regions each partitioned program has (`manual_*`: 0 would mean it ran unpartitioned), and the rows
a device's kernel sees of 4 and of 3 rows (`local_rows`, which sizes the TPU schedule)."""

import json

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from kernels import decode
from kernels.layouts import cod_layout
from kernels.partition import local_rows
from peagle_jax.runtime.sharding import kernels_partitioned, make_mesh


def peagle_case(rng, B=4, n=40, Hq=4, Hkv=2, D=16):
    layout = cod_layout(n, 3, rng=np.random.default_rng(1), docs=np.repeat([0, 1], n // 2), pad_to=96)
    anchor, depth, doc = (jnp.asarray(np.tile(a, (B, 1))) for a in layout)
    q = jnp.asarray(rng.normal(size=(B, anchor.shape[1], Hq, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, anchor.shape[1], Hkv, D)), jnp.float32) for _ in range(2))
    return q, k, v, kernels.AttentionSpec.peagle(anchor, depth, doc), jnp.asarray(rng.normal(size=(Hq,)), jnp.float32)


def main() -> None:
    mesh = make_mesh(tensor=2, fsdp=2, data=2)
    rng = np.random.default_rng(0)
    q, k, v, spec, sinks = peagle_case(rng)

    def loss(q, k, v):
        out, lse = kernels.attention(q, k, v, spec, sinks=sinks, backend="gpu", interpret=True, return_lse=True)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    def run(fn, *args, on_mesh: bool):
        def scoped(*a):
            with kernels_partitioned(mesh if on_mesh else None):
                return fn(*a)

        jitted = jax.jit(scoped)
        return jitted(*args), jitted.lower(*args).as_text().count("sdy.manual_computation")

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (plain, _), (shard, manual) = (run(grad, q, k, v, on_mesh=m) for m in (False, True))
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), plain, shard)
    (_, (out, lse)), grads = diffs
    res = {"out": out, "lse": lse, "grads": max(grads), "manual_attention": manual}

    B, T, S, Hq, Hkv, D = 4, 3, 300, 4, 2, 16
    qd = jnp.asarray(rng.normal(size=(B, T, Hq, D)), jnp.float32)
    kc, vc = (jnp.asarray(rng.normal(size=(B, S, Hkv, D)), jnp.float32) for _ in range(2))
    pos = jnp.asarray([[10, 11, 12], [100, 101, -1], [250, 251, 252], [0, 1, 2]], jnp.int32)

    def dec(qd, kc, vc):
        return decode.attention(qd, kc, vc, pos, scale=0.25, sinks=sinks, backend="gpu", interpret=True)

    (a, _), (b, manual) = (run(dec, qd, kc, vc, on_mesh=m) for m in (False, True))
    res |= {"decode": float(jnp.max(jnp.abs(a - b))), "manual_decode": manual}
    with kernels_partitioned(mesh):
        res["local_rows"] = [local_rows(4), local_rows(3)]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
