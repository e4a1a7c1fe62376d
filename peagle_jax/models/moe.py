"""Mixture-of-experts feed-forward (Qwen3-MoE, GPT-OSS): a top-k router and stacked experts.

Each token picks `num_experts_per_tok` experts; the (token, expert) pairs are sorted by expert
and every expert multiplies only its own rows (a grouped matmul), so the work is k / E of a
dense pass over all experts. Three interchangeable products, `impl`:

- "ragged": `jax.lax.ragged_dot` (a native grouped GEMM on TPU; differentiable).
- "blocks": the sorted rows padded per expert to blocks of `block_rows_for(...)` rows, one block
  at a time (a loop over the blocks, each reading its own expert's weights). jax
  lowers `ragged_dot` on CPU to a masked dense product over all experts (E times the work,
  measured in bench/moe_bench.py), and XLA's GPU compiler to a product over every expert, so
  "auto" uses this on CPU and GPU.
- "dense": every expert over every token, weighted by the routing (the reference and the
  baseline the benchmark compares against; E / k times the work).

Hugging Face weight semantics: expert stacks are [E, in, out] (GPT-OSS stores them so; the
Qwen3-MoE per-expert [out, in] matrices are transposed and stacked at load).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import kernels
from peagle_jax.config.target_config import TargetConfig
from peagle_jax.models.layers import ACTIVATIONS, Linear
from peagle_jax.models.rows import rows_sharding

GROUPED_IMPLS = ("auto", "ragged", "blocks", "dense")
MAX_BLOCK_ROWS = 64


def resolve_impl(impl: str = "auto") -> str:
    """ "auto" -> "ragged" on TPU (a native grouped GEMM), "blocks" elsewhere: XLA's GPU compiler,
    like jax on CPU, expands `ragged_dot` into a product over every expert (a Qwen3-30B-A3B step
    at 4,096 tokens planned bf16[128, 32768, 2048] temporaries on an H100: 16.28 GiB, 2.41 with
    "blocks"; a decode step reads every expert's weights)."""
    if impl not in GROUPED_IMPLS:
        raise ValueError(f"unknown MoE impl {impl!r}; expected one of {GROUPED_IMPLS}")
    if impl != "auto":
        return impl
    return "ragged" if kernels.platform() == "tpu" else "blocks"


def route(logits: jax.Array, k: int, router: str, norm_topk_prob: bool, dtype) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] in `dtype`, expert ids [N, k] int32) from router logits [N, E].

    "softmax_topk" (Qwen3-MoE): float32 softmax over all experts, top-k, optionally renormalised.
    "topk_softmax" (GPT-OSS): top-k logits, softmax over the k selected.
    """
    logits = logits.astype(jnp.float32)
    if router == "softmax_topk":
        vals, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        if norm_topk_prob:
            vals = vals / jnp.sum(vals, axis=-1, keepdims=True)
    else:
        vals, ids = jax.lax.top_k(logits, k)
        vals = jax.nn.softmax(vals, axis=-1)
    return vals.astype(dtype), ids.astype(jnp.int32)


def block_rows_for(num_rows: int, num_experts: int) -> int:
    """Rows per block: about the mean group size (a power of two in [1, MAX_BLOCK_ROWS])."""
    mean = max(1, num_rows // num_experts)
    return min(MAX_BLOCK_ROWS, 1 << (mean.bit_length() - 1))


class Experts(nnx.Module):
    """`num_experts` gated MLPs as stacked [E, in, out] weights (names as in Hugging Face)."""

    def __init__(self, cfg: TargetConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        del dtype  # the products run in the activations' dtype (weights are cast to it)
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size

        def param(*shape):
            return nnx.Param(0.02 * jax.random.normal(rngs.params(), shape, param_dtype))

        self.interleaved = cfg.expert_gate_up == "interleaved"
        if self.interleaved:
            self.gate_up_proj = param(e, h, 2 * i)
        else:
            self.gate_proj = param(e, h, i)
            self.up_proj = param(e, h, i)
        self.down_proj = param(e, i, h)
        self.bias = cfg.expert_bias
        if self.bias:
            self.gate_up_proj_bias = nnx.Param(jnp.zeros((e, 2 * i), param_dtype))
            self.down_proj_bias = nnx.Param(jnp.zeros((e, h), param_dtype))
        self.act, self.limit, self.alpha = cfg.hidden_act, cfg.swiglu_limit, cfg.swiglu_alpha

    def ffn(self, x: jax.Array, matmul, bias_of) -> jax.Array:
        """One expert pass over rows x; `matmul(x, w)` multiplies by the rows' experts' slices of a
        stack w [E, in, out], `bias_of(b)` picks the rows' experts' rows of a bias stack [E, out]."""
        if self.interleaved:
            h = matmul(x, self.gate_up_proj[...])
            if self.bias:
                h = h + bias_of(self.gate_up_proj_bias[...])
            gate, up = h[..., ::2], h[..., 1::2]
        else:
            gate, up = matmul(x, self.gate_proj[...]), matmul(x, self.up_proj[...])
        if self.limit is not None:  # GPT-OSS: clamped SwiGLU with (up + 1)
            gate = jnp.minimum(gate, self.limit)
            up = jnp.clip(up, -self.limit, self.limit)
            a = (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))
        else:
            a = ACTIVATIONS[self.act](gate) * up
        y = matmul(a, self.down_proj[...])
        if self.bias:
            y = y + bias_of(self.down_proj_bias[...])
        return y

    def grouped(self, x_sorted: jax.Array, experts_sorted: jax.Array, group_sizes: jax.Array, impl: str):
        """x_sorted [M, H] (rows sorted by expert), their experts [M], group_sizes [E] -> [M, H]."""
        if impl == "ragged":
            return self.ffn(
                x_sorted,
                lambda a, w: jax.lax.ragged_dot(a, w.astype(a.dtype), group_sizes),
                lambda b: b[experts_sorted],
            )
        return self.blocks(x_sorted, experts_sorted, group_sizes)

    def one_expert(self, x: jax.Array, ex: jax.Array) -> jax.Array:
        """Rows x [n, H] through expert `ex` (a traced index) alone."""
        return self.ffn(x, lambda a, w: a @ w[ex].astype(a.dtype), lambda b: b[ex][None])

    def blocks(self, x_sorted, experts_sorted, group_sizes):
        """The grouped product as a loop over blocks of one expert each (see the module doc)."""
        m, h = x_sorted.shape
        e = group_sizes.shape[0]
        bm = block_rows_for(m, e)
        rows = -(-(m + min(e, m) * (bm - 1)) // bm) * bm  # room for every group padded to a block multiple
        padded = -(-group_sizes // bm) * bm
        pad_end = jnp.cumsum(padded)
        pad_start = pad_end - padded
        grp_start = jnp.cumsum(group_sizes) - group_sizes
        # every padded row's expert and sorted row; the rows past a group's end, and past the last
        # group (at most (E - groups used) * (bm - 1), none when bm = 1), are zeros: run, never read
        row = jnp.arange(rows)
        row_expert = jnp.minimum(jnp.searchsorted(pad_end, row, side="right"), e - 1)
        offset = row - pad_start[row_expert]
        src = jnp.minimum(grp_start[row_expert] + offset, m - 1)
        xp = jnp.where((offset < group_sizes[row_expert])[:, None], x_sorted[src], 0).reshape(rows // bm, bm, h)
        block_expert = row_expert[::bm]

        # each block's output overwrites its input, in a buffer gathered from this layer's rows: a
        # new buffer (zeros to scatter into, a scan's stacked outputs) is a constant broadcast, which
        # XLA's GPU compiler fuses with every other layer's into one kernel run first, so all layers'
        # buffers were live at once (0.3 GiB a layer for Qwen3-30B-A3B at 4,096 tokens a device)
        def body(b, buf):
            return buf.at[b].set(self.one_expert(buf[b].astype(x_sorted.dtype), block_expert[b]))

        out = jax.eval_shape(self.one_expert, xp[0], block_expert[0])
        yp = jax.lax.fori_loop(0, rows // bm, body, xp.astype(out.dtype)).reshape(rows, h)
        return yp[pad_start[experts_sorted] + jnp.arange(m) - grp_start[experts_sorted]]

    def dense(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        """Every expert over every token x [N, H], summed with weights combine [N, E] (0 where not
        selected): the dense reference / baseline, E / k times the grouped work."""

        def body(acc, inp):
            ex, wcol = inp
            y = self.one_expert(x, ex)
            return acc + y.astype(jnp.float32) * wcol[:, None].astype(jnp.float32), None

        e = combine.shape[1]
        acc, _ = jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), (jnp.arange(e), combine.T))
        return acc.astype(x.dtype)


class MoE(nnx.Module):
    """Router + experts; `impl` picks the grouped product (see the module doc)."""

    def __init__(
        self, cfg: TargetConfig, *, impl: str = "auto", dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        self.router = Linear(
            cfg.hidden_size, cfg.num_experts, use_bias=cfg.router_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.experts = Experts(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.k, self.num_experts = cfg.num_experts_per_tok, cfg.num_experts
        self.router_kind, self.norm_topk_prob = cfg.router, cfg.norm_topk_prob
        self.impl = impl

    def routing(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights [N, k], expert ids [N, k]) of tokens x [N, H]."""
        return route(self.router(x), self.k, self.router_kind, self.norm_topk_prob, x.dtype)

    def __call__(self, x: jax.Array, impl: str | None = None) -> jax.Array:
        """x [..., H] -> [..., H]. Inside `rows_sharded` with x's rows [B, T, H] split over the
        devices, each device routes and sorts its own tokens: one sort over every device's tokens
        would gather all of them to each device (8 H100s each planned 8 sequences' expert
        activations for a Qwen3-30B-A3B train step)."""
        sharding = rows_sharding()
        if sharding is None or x.ndim != 3 or not _splits(sharding, x.shape[0]):
            return self.tokens(x, impl)
        graphdef, state = nnx.split(self)
        rows = P(sharding.spec[0])

        def local(state, x):
            return nnx.merge(graphdef, state).tokens(x, impl)

        # the weights enter whole (gathered from their fsdp shards, as a dense layer's are), once
        # this layer's input exists: free to move, XLA gathered every layer's experts up front
        state, x = jax.lax.optimization_barrier((state, x))
        return jax.shard_map(local, mesh=sharding.mesh, in_specs=(P(), rows), out_specs=rows)(state, x)

    def tokens(self, x: jax.Array, impl: str | None = None) -> jax.Array:
        """Every token of x [..., H] routed and its experts run in one sorted pass."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        impl = resolve_impl(impl or self.impl)
        weights, ids = self.routing(x)
        if impl == "dense":
            combine = jnp.zeros((x.shape[0], self.num_experts), weights.dtype)
            combine = combine.at[jnp.arange(x.shape[0])[:, None], ids].set(weights)
            return self.experts.dense(x, combine).reshape(shape)
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        y = self.experts.grouped(x[order // k], flat[order], group_sizes, impl)
        y = (y * weights.reshape(-1)[order][:, None]).astype(jnp.float32)
        # each token's k outputs gathered back and added in f32 in the order of their experts, as
        # Hugging Face's per-expert loop adds them; not scattered into zeros: a constant broadcast,
        # which XLA's GPU compiler fuses with every other layer's into one kernel run first
        place = jnp.argsort(order)[jnp.arange(n)[:, None] * k + jnp.argsort(ids, axis=1)]  # [n, k]
        out = y[place[:, 0]]
        for j in range(1, k):
            out = out + y[place[:, j]]
        return out.astype(x.dtype).reshape(shape)


def _splits(sharding, rows: int) -> bool:
    """Whether `sharding` splits a batch of `rows` rows over more than one device, evenly."""
    axes = sharding.spec[0] if sharding.spec else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    n = math.prod(sharding.mesh.shape[a] for a in axes)
    return n > 1 and rows % n == 0


def expert_counts(moe: MoE, x: jax.Array) -> jax.Array:
    """Tokens routed to each expert [E] for hidden states x [..., H] (tests: routing is not trivial)."""
    _, ids = moe.routing(x.reshape(-1, x.shape[-1]))
    return jnp.bincount(ids.reshape(-1), length=moe.num_experts)
