"""`kernels.attention` forward and backward compiled by the CUDA compiler for an H100 and the TPU
compiler for a v5e at each family's head shapes (head dims 64 / 128 / 256; sliding window,
softcap, sinks), and partitioned over 8 devices of each. The H100 backward at head dim 256 asked
for 328,704 bytes of shared memory (232,448 available) before `kernels.limits` sized its blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import kernels
from kernels.limits import on_device

DEVICE = {"cuda": "h100", "tpu": "v5e"}
# (family, Hq, Hkv, head dim, window, softcap, sinks)
SHAPES = [
    ("gpt-oss", 64, 8, 64, 128, None, True),
    ("llama-qwen3", 32, 8, 128, None, None, False),
    ("gemma3", 4, 1, 256, 512, 30.0, False),
]
T = 1024


def grads(q, k, v, a, d, c, sinks, *, window, softcap):
    spec = kernels.AttentionSpec.peagle(a, d, c, sliding_window=window, softcap=softcap)

    def loss(q, k, v, sinks):
        return kernels.attention(q, k, v, spec, sinks=sinks).astype(jnp.float32).sum()

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)


def compiled(platform, devices, shape, dtype=jnp.bfloat16, batch=1, mesh_axes=None, tokens=T):
    _, hq, hkv, d, window, softcap, sinks = shape
    mesh = Mesh(devices, ("x",))
    row = NamedSharding(mesh, P(mesh_axes))
    sd = lambda s, t, sh=row: jax.ShapeDtypeStruct(s, t, sharding=sh)  # noqa: E731
    args = [sd((batch, tokens, hq, d), dtype), sd((batch, tokens, hkv, d), dtype), sd((batch, tokens, hkv, d), dtype)]
    args += [sd((batch, tokens), jnp.int32)] * 3 + [sd((hq,), jnp.float32, NamedSharding(mesh, P())) if sinks else None]
    fn = jax.jit(lambda *a: grads(*a, window=window, softcap=softcap))
    part = kernels.partitioned(mesh, batch=("x",)) if mesh_axes else _nothing()
    with kernels.for_platform(platform), on_device(DEVICE[platform]), part:
        lowered = fn.lower(*args)
        return lowered.as_text(), lowered.compile()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_attention_forward_and_backward_compile(topologies, platform, shape):
    text, exe = compiled(platform, topologies[platform][:1], shape)
    call = "xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert text.count(call) >= 3, "forward, dq and dkv kernels expected"
    assert exe.memory_analysis().temp_size_in_bytes >= 0


def test_head_dim_256_in_float32_compiles_on_the_h100(topologies):
    text, _ = compiled("cuda", topologies["cuda"][:1], SHAPES[2], dtype=jnp.float32)
    assert text.count("xla.gpu.triton") >= 3


def test_unfitted_blocks_are_what_the_compiler_refuses(topologies, monkeypatch):
    """The check can fail: the blocks `kernels.limits` replaces are refused by Triton."""
    from kernels import gpu

    assert gpu.fit_blocks(64, 64, T, T, 256, 2) == (32, 64)
    monkeypatch.setattr(gpu, "fit_blocks", lambda bq, bk, *a: (bq, bk))  # the tiles as asked, unfitted
    with pytest.raises(Exception, match="[Ss]hared memory size limit exceeded"):
        compiled("cuda", topologies["cuda"][:1], SHAPES[2])


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_partitioned_kernels_compile_on_8_devices(topologies, platform):
    text, exe = compiled(platform, topologies[platform], SHAPES[1], batch=8, mesh_axes="x")
    assert "sdy.manual_computation" in text or "shard_map" in text or "manual" in text
    assert exe.memory_analysis().argument_size_in_bytes > 0


@pytest.mark.slow  # ~20 s of the 2-core CI
def test_a_million_token_schedule_fits_the_tpu_smem(topologies, monkeypatch):
    """At 128-row blocks the scalar-prefetched schedule of a 1,048,576-token sequence outgrows a
    TPU core's SMEM (a v5p refused the dK/dV kernel of Gemma-3-270M's train step there):
    `fit_blocks` grows the blocks until it fits; sized by VMEM alone they are refused."""
    from kernels import tpu

    shape, tokens = ("one head", 1, 1, 128, None, None, False), 1 << 20
    assert tpu.fit_blocks(128, 128, tokens, tokens) == (256, 256)
    text, _ = compiled("tpu", topologies["tpu"][:1], shape, tokens=tokens)
    assert text.count("tpu_custom_call") >= 3
    monkeypatch.setattr(tpu, "SCHEDULE_SMEM", 1 << 30)  # the blocks as the VMEM alone sizes them
    with pytest.raises(Exception, match="smem"):
        compiled("tpu", topologies["tpu"][:1], shape, tokens=tokens)
