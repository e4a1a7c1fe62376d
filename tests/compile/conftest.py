"""Compile-only tests: the accelerators' own compilers (XLA GPU with Triton and ptxas for an H100,
XLA TPU with Mosaic for a v5e), deviceless, from the `compile` extra (`make compile-venv`). The
whole folder is skipped where those compilers are not installed (the main venv is CPU-only)."""

from __future__ import annotations

import importlib.util

import pytest

from peagle_jax.hardware.devices import deviceless_env

if importlib.util.find_spec("libtpu") and importlib.util.find_spec("jax_plugins.xla_cuda12"):
    deviceless_env()  # only here: the main venv's tests keep their own platform
else:  # pragma: no cover - the CPU-only venv
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def topologies():
    """{platform: topology devices}: one H100 host of 8 GPUs, one v5e-8 slice."""
    from peagle_jax.hardware.devices import parse_device, topology_devices

    return {"cuda": topology_devices(parse_device("h100x8")), "tpu": topology_devices(parse_device("v5e-8"))}
