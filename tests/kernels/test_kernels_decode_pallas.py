"""Pallas decode kernels (`kernels.decode_gpu`: Triton, `kernels.decode_tpu`: Mosaic) on CPU:
interpret mode against `kernels.decode`'s XLA path and the dense reference, per-row block
reads checked by NaN-poisoning every cache slot outside a row's blocks, the backend dispatch,
and the Pallas -> Triton / Mosaic lowerings (no GPU or TPU needed; nothing here compiles or runs
the lowered kernels)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels import AttentionSpec, decode, decode_gpu, decode_tpu, reference

S = 300  # not a multiple of the gpu block (32: the last block is clamped) nor of 128 (tpu pads)
SCALE = 0.25
# ragged rows: short (with a padding slot), long, all padding
POS = {
    5: [[3, 4, 5, 6, -1], [250, 251, 252, 253, 299], [-1] * 5],
    1: [[7], [299], [-1]],
    18: [[*range(3, 20), -1], list(range(282, 300)), [-1] * 18],  # a K=8 verification step
}
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
BLOCK = {"gpu": 32, "tpu": 128}
INTERPRET = {"gpu": True, "tpu": "generic"}


def _case(t, hq, hkv, d, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (3, t, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (3, S, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (3, S, hkv, d), jnp.float32).astype(dtype)
    sinks = jax.random.normal(ks[3], (hq,), jnp.float32)
    return q, k, v, jnp.asarray(POS[t], jnp.int32), sinks


@functools.partial(jax.jit, static_argnames=("window", "softcap"))
def _reference(q, k, v, q_pos, window, softcap, sinks):
    spec = AttentionSpec.causal(
        q_pos,
        jnp.broadcast_to(jnp.arange(k.shape[1]), k.shape[:2]),
        q_valid=q_pos >= 0,
        sliding_window=window,
        softcap=softcap,
        scale=SCALE,
    )
    f32 = jnp.float32
    return reference.attention(q.astype(f32), k.astype(f32), v.astype(f32), spec, sinks=sinks)[0]


@functools.partial(jax.jit, static_argnames=("window", "softcap", "block"))
def _xla(q, k, v, q_pos, window, softcap, sinks, block=None):
    return decode.attention(
        q, k, v, q_pos, scale=SCALE, backend="xla", block=block, window=window, softcap=softcap, sinks=sinks
    )


def _close(got, want, dtype, tol=None):
    tol = TOL[jnp.dtype(dtype).name] if tol is None else tol
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


def _run(backend, q, k, v, q_pos, native=False, **kw):
    interpret = False if native else INTERPRET[backend]
    return decode.attention(
        q, k, v, q_pos, scale=SCALE, backend=backend, block=BLOCK[backend], interpret=interpret, **kw
    )


def _check(backend, t, hq, hkv, d, dtype, window, softcap, with_sinks, native=False):
    q, k, v, q_pos, sinks = _case(t, hq, hkv, d, dtype)
    kw = dict(window=window, softcap=softcap, sinks=sinks if with_sinks else None)
    got = _run(backend, q, k, v, q_pos, native=native, **kw)
    assert got.shape == q.shape
    assert got.dtype == q.dtype
    xla = _xla(q, k, v, q_pos, block=16, **kw)
    tol = TOL["bfloat16"] if native else None  # natively: bf16 tolerances for every dtype
    _close(got, xla, dtype, tol)
    _close(got, _reference(q, k, v, q_pos, **kw), dtype, tol)
    g = np.asarray(got, np.float32)
    assert np.all(g[2] == 0)
    assert np.all(g[q_pos == -1] == 0)  # padding rows give 0
    return got


# fast matrix: GQA (Hq 4, Hkv 2), T 5 / 1, window + softcap + sinks in f32, bf16 plain; T 18
FAST = [
    pytest.param(5, 4, 2, 32, "float32", 70, 20.0, True, id="t5_gqa_f32_window_softcap_sinks"),
    pytest.param(1, 4, 2, 32, "bfloat16", None, None, False, id="t1_gqa_bf16"),
    # a K=8 verification step, 72 query rows per KV head: two row tiles of 64 on the gpu
    pytest.param(18, 8, 2, 32, "bfloat16", 70, None, True, id="t18_gqa4_bf16_window_sinks"),
]


@pytest.mark.parametrize("t, hq, hkv, d, dtype, window, softcap, with_sinks", FAST)
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_decode_kernel_interpret_matches_xla_and_reference(backend, t, hq, hkv, d, dtype, window, softcap, with_sinks):
    _check(backend, t, hq, hkv, d, dtype, window, softcap, with_sinks)


def _read_slots(backend, q_pos, window):
    """Per batch row, the cache slots the kernel may read: the blocks from the one holding the
    row's lowest visible key to the one holding its highest query position (gpu: the last block
    of a cache that is not a block multiple is read from S - block)."""
    bk = BLOCK[backend]
    s_pad = -(-S // 128) * 128 if backend == "tpu" else S
    read = np.zeros((len(q_pos), S), bool)
    for b, row in enumerate(np.asarray(q_pos)):
        valid = row[row >= 0]
        if not len(valid):
            continue
        lo = 0 if window is None else max(0, int(valid.min()) - window + 1)
        for i in range(lo // bk, int(valid.max()) // bk + 1):
            start = min(i * bk, s_pad - bk)
            read[b, start : min(start + bk, S)] = True
    return read


def _check_reads(backend, window, native=False):
    q, k, v, q_pos, sinks = _case(5, 4, 2, 32, jnp.float32)
    kw = dict(window=window, softcap=20.0, sinks=sinks)
    read = _read_slots(backend, q_pos, window)
    assert read[0].sum() < read[1].sum()
    assert not read[2].any()
    poison = jnp.asarray(~read)[:, :, None, None]
    clean = _run(backend, q, k, v, q_pos, native=native, **kw)
    got = _run(backend, q, jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v), q_pos, native=native, **kw)
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))
    xla = _xla(q, k, v, q_pos, **kw)
    _close(got, xla, jnp.float32, TOL["bfloat16"] if native else None)


@pytest.mark.parametrize("window", [70, None])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_decode_kernel_reads_only_each_rows_blocks(backend, window):
    """NaN in every slot (k and v) outside a row's own blocks: any read of one would make
    the output NaN (0 * NaN in p @ v; the XLA path, which reads the batch's widest range,
    fails this). The short row reads 1 block of the long row's 10 (gpu) / 1 of 3 (tpu; 2 of
    3 with the window), the padding row none."""
    _check_reads(backend, window)


def test_decode_dispatch():
    q, k, v, q_pos, _ = _case(1, 4, 2, 32, jnp.float32)
    auto = decode.attention(q, k, v, q_pos, scale=SCALE, block=16)  # CPU: the XLA path
    xla = decode.attention(q, k, v, q_pos, scale=SCALE, backend="xla", block=16)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))
    with pytest.raises(ValueError, match="backend"):
        decode.attention(q, k, v, q_pos, scale=SCALE, backend="dense")
    with pytest.raises(ValueError, match="power of two"):
        decode.attention(q, k, v, q_pos, scale=SCALE, backend="gpu", block=48, interpret=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        decode.attention(q, k, v, q_pos, scale=SCALE, backend="tpu", block=64, interpret="generic")


# Gemma-3-270M's attention (Hq 4, Hkv 1, D 256), bf16, a 2K+2 = 18-row verification step
_LOWER_SHAPES = dict(b=2, t=18, hq=4, hkv=1, d=256, s=4096)


def _lowered_text(fn, platform, b, t, hq, hkv, d, s, **kw):
    q = jax.ShapeDtypeStruct((b, t, hq, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((b, t), jnp.int32)
    sinks = jax.ShapeDtypeStruct((hq,), jnp.float32)
    f = jax.jit(lambda q, k, v, p, sk: fn(q, k, v, p, scale=d**-0.5, softcap=30.0, sinks=sk, window=512, **kw))
    return f.trace(q, k, k, pos, sinks).lower(lowering_platforms=(platform,)).as_text()


def test_decode_gpu_kernel_lowers_to_triton():
    assert _lowered_text(decode_gpu.attention, "cuda", **_LOWER_SHAPES).count("xla.gpu.triton") == 1
    shapes = dict(_LOWER_SHAPES, hkv=2, d=96, s=1000)  # D padded to 128, a cache not a block multiple
    assert _lowered_text(decode_gpu.attention, "cuda", **shapes).count("xla.gpu.triton") == 1


def test_decode_tpu_kernel_lowers_to_mosaic():
    assert _lowered_text(decode_tpu.attention, "tpu", **_LOWER_SHAPES).count("tpu_custom_call") == 1
    shapes = dict(_LOWER_SHAPES, t=1, hq=8, hkv=2, d=128, s=1000)
    assert _lowered_text(decode_tpu.attention, "tpu", **shapes).count("tpu_custom_call") == 1


# ---- the larger matrix (make test-slow) ---------------------------------------------------
SLOW = [
    pytest.param(5, 4, 2, 32, "bfloat16", 70, 20.0, True, id="t5_gqa_bf16_window_softcap_sinks"),
    pytest.param(1, 4, 2, 32, "float32", 7, None, True, id="t1_gqa_f32_small_window_sinks"),
    pytest.param(5, 4, 1, 64, "float32", None, 30.0, False, id="t5_mqa_d64_f32_softcap"),
    pytest.param(5, 2, 2, 128, "bfloat16", 70, None, False, id="t5_mha_d128_bf16_window"),
]


@pytest.mark.slow
@pytest.mark.parametrize("t, hq, hkv, d, dtype, window, softcap, with_sinks", SLOW)
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_decode_kernel_interpret_matrix(backend, t, hq, hkv, d, dtype, window, softcap, with_sinks):
    _check(backend, t, hq, hkv, d, dtype, window, softcap, with_sinks)


@pytest.mark.slow
def test_decode_tpu_static_grid():
    q, k, v, q_pos, sinks = _case(5, 4, 2, 32, jnp.bfloat16)
    kw = dict(scale=SCALE, window=70, softcap=20.0, sinks=sinks)
    got = decode_tpu.attention(q, k, v, q_pos, block=128, interpret="generic", dynamic_grid=False, **kw)
    _close(got, decode.attention(q, k, v, q_pos, backend="xla", **kw), jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 2, 7, 40])  # 40: more splits than blocks
def test_decode_gpu_splits(num_splits):
    q, k, v, q_pos, sinks = _case(5, 4, 2, 32, jnp.float32)
    kw = dict(scale=SCALE, window=70, softcap=20.0, sinks=sinks)
    got = decode_gpu.attention(q, k, v, q_pos, block=16, num_splits=num_splits, interpret=True, **kw)
    _close(got, decode.attention(q, k, v, q_pos, backend="xla", **kw), jnp.float32)


@pytest.mark.slow  # TPU interpret mode (simulated SMEM/VMEM, DMAs, scalar prefetch): ~4-8 s here
def test_decode_tpu_interpret_mode():
    q, k, v, q_pos, sinks = _case(5, 4, 2, 32, jnp.float32)
    kw = dict(scale=SCALE, window=70, softcap=20.0, sinks=sinks)
    with pltpu.force_tpu_interpret_mode():
        got = decode.attention(q, k, v, q_pos, backend="tpu", block=128, **kw)
    _close(got, decode.attention(q, k, v, q_pos, backend="xla", **kw), jnp.float32)


# ---- native runs on a GPU (deselected by default; python -m bench.gpu_check runs them) -------
def _need_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("t, hq, hkv, d, dtype, window, softcap, with_sinks", FAST + SLOW)
def test_decode_gpu_native_matches_xla_and_reference(t, hq, hkv, d, dtype, window, softcap, with_sinks):
    _need_gpu()
    _check("gpu", t, hq, hkv, d, dtype, window, softcap, with_sinks, native=True)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [70, None])
def test_decode_gpu_native_reads_only_each_rows_blocks(window):
    _need_gpu()
    _check_reads("gpu", window, native=True)


@pytest.mark.gpu
def test_decode_gpu_native_is_the_default_on_gpu():
    _need_gpu()
    q, k, v, q_pos, sinks = _case(5, 4, 2, 32, jnp.bfloat16)
    kw = dict(scale=SCALE, window=70, sinks=sinks)
    auto = decode.attention(q, k, v, q_pos, **kw)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(decode.attention(q, k, v, q_pos, backend="gpu", **kw)))
