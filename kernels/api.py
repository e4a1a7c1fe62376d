"""`kernels.attention`: one entry point, several backends."""

from __future__ import annotations

import contextlib
import contextvars
import warnings

import jax
import jax.numpy as jnp

from . import _common as C
from . import chain as _chain
from . import dense as _dense
from . import reference as _reference
from .partition import local_rows, per_shard
from .schedule import DEFAULT_NUM_RANGES, build_schedule, pad_rows
from .spec import AttentionSpec

__all__ = ["attention", "resolve_backend", "platform", "for_platform", "fit_blocks", "DEFAULT_BLOCKS", "DENSE_MAX_ROWS"]

BACKENDS = ("auto", "xla", "gpu", "tpu", "dense", "reference")
# (block_q, block_k) defaults per backend. xla: a KV block of 512 keys makes each tile's products
# large enough for XLA CPU to spread over cores, for ~6% more visited pairs
# (docs/design/attention-kernels.md)
DEFAULT_BLOCKS = {"xla": (128, 512), "gpu": (64, 64), "tpu": (128, 128)}
# the most rows the callers that choose attend with one dense [rows, rows] mask (it compiles faster);
# beyond, the blockwise kernels (they skip masked blocks, and their memory grows with rows, not rows^2)
DENSE_MAX_ROWS = 512


PLATFORMS = ("cpu", "cuda", "gpu", "rocm", "tpu")
_PLATFORM = contextvars.ContextVar("kernels_platform", default=None)


def platform() -> str:
    """The platform programs are traced for: the one `for_platform` names, else JAX's default
    backend (what "auto" backends pick by)."""
    return _PLATFORM.get() or jax.default_backend()


@contextlib.contextmanager
def for_platform(name: str):
    """Trace for platform `name` ("cuda", "tpu", "cpu", ...) whatever this process runs on: the
    "auto" backends pick that platform's kernels, so `jit(f).trace(...).lower(lowering_platforms=
    (name,))` builds the program the accelerator would run."""
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {name!r}; expected one of {PLATFORMS}")
    token = _PLATFORM.set(name)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def resolve_backend(backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    name = platform()
    if name in ("gpu", "cuda"):
        return "gpu"
    if name == "tpu":
        return "tpu"
    return "xla"


def _check(q, k, v, spec: AttentionSpec, sinks):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects q [B,Tq,Hq,D], k/v [B,Tk,Hkv,D]; got {q.shape}, {k.shape}, {v.shape}")
    B, Tq, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k {k.shape} and v {v.shape} must both be [B={B}, Tk, Hkv, D={D}]")
    Hkv = k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv} (GQA)")
    if spec.q_anchor.shape != (B, Tq):
        raise ValueError(f"spec q metadata has shape {spec.q_anchor.shape}, expected {(B, Tq)}")
    if spec.kv_anchor.shape != (B, k.shape[1]):
        raise ValueError(f"spec kv metadata has shape {spec.kv_anchor.shape}, expected {(B, k.shape[1])}")
    if sinks is not None and jnp.shape(sinks) != (Hq,):
        raise ValueError(f"sinks must have shape ({Hq},), got {jnp.shape(sinks)}")


def attention(
    q,
    k,
    v,
    spec: AttentionSpec,
    *,
    sinks=None,
    backend: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    interpret=False,
    num_ranges: int = DEFAULT_NUM_RANGES,
):
    """Attention of q [B, Tq, Hq, D] over k, v [B, Tk, Hkv, D] under ``spec``'s rule.

    Returns out [B, Tq, Hq, D] in q.dtype, and lse [B, Hq, Tq] f32 when ``return_lse``.
    ``sinks`` [Hq]: per-head attention-sink logits (denominator only). ``backend``: "auto"
    (Pallas GPU on GPU, Pallas TPU on TPU, blockwise XLA elsewhere), "xla", "gpu", "tpu",
    "dense" (`kernels.dense`: one [Tq, Tk] mask, input-dtype products with f32 softmax; what the
    models use for decoding over a KV cache), "reference" (dense, f32 HIGHEST). ``block_q``/``block_k``: tile sizes (defaults in DEFAULT_BLOCKS;
    GPU: powers of two >= 16, TPU: multiples of 128; shortened for short sequences).
    ``interpret``: run the Pallas kernels interpreted on CPU: True (GPU: the Pallas
    interpreter; TPU: TPU interpret mode, ``pltpu.InterpretParams()``), "generic" (TPU: the
    faster plain Pallas interpreter) or an ``InterpretParams``; ignored by xla/reference.
    ``num_ranges``: KV-block ranges kept per query block by the schedule (see
    `kernels.schedule`). ``spec.chain_depth`` > 0: the blockwise backends gather each query's
    chain keys of depth 1..chain_depth outside the block loop and run the loop on the queries
    sorted by (doc, anchor, depth) (`kernels.chain`; same result). Differentiable in q, k, v (and sinks; also through lse).
    Fully masked rows give out 0 and lse -inf (the sink value with sinks). Rows need not be
    sorted; COD layouts sorted by (depth, anchor) make the block schedule tight. Sequences
    are padded to block multiples internally. The schedule is computed inside jit from
    ``spec`` (identical specs in one jit are CSE'd by XLA).
    """
    _check(q, k, v, spec, sinks)
    if sinks is not None:
        sinks = jnp.asarray(sinks)
    backend = resolve_backend(backend)
    if backend == "dense":
        out, lse = _dense.attention(
            q, k, v, spec.dense_mask(), scale=spec.resolved_scale(q.shape[-1]), softcap=spec.softcap, sinks=sinks
        )
        return (out, lse) if return_lse else out
    if backend == "reference":
        out, lse = _reference.attention(q, k, v, spec, sinks=sinks)
        return (out, lse) if return_lse else out
    # the blockwise kernels take one dtype (Triton refuses an f32 x bf16 product): promote as the
    # dense products do (a bf16 model's q and k leave RoPE in f32 while v stays bf16)
    q, k, v = (x.astype(jnp.result_type(q, k, v)) for x in (q, k, v))

    if spec.chain_depth:
        block_spec, idx, found = _chain.split(spec)
        block_spec, order, inverse = _chain.sort_queries(block_spec)
        out1, lse1 = attention(
            _chain.permute_rows(q, order, inverse),
            k,
            v,
            block_spec,
            sinks=sinks,
            backend=backend,
            block_q=block_q,
            block_k=block_k,
            return_lse=True,
            interpret=interpret,
            num_ranges=num_ranges,
        )
        out1 = _chain.permute_rows(out1, inverse, order)
        lse1 = jnp.moveaxis(_chain.permute_rows(jnp.moveaxis(lse1, 1, 2), inverse, order), 2, 1)
        scale = spec.resolved_scale(q.shape[-1])
        out2, lse2 = _chain.attention(q, k, v, idx, found, scale=scale, softcap=spec.softcap)
        out, lse = _chain.merge(out1, lse1, out2, lse2)
        out = out.astype(q.dtype)
        return (out, lse) if return_lse else out

    D = q.shape[-1]
    blocks = fit_blocks(
        backend,
        block_q,
        block_k,
        q.shape[1],
        k.shape[1],
        D,
        jnp.dtype(q.dtype).itemsize,
        local_rows(q.shape[0]),
        num_ranges,
    )
    if blocks is None:  # the device cannot hold the kernel's tiles: the blockwise XLA path instead
        warnings.warn(FALLBACK.format(backend=backend, D=D, dtype=q.dtype), stacklevel=2)
        backend, blocks = "xla", fit_blocks("xla", None, None, q.shape[1], k.shape[1], D, 4)
    bq, bk = blocks
    impl = _backend_module(backend)
    Tq = q.shape[1]

    cfg = C.KernelConfig(
        scale=spec.resolved_scale(D),
        softcap=spec.softcap,
        window=spec.sliding_window,
        block_q=bq,
        block_k=bk,
        interpret=_hashable_interpret(interpret),
    )
    metas = (spec.q_anchor, spec.q_depth, spec.q_doc, spec.kv_anchor, spec.kv_depth, spec.kv_doc)

    def blockwise(q, k, v, sinks, qa, qd, qc, ka, kd, kc):
        qm = (pad_rows(qa, bq, 0), pad_rows(qd, bq, 0), pad_rows(qc, bq, -1))
        km = (pad_rows(ka, bk, 0), pad_rows(kd, bk, 0), pad_rows(kc, bk, -1))
        sched = build_schedule(qm, km, bq, bk, spec.sliding_window, num_ranges)
        qp, kp, vp = C.pad_axis(q, 1, bq), C.pad_axis(k, 1, bk), C.pad_axis(v, 1, bk)
        out, lse = impl.op(cfg, qp, kp, vp, sinks, qm + km, sched)
        return out[:, :Tq], lse[:, :, :Tq]

    if backend == "xla":  # XLA partitions the blockwise loop itself
        out, lse = blockwise(q, k, v, sinks, *metas)
    else:
        layouts = ("bthd",) * 3 + ("h",) + ("bt",) * 6
        out, lse = per_shard(
            blockwise,
            (q, k, v, sinks, *metas),
            layouts,
            ("bthd", "bht"),
            batch=q.shape[0],
            heads=(q.shape[2], k.shape[2]),
        )
    return (out, lse) if return_lse else out


FALLBACK = (
    "kernels.attention: the Pallas {backend} kernel's tiles at head dim {D} ({dtype}) do not fit this device's "
    "limits (kernels.limits); using the blockwise XLA backend"
)


def fit_blocks(
    backend: str, block_q, block_k, Tq: int, Tk: int, head_dim: int, itemsize: int, rows=1, ranges=DEFAULT_NUM_RANGES
):
    """(block_q, block_k) of a blockwise backend for this shape on the device traced for
    (`kernels.limits`): the given sizes or DEFAULT_BLOCKS, shortened for short sequences and
    shrunk to the device's memory (TPU: grown for the SMEM of a long sequence's schedule over
    `rows` rows a device); None when the Pallas kernel cannot be served at all."""
    dq_, dk_ = DEFAULT_BLOCKS[backend]
    bq, bk = int(block_q or dq_), int(block_k or dk_)
    if backend == "xla":
        return min(bq, _ceil_to(Tq, 8)), min(bk, _ceil_to(Tk, 8))
    if backend == "tpu":
        return _backend_module(backend).fit_blocks(bq, bk, Tq, Tk, head_dim, itemsize, rows, ranges)
    return _backend_module(backend).fit_blocks(bq, bk, Tq, Tk, head_dim, itemsize)


def _backend_module(backend: str):
    if backend == "gpu":
        from . import gpu

        return gpu
    if backend == "tpu":
        from . import tpu

        return tpu
    from . import xla

    return xla


def _ceil_to(n, m):
    return -(-n // m) * m


def _hashable_interpret(interpret):
    try:
        hash(interpret)
        return interpret
    except TypeError:  # pragma: no cover - InterpretParams is a frozen dataclass
        raise ValueError(f"interpret must be hashable, got {interpret!r}") from None
