"""The kernels' check cases, shared by the kernel tests (tests/kernels) and the device checks
(`python -m bench.gpu_check`, the TPU check of `python -m bench.device`); no kernel imports them.

A `Case` is a small random attention problem with COD / causal metadata, sized so that
interpret-mode Pallas runs quickly on CPU. `check_backend` runs one backend forward and
backward (out, lse, dq, dk, dv, dsinks) against `kernels.reference` under jit and returns
the normalised errors (`rel_err`). `decode_positions` places a decode call's query rows in a
filled KV cache.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels.api import attention
from kernels.layouts import cod_layout, pad_layout
from kernels.spec import AttentionSpec

# max |x - ref| / max |ref| per dtype (f32 ~1e-5, bf16 ~1e-2, as the brief asks)
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dtype: str = "float32"
    hq: int = 4
    hkv: int = 1
    d: int = 64
    # COD layouts, one per batch element: (n_positions, K, r, docs, loss_mask_frac or None)
    layouts: tuple = ((40, 4, 0.7, 2, None),)
    pad_extra: int = 5  # padding rows appended after the longest layout
    causal: tuple | None = None  # (Tq, Tk, n_docs, valid_q_per_batch) for a causal case
    sinks: bool = False
    softcap: float | None = None
    window: int | None = None
    seed: int = 0
    chain_depth: int = 0  # AttentionSpec.chain_depth of the COD cases
    # a DFlash block case (`AttentionSpec.block`): (context length, block size, blocks, docs)
    block: tuple | None = None


def make_case(case: Case):
    """-> (q, k, v, spec, sinks) as jax arrays."""
    rng = np.random.default_rng(case.seed)
    if case.block is not None:
        spec, (B, Tq, Tk) = block_spec(case, rng)
    elif case.causal is not None:
        Tq, Tk, n_docs, valid = case.causal
        B = len(valid)
        kv_pos = np.tile(np.arange(Tk, dtype=np.int32), (B, 1))
        q_pos = kv_pos[:, Tk - Tq :]
        bounds = np.sort(rng.choice(np.arange(1, Tk), n_docs - 1, replace=False))
        kv_doc = np.tile(np.searchsorted(bounds, np.arange(Tk), side="right").astype(np.int32), (B, 1))
        for b, nv in enumerate(valid):
            kv_doc[b, Tk - Tq + nv :] = -1  # padding at the end of each row
        spec = AttentionSpec.causal(
            q_pos, kv_pos, q_doc=kv_doc[:, Tk - Tq :], kv_doc=kv_doc, sliding_window=case.window, softcap=case.softcap
        )
    else:
        rows = []
        for n, K, r, docs, lm in case.layouts:
            loss = None if lm is None else rng.random(n) < lm
            rows.append(cod_layout(n, K, r=r, rng=rng, docs=docs, loss_mask=loss))
        T = max(len(a) for a, _, _ in rows) + case.pad_extra
        rows = [pad_layout(*row, T) for row in rows]
        a, d, c = (np.stack(x) for x in zip(*rows))
        spec = AttentionSpec.peagle(
            a, d, c, sliding_window=case.window, softcap=case.softcap, chain_depth=case.chain_depth
        )
        Tq = Tk = T
        B = a.shape[0]
    dt = jnp.dtype(case.dtype)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(case.seed), 3)
    q = jax.random.normal(kq, (B, Tq, case.hq, case.d), jnp.float32).astype(dt)
    k = jax.random.normal(kk, (B, Tk, case.hkv, case.d), jnp.float32).astype(dt)
    v = jax.random.normal(kv, (B, Tk, case.hkv, case.d), jnp.float32).astype(dt)
    sinks = None
    if case.sinks:
        sinks = jnp.asarray(rng.normal(size=case.hq), jnp.float32)
    return q, k, v, spec, sinks


def block_spec(case: Case, rng):
    """DFlash blocks over a packed context: sorted distinct anchors (one a padding block), the
    documents contiguous, the last rows of the context padding."""
    length, bs, n, docs = case.block
    bounds = np.sort(rng.choice(np.arange(1, length), docs - 1, replace=False))
    doc = np.searchsorted(bounds, np.arange(length), side="right").astype(np.int32)
    doc[-3:] = -1
    anchors = np.sort(rng.choice(length - bs, n, replace=False)).astype(np.int32)
    block_doc = doc[anchors].copy()
    block_doc[n // 2] = -1
    spec = AttentionSpec.block(anchors, block_doc, np.arange(length), doc, block_size=bs)
    return spec, (1, n * bs, length + n * bs)


@functools.cache
def fwd_bwd_fn(backend: str, interpret, block_q, block_k, with_sinks: bool):
    """jit(fn(q, k, v, spec, sinks, do, dlse) -> (out, lse, grads))."""

    def loss(q, k, v, sinks, spec, do, dlse):
        out, lse = attention(
            q,
            k,
            v,
            spec,
            sinks=sinks,
            backend=backend,
            block_q=block_q,
            block_k=block_k,
            return_lse=True,
            interpret=interpret,
        )
        lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)
        return jnp.sum(out.astype(jnp.float32) * do) + lse_term, (out, lse)

    argnums = (0, 1, 2, 3) if with_sinks else (0, 1, 2)

    @jax.jit
    def f(q, k, v, spec, sinks, do, dlse):
        grads, (out, lse) = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, sinks, spec, do, dlse)
        return out, lse, grads

    return f


def cotangents(q, seed=1):
    B, Tq, Hq, D = q.shape
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(k1, q.shape, jnp.float32), 0.5 * jax.random.normal(k2, (B, Hq, Tq), jnp.float32))


def rel_err(x, ref):
    x = np.asarray(jnp.asarray(x, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    fin = np.isfinite(ref)
    if not np.array_equal(fin, np.isfinite(x)):
        return float("inf")
    if not np.array_equal(np.where(fin, 0, ref), np.where(fin, 0, x)):  # same infinities
        return float("inf")
    xf, rf = np.where(fin, x, 0.0), np.where(fin, ref, 0.0)
    scale = max(float(np.max(np.abs(rf))), 1e-6)
    return float(np.max(np.abs(xf - rf))) / scale


def decode_positions(b: int, t: int, fill, fills) -> np.ndarray:
    """[B, T] positions of the last T tokens of each row: filled to `fill`, or for "ragged" to
    fills[i % len(fills)] in row i."""
    per_row = [fills[i % len(fills)] if fill == "ragged" else fill for i in range(b)]
    return np.stack([np.arange(f - t, f) for f in per_row]).astype(np.int32)


def check_backend(case: Case, backend: str, *, interpret=False, block_q=None, block_k=None):
    """Errors of ``backend`` vs the reference on ``case``: dict name -> normalised error."""
    q, k, v, spec, sinks = make_case(case)
    do, dlse = cotangents(q)
    f = fwd_bwd_fn(backend, interpret, block_q, block_k, sinks is not None)
    r = fwd_bwd_fn("reference", False, None, None, sinks is not None)
    got = f(q, k, v, spec, sinks, do, dlse)
    # reference in f32 from the same (possibly bf16-rounded) inputs
    f32 = lambda x: x.astype(jnp.float32)
    want = r(f32(q), f32(k), f32(v), spec, sinks, do, dlse)
    names = ["out", "lse", "dq", "dk", "dv", "dsinks"]
    flat_got = [got[0], got[1], *got[2]]
    flat_want = [want[0], want[1], *want[2]]
    return {n: rel_err(a, b) for n, a, b in zip(names, flat_got, flat_want)}, got


def tolerance(case: Case) -> float:
    return TOLERANCE[case.dtype]


# The shared test matrix: GQA ratios 1/4/8, head_dim 64/128, f32/bf16, several K and r,
# lengths that are not block multiples, padding rows, several documents, sinks, softcap,
# sliding window, causal cross-attention (Tq != Tk) with a mostly-padding batch row.
CASE_COD_F32 = Case(
    "cod_gqa4_d64_f32_sinks",
    "float32",
    hq=4,
    hkv=1,
    d=64,
    layouts=((40, 4, 0.7, 2, None), (36, 8, 0.5, 1, 0.7)),
    pad_extra=7,
    sinks=True,
)
CASE_COD_BF16 = Case(
    "cod_gqa8_d128_bf16_window_softcap",
    "bfloat16",
    hq=8,
    hkv=1,
    d=128,
    layouts=((44, 6, 0.8, 3, None),),
    pad_extra=3,
    window=24,
    softcap=20.0,
    seed=3,
)
# several KV heads, each with several query heads (the released Llama heads' 32 / 8): a mix-up of
# the KV-head and group axes shows only here (the cases above have one KV head or no grouping)
CASE_COD_GROUPED = Case(
    "cod_hkv2_gqa2_d32_f32_sinks",
    "float32",
    hq=4,
    hkv=2,
    d=32,
    layouts=((40, 4, 0.7, 2, None), (30, 6, 0.6, 1, 0.8)),
    pad_extra=5,
    sinks=True,
    seed=7,
)
# DFlash blocks: context keys then bidirectional blocks, one padding block, 3 documents
CASE_BLOCK = Case("dflash_block_gqa2_d64_f32", "float32", hq=4, hkv=2, d=64, block=(70, 8, 6, 3), seed=11)
CASE_BLOCK_LONG = Case("dflash_block_gqa2_d64_f32_long", "float32", hq=4, hkv=2, d=64, block=(200, 16, 9, 3), seed=11)
CASE_CAUSAL = Case("causal_mha_d64_f32_cross", "float32", hq=2, hkv=2, d=64, causal=(40, 100, 2, (40, 10)), seed=5)
# TPU blocks are multiples of 128: longer rows so that there are several blocks
CASE_COD_F32_LONG = Case(
    "cod_gqa4_d64_f32_sinks_long",
    "float32",
    hq=4,
    hkv=1,
    d=64,
    layouts=((120, 4, 0.7, 2, None), (110, 8, 0.5, 1, 0.7)),
    pad_extra=7,
    sinks=True,
)
CASE_COD_BF16_LONG = Case(
    "cod_gqa8_d128_bf16_window_softcap_long",
    "bfloat16",
    hq=8,
    hkv=1,
    d=128,
    layouts=((120, 6, 0.8, 3, None),),
    pad_extra=3,
    window=40,
    softcap=20.0,
    seed=3,
)
CASE_CAUSAL_LONG = Case(
    "causal_mha_d64_f32_cross_long", "float32", hq=2, hkv=2, d=64, causal=(200, 300, 2, (200, 30)), seed=5
)


def assert_backend_matches_reference(case: Case, backend: str, *, tol=None, **kw):
    """Assert out/lse/grads within the dtype tolerance (or ``tol``); return the outputs."""
    errs, got = check_backend(case, backend, **kw)
    tol = tolerance(case) if tol is None else tol
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{backend} {case.name}: errors {bad} exceed {tol} (all: {errs})"
    return got


def assert_deterministic(case: Case, backend: str, *, interpret=False, block_q=None, block_k=None):
    """Two runs of the same jitted forward+backward are bit-equal."""
    q, k, v, spec, sinks = make_case(case)
    do, dlse = cotangents(q)
    f = fwd_bwd_fn(backend, interpret, block_q, block_k, sinks is not None)
    a = jax.tree_util.tree_leaves(f(q, k, v, spec, sinks, do, dlse))
    b = jax.tree_util.tree_leaves(f(q, k, v, spec, sinks, do, dlse))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
