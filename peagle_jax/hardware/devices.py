"""The devices a plan compiles for, in one place: NVIDIA GPUs as XLA target configs (what the CUDA
compiler is told about the device), TPU slices as topology names, and each one's memory.

Names: `h100`, `h200` (one GPU), `h100x8` (8 on a host), `h100x8x2` (8 per host, 2 hosts);
`v5e-8`, `v5p-8`, `v6e-8`, `v5e-256`, ... (TPU slices by core count, as Cloud TPU names them;
v5p counts 2 cores per chip). The GPUs' shared memory per block comes from `kernels.limits`, so the
compiler and the kernels' block sizes agree. Compiling needs `jax[cuda12]` or `jax[tpu]` installed
(the `compile` extra); no device."""

from __future__ import annotations

import dataclasses
import math
import os
import re

from kernels.limits import GPU_NAMES, GPU_SMEM_BY_CC

__all__ = ["Device", "parse_device", "topology_devices", "GPUS", "TPUS", "deviceless_env", "rates"]

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Gpu:
    description: str
    memory_bytes: int
    bandwidth: float  # bytes / s
    peak_flops: float  # dense bf16 FLOP / s (SXM)
    cores: int = 132
    l2_bytes: int = 50 * (1 << 20)
    clock_ghz: float = 1.98


GPUS = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", 80 * GiB, 3.35e12, 989.4e12),
    "h200": Gpu("NVIDIA H200", 141 * 10**9, 4.8e12, 989.4e12),
}
# TPU generation -> (chips per host in multi-host slices, HBM per chip, cores per chip in the slice
# name, bandwidth, the most chips of a one-host slice: Cloud TPU's v5e / v6e 8-chip machines
# (ct5lp-hightpu-8t, ct6e-standard-8t) hold a 2x4 slice on one host, dense bf16 FLOP / s per chip)
TPUS = {
    "v5e": (4, 16 * GiB, 1, 8.19e11, 8, 197e12),
    "v5p": (4, 95 * GiB, 2, 2.765e12, 4, 459e12),
    "v6e": (4, 32 * GiB, 1, 1.64e12, 8, 918e12),
}


@dataclasses.dataclass(frozen=True)
class Device:
    name: str  # as the user wrote it
    platform: str  # "cuda" | "tpu"
    kind: str  # "h100", "v5e", ...: the `kernels.limits` name
    count: int  # devices in all
    hosts: int
    memory_bytes: int  # per device
    bandwidth: float  # HBM bytes / s per device
    peak_flops: float  # dense bf16 FLOP / s per device
    topology: str  # get_topology_desc's topology name
    host_bounds: tuple[int, ...] | None = None  # libtpu's chips_per_host_bounds (None: its default, 2x2x1)

    def describe(self) -> str:
        where = f"{self.count} x {self.kind}" + (f" on {self.hosts} hosts" if self.hosts > 1 else "")
        return f"{where}, {self.memory_bytes / GiB:.1f} GiB each"


def parse_device(name: str) -> Device:
    """A Device from its name (see the module doc); ValueError naming the accepted forms."""
    key = name.lower().strip()
    m = re.fullmatch(r"(h100|h200)(?:x(\d+))?(?:x(\d+))?", key)
    if m:
        per_host, hosts = int(m.group(2) or 1), int(m.group(3) or 1)
        gpu = GPUS[m.group(1)]
        topo = f"{hosts}x1x{per_host}"
        return Device(
            name, "cuda", m.group(1), per_host * hosts, hosts, gpu.memory_bytes, gpu.bandwidth, gpu.peak_flops, topo
        )
    m = re.fullmatch(r"(v5e|v5p|v6e)-(\d+)", key)
    if m:
        gen, cores = m.group(1), int(m.group(2))
        per_host, hbm, per_chip, bw, one_host, peak = TPUS[gen]
        chips = cores // per_chip
        if chips < 4 or chips & (chips - 1) or cores % per_chip:
            raise ValueError(f"{name}: a {gen} slice of {cores} cores is not a power-of-two count of >= 4 chips")
        topo = _tpu_topology(gen, chips)
        if per_host < chips <= one_host:  # a one-host v5e / v6e 2D grid (libtpu's default bound is 2x2 a host)
            bounds = (*map(int, topo.split(":")[1].split("x")), 1)
            return Device(name, "tpu", gen, chips, 1, hbm, bw, peak, topo, bounds)
        return Device(name, "tpu", gen, chips, max(1, chips // per_host), hbm, bw, peak, topo)
    raise ValueError(
        f"unknown device {name!r}: expected h100, h200, h100x8, h200x8x2 (hosts), v5e-8, v5p-8, v6e-8, ..."
    )


def rates(name: str | None) -> Device | None:
    """One device of kind `name` ("h100", "v5e", ...: `kernels.limits.device_name`), for its
    memory, bandwidth and peak FLOP rate; None for a kind without published rates."""
    if name in GPUS:
        return parse_device(name)
    if name in TPUS:
        return dataclasses.replace(parse_device(f"{name}-{4 * TPUS[name][2]}"), count=1, hosts=1)
    return None


def _tpu_topology(gen: str, chips: int) -> str:
    """The chip grid of a slice: 2D for v5e / v6e (2x2, 2x4, 4x4, ...), 3D for v5p (2x2x1, 2x2x2, ...)."""
    if gen == "v5p":
        dims = [2, 2, 1]
        while math.prod(dims) < chips:
            dims[dims.index(min(dims))] *= 2
        return f"{gen}:{'x'.join(map(str, dims))}"
    a = 2 ** (int(math.log2(chips)) // 2)
    return f"{gen}:{a}x{chips // a}"


def gpu_target_config(kind: str) -> str:
    """The GpuTargetConfigProto text of a GPU: what XLA, Triton and ptxas compile for."""
    gpu, cc = GPUS[kind], GPU_NAMES[kind]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {GPU_SMEM_BY_CC[cc] + 1024}
  threads_per_core_limit: 2048
  core_count: {gpu.cores}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(gpu.bandwidth)}
  l2_cache_size: {gpu.l2_bytes}
  clock_rate_ghz: {gpu.clock_ghz}
  device_memory_size: {gpu.memory_bytes}
  shared_memory_per_block_optin: {GPU_SMEM_BY_CC[cc]}
  cuda_compute_capability {{ major: {cc[0]} minor: {cc[1]} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{gpu.description}"
"""


def deviceless_env() -> None:
    """The environment a deviceless compile needs, set before JAX starts a backend: the CPU as
    the only runtime, and no check of a CUDA installation's driver (there is no device)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: several processes may load it


def topology_devices(device: Device) -> list:
    """The (non-addressable) devices of `device`'s topology: shardings over them make `jit(...).lower`
    compile for that device. Raises RuntimeError naming the missing extra when the compiler is absent."""
    from jax.experimental import topologies

    try:
        if device.platform == "tpu":
            bounds = {} if device.host_bounds is None else {"chips_per_host_bounds": device.host_bounds}
            topo = topologies.get_topology_desc(platform="tpu", topology_name=device.topology, **bounds)
        else:
            cfg = gpu_target_config(device.kind)
            topo = topologies.get_topology_desc(device.kind, "cuda", target_config=cfg, topology=device.topology)
    except Exception as err:  # the plugin missing, or a topology it refuses
        extra = "jax[tpu]" if device.platform == "tpu" else "jax[cuda12]"
        raise RuntimeError(
            f"{device.name}: no deviceless {device.platform} compiler ({extra} installed?): {err}"
        ) from err
    return list(topo.devices)
