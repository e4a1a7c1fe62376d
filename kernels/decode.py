"""Attention of a few query rows over a long KV cache, at a cost that follows the filled length.

Decoding and speculative verification query T = 1 .. 2K+2 rows against a static cache of S
slots (index = position). The dense path reads all S slots every step, so a request with 1k
tokens in a 32k cache pays for 32k. Here the cache is read block by block, only the blocks
between the lowest key any query may see (its position minus the sliding window) and the
highest query position of the batch: a `lax.fori_loop` with traced bounds and an online
softmax (f32), so one compiled step serves every filled length.

Visibility is the positional causal rule of the models: key slot j is seen by a query at
position p >= 0 when j <= p (and p - j < window); slots past p hold stale values (rejected
drafts) and are never read as visible. Semantics otherwise as `kernels.reference`: GQA by
consecutive groups, softcap, per-head sinks in the denominator, fully masked rows give 0.
Inference only (no custom VJP: `fori_loop` with traced bounds is not reverse-differentiable).

Backends (``backend="auto"`` picks by platform, as `kernels.api.resolve_backend`): "xla", the
path here (the batch's widest block range, every row reads it; the default on CPU); "gpu",
`kernels.decode_gpu` (Pallas Triton, flash-decoding: each batch row reads only its own blocks,
the range split over several programs); "tpu", `kernels.decode_tpu` (Pallas Mosaic, per-row
block bounds scalar-prefetched). Slots outside every read block are never touched; slots in a
read block that no query sees are multiplied by probability 0, so caches must hold finite
values (zeros and stale drafts do).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .api import resolve_backend
from .partition import per_shard

__all__ = ["attention", "filled_blocks", "DEFAULT_BLOCK", "DEFAULT_BLOCKS", "BACKENDS"]

DEFAULT_BLOCK = 256
# KV block per backend (gpu: a power of two >= 16; tpu: a multiple of 128; xla: any)
DEFAULT_BLOCKS = {"xla": DEFAULT_BLOCK, "gpu": 64, "tpu": 512}
BACKENDS = ("auto", "xla", "gpu", "tpu")


def _block_size(s: int, block: int) -> int:
    return max(1, min(block, s))


def attention(
    q,
    k_cache,
    v_cache,
    q_pos,
    *,
    scale: float,
    softcap: float | None = None,
    sinks=None,
    window: int | None = None,
    block: int | None = None,
    backend: str = "auto",
    interpret=False,
):
    """q [B, T, Hq, D], k/v cache [B, S, Hkv, D], q_pos [B, T] int (-1 = padding row) ->
    out [B, T, Hq, D] in q.dtype.

    ``backend``: "auto" (Pallas GPU on GPU, Pallas TPU on TPU, "xla" elsewhere), "xla", "gpu"
    or "tpu". ``block``: KV block (default `DEFAULT_BLOCKS` of the backend; gpu: a power of
    two >= 16, tpu: a multiple of 128). ``interpret``: run the Pallas kernels interpreted on
    CPU (gpu: True; tpu: True for TPU interpret mode, "generic" for the plain Pallas
    interpreter); ignored by "xla".
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown decode attention backend {backend!r}; expected one of {BACKENDS}")
    backend = resolve_backend(backend)
    block = DEFAULT_BLOCKS[backend] if block is None else int(block)
    kw = dict(scale=scale, softcap=softcap, window=window, block=block)
    if backend in ("gpu", "tpu"):
        if backend == "gpu":
            from . import decode_gpu as impl

            interpret = bool(interpret)
        else:
            from . import decode_tpu as impl

        def kernel(q, k_cache, v_cache, q_pos, sinks):
            return impl.attention(q, k_cache, v_cache, q_pos, sinks=sinks, interpret=interpret, **kw)

        args, layouts = (q, k_cache, v_cache, q_pos, sinks), ("bthd", "bthd", "bthd", "bt", "h")
        return per_shard(kernel, args, layouts, "bthd", batch=q.shape[0], heads=(q.shape[2], k_cache.shape[2]))
    return _attention_xla(q, k_cache, v_cache, q_pos, sinks=sinks, **kw)


def _attention_xla(q, k_cache, v_cache, q_pos, *, scale, softcap, sinks, window, block):
    b, t, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    g = hq // hkv
    bk = _block_size(s, block)
    qg = q.reshape(b, t, hkv, g, d)
    pos = q_pos.astype(jnp.int32)
    valid = pos >= 0
    first, last = _block_range(pos, s, bk, window)

    def body(i, carry):
        m, denom, acc = carry
        nominal = i * bk
        start = jnp.minimum(nominal, s - bk)  # dynamic_slice clamps; mask the re-read keys below
        kb = lax.dynamic_slice_in_dim(k_cache, start, bk, axis=1)
        vb = lax.dynamic_slice_in_dim(v_cache, start, bk, axis=1)
        kpos = start + jnp.arange(bk, dtype=jnp.int32)  # [bk]
        sc = jnp.einsum("btkgd,bskd->bkgts", qg, kb, preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            sc = softcap * jnp.tanh(sc / softcap)
        see = (kpos[None, None, :] <= pos[:, :, None]) & (kpos[None, None, :] >= nominal) & valid[:, :, None]
        if window is not None:
            see &= pos[:, :, None] - kpos[None, None, :] < window
        see = see[:, None, None]  # [B, 1, 1, T, bk]
        m_new = jnp.maximum(m, jnp.max(jnp.where(see, sc, -jnp.inf), axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(see, jnp.exp(sc - m_safe[..., None]), 0.0)
        corr = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        denom = denom * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v_cache.dtype), vb, preferred_element_type=jnp.float32)
        acc = acc * corr[..., None] + pv
        return m_new, denom, acc

    init = (
        jnp.full((b, hkv, g, t), -jnp.inf, jnp.float32),
        jnp.zeros((b, hkv, g, t), jnp.float32),
        jnp.zeros((b, hkv, g, t, d), jnp.float32),
    )
    m, denom, acc = lax.fori_loop(first, last, body, init)
    if sinks is not None:
        sk = jnp.asarray(sinks, jnp.float32).reshape(1, hkv, g, 1)
        m_all = jnp.maximum(m, sk)
        denom = denom * jnp.where(jnp.isfinite(m), jnp.exp(m - m_all), 0.0) + jnp.exp(sk - m_all)
        acc = acc * jnp.where(jnp.isfinite(m), jnp.exp(m - m_all), 0.0)[..., None]
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [B, Hkv, G, T, D]
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, hq, d)
    return jnp.where(valid[:, :, None, None], out, 0.0).astype(q.dtype)


def _block_range(pos, s: int, bk: int, window: int | None):
    """[first, last) cache blocks holding a key some valid query row may see: from the lowest
    position inside any row's window (0 without a window) to the highest query position."""
    valid = pos >= 0
    hi = jnp.max(jnp.where(valid, pos, -1))
    lo = jnp.int32(0) if window is None else jnp.min(jnp.where(valid, pos - window + 1, s))
    first = jnp.clip(lo, 0, s - 1) // bk
    last = jnp.where(hi >= 0, jnp.minimum(hi // bk + 1, -(-s // bk)), first)  # no valid row: no block
    return first, last


def filled_blocks(q_pos, s: int, block: int = DEFAULT_BLOCK, window: int | None = None) -> jax.Array:
    """How many cache blocks `attention` reads for these query positions (tests, benchmarks)."""
    bk = _block_size(s, block)
    first, last = _block_range(jnp.asarray(q_pos, jnp.int32), s, bk, window)
    return last - first
