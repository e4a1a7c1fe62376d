"""The device limits the Pallas kernels are sized by, in one place: shared memory per block on a
GPU (what Triton's tiles must fit), scoped VMEM on a TPU (what Mosaic's blocks must fit).

The kernels read the limits of the device they are traced for: the one `on_device` names (the
deviceless compile of `peagle_jax.plan`, tests), else the first local device when it is of the
platform being traced for (its compute capability or TPU generation), else the platform's
default (an H100 / a TPU v5e). Each backend's `fit_blocks` shrinks its tiles until its estimate
fits; the estimates are checked by the CUDA and TPU compilers (tests/compile/).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

__all__ = ["Limits", "GPU_SMEM_BY_CC", "TPU_VMEM", "GPU_NAMES", "on_device", "current", "resolve", "device_name"]

MiB = 1 << 20

# opt-in shared memory per block (bytes) by CUDA compute capability
GPU_SMEM_BY_CC = {
    (8, 0): 166_912,  # A100
    (8, 6): 101_376,  # A10, RTX 30xx
    (8, 9): 101_376,  # L4, L40S, RTX 40xx
    (9, 0): 232_448,  # H100, H200, GH200
    (10, 0): 232_448,  # B200
    (12, 0): 101_376,  # RTX 50xx
}
# GPU names -> compute capability
GPU_NAMES = {"a100": (8, 0), "a10": (8, 6), "l4": (8, 9), "h100": (9, 0), "h200": (9, 0), "b200": (10, 0)}
# scoped VMEM (bytes) Mosaic gives a kernel by default, by TPU generation
TPU_VMEM = {"v4": 16 * MiB, "v5e": 16 * MiB, "v5p": 16 * MiB, "v6e": 32 * MiB}
_TPU_KINDS = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5p": "v5p",
    "TPU v5": "v5p",
    "TPU v6 lite": "v6e",
}
DEFAULT = {"gpu": "h100", "tpu": "v5e"}


@dataclasses.dataclass(frozen=True)
class Limits:
    name: str  # "h100", "v5e", ...
    smem_per_block: int | None = None  # GPU: opt-in shared memory per block, bytes
    vmem_bytes: int | None = None  # TPU: scoped VMEM per kernel, bytes


_DEVICE = contextvars.ContextVar("kernels_device", default=None)


def resolve(name: str) -> Limits:
    """The limits of a device named as in GPU_NAMES / TPU_VMEM, or a compute capability "9.0"."""
    key = name.lower()
    if key in TPU_VMEM:
        return Limits(key, vmem_bytes=TPU_VMEM[key])
    cc = GPU_NAMES.get(key)
    if cc is None and key.replace(".", "").isdigit() and "." in key:
        cc = tuple(int(x) for x in key.split(".")[:2])
    if cc is None or cc not in GPU_SMEM_BY_CC:
        known = sorted([*GPU_NAMES, *TPU_VMEM])
        raise ValueError(f"unknown device {name!r}: expected one of {known} or a known compute capability")
    return Limits(key, smem_per_block=GPU_SMEM_BY_CC[cc])


@contextlib.contextmanager
def on_device(name: str):
    """Size the kernels traced inside for device `name` ("h100", "v5e", "9.0", ...)."""
    token = _DEVICE.set(resolve(name))
    try:
        yield
    finally:
        _DEVICE.reset(token)


def _local(platform: str) -> Limits | None:
    """The limits of this process's first device, when it is a `platform` device we know."""
    try:
        dev = jax.local_devices()[0]
    except RuntimeError:  # pragma: no cover - no backend at all
        return None
    if platform == "gpu" and dev.platform == "gpu":
        cc = getattr(dev, "compute_capability", None)
        return resolve(cc) if cc and tuple(int(x) for x in cc.split(".")[:2]) in GPU_SMEM_BY_CC else None
    if platform == "tpu" and dev.platform == "tpu":
        kind = _TPU_KINDS.get(dev.device_kind)
        return resolve(kind) if kind else None
    return None


def device_name(device) -> str | None:
    """The name ("h100", "v5e", ...) of a jax device, when it is one of the devices named here."""
    if device.platform == "tpu":
        return _TPU_KINDS.get(device.device_kind)
    kind = device.device_kind.lower()
    return next((n for n in sorted(GPU_NAMES, key=len, reverse=True) if n in kind), None)


def current(platform: str) -> Limits:
    """The limits kernels traced now for `platform` ("gpu" or "tpu") are sized by."""
    chosen = _DEVICE.get()
    if chosen is not None and (chosen.smem_per_block if platform == "gpu" else chosen.vmem_bytes):
        return chosen
    return _local(platform) or resolve(DEFAULT[platform])
