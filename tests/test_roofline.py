"""The roofline estimate's counts (`peagle_jax.hardware.roofline`, `kernels.cost`): FLOPs of a jaxpr
against hand counts (matrix products, scans, conds, shard_map, a custom VJP's backward, the Pallas
kernels' own estimates), the causal pair count against a brute-force mask, and which inputs are
only gathered from. The compiled programs' estimates are checked in tests/compile/."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kernels
from kernels.cost import attention_cost, causal_pairs
from kernels.spec import AttentionSpec
from peagle_jax.hardware.roofline import estimate, gathered_inputs, jaxpr_flops

M, K, N = 8, 16, 32
MATMUL = 2 * M * K * N  # one [M, K] @ [K, N]


def flops_of(f, *args) -> float:
    return jaxpr_flops(jax.make_jaxpr(f)(*args))


def test_a_matrix_product_counts_two_flops_per_multiply_add():
    x, w = jnp.ones((M, K)), jnp.ones((K, N))
    assert flops_of(lambda x, w: x @ w, x, w) == MATMUL
    batched = jnp.ones((3, M, K))  # a batch dimension multiplies the count
    assert flops_of(lambda x, w: jnp.einsum("bmk,kn->bmn", x, w), batched, w) == 3 * MATMUL


def test_a_scan_counts_its_body_times_its_length_and_a_cond_its_costliest_branch():
    x, w = jnp.ones((M, K)), jnp.ones((K, K))

    def scanned(x, w):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0]

    assert flops_of(scanned, x, w) == 5 * (2 * M * K * K)

    def branchy(p, x, w):
        return jax.lax.cond(p, lambda: (x @ w) @ w, lambda: x @ w)

    assert flops_of(branchy, True, x, w) == 2 * (2 * M * K * K)


def test_a_custom_vjp_gradient_counts_its_backward_rule():
    @jax.custom_vjp
    def f(x, w):
        return x @ w

    f.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))
    x, w = jnp.ones((M, K)), jnp.ones((K, N))
    # forward, then dx = g w^T and dw = x^T g: each the forward's size
    assert flops_of(jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1)), x, w) == 3 * MATMUL


def test_a_shard_map_body_counts_once_per_shard():
    """A body over 4 shards (an abstract mesh: no devices needed) sees a quarter of the rows; the
    count is the whole product's."""
    mesh = jax.sharding.AbstractMesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    x, w = jax.ShapeDtypeStruct((4 * M, K), jnp.float32), jax.ShapeDtypeStruct((K, N), jnp.float32)
    body = jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    jaxpr = jax.make_jaxpr(body)(x, w)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    assert eqn.params["newly_manual_axes"] == frozenset({"x"})
    assert jaxpr_flops(eqn.params["jaxpr"]) == MATMUL  # one shard's product
    assert jaxpr_flops(jaxpr) == 4 * MATMUL  # every shard's


@pytest.mark.parametrize("tq,tk,window", [(64, 64, None), (64, 64, 16), (5, 70, None), (5, 70, 8), (1, 33, None)])
def test_causal_pairs_equal_the_count_of_a_causal_mask(tq, tk, window):
    q = np.arange(tk - tq, tk)[:, None]
    k = np.arange(tk)[None, :]
    mask = (k <= q) & ((q - k < window) if window else True)
    assert causal_pairs(tq, tk, window) == int(mask.sum())


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_the_pallas_kernels_carry_their_cost_into_the_count(backend):
    """Causal attention through a Pallas backend, forward and backward: the jaxpr's FLOPs are the
    kernels' estimates (4 + 6 + 8 per visible pair and head-dim element) and the backward's one
    product outside them (delta = rowsum(o * dO), a contraction over the head dim)."""
    b, t, hq, hkv, d = 1, 256, 4, 2, 64
    q = jnp.ones((b, t, hq, d), jnp.float32)
    kv = jnp.ones((b, t, hkv, d), jnp.float32)
    spec = AttentionSpec.causal(jnp.arange(t)[None])

    def loss(q, k, v):
        return kernels.attention(q, k, v, spec, backend=backend, interpret=True).sum()

    pairs = b * hq * causal_pairs(t, t)
    assert flops_of(lambda *a: loss(*a), q, kv, kv) == 4 * pairs * d
    delta = 2 * b * hq * t * d
    assert flops_of(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv) == (4 + 6 + 8) * pairs * d + delta
    fwd = attention_cost("fwd", b, t, hq, t, hkv, d, 4)
    assert fwd.bytes_accessed == 4 * (2 * b * t * hq * d + 2 * b * t * hkv * d) + 4 * b * hq * t


def test_only_an_input_read_by_gathers_counts_as_gathered():
    table, ids, w = jnp.ones((100, K)), jnp.arange(4), jnp.ones((K, N))

    @jax.jit
    def embed(table, ids):  # a nested call: followed into its body
        return table[ids]

    def lookup(table, ids, w):
        return embed(table, ids) @ w

    def tied(table, ids, w):  # the same table as an output projection: read whole
        return table[ids] @ table.T

    assert gathered_inputs(jax.make_jaxpr(lookup)(table, ids, w)) == [0]
    assert gathered_inputs(jax.make_jaxpr(tied)(table, ids, w)) == []


def test_the_estimate_is_the_slower_of_compute_and_memory():
    class Device:
        peak_flops, bandwidth = 1e12, 1e9

    sizes = dict(argument_bytes=3_000, output_bytes=500, alias_bytes=500, gathered_bytes=1_000)
    e = estimate(8e9, 4, device=Device, **sizes)
    assert (e.flops, e.bytes) == (2e9, 2_000)  # FLOPs split over the devices; bytes already per device
    assert e.seconds == e.compute_seconds == 2e-3 and e.bound == "compute"
    e = estimate(8e3, 4, device=Device, **sizes)
    assert e.seconds == e.memory_seconds == 2e-6 and e.bound == "memory"
