"""Shared fixtures."""

import hf_tiny
import pytest
import xla_env

from peagle_jax.runtime.host import collect_less_often


def pytest_configure(config):
    xla_env.configure()
    collect_less_often()  # as the commands do: the workers trace thousands of programs


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """kind -> (folder, torch model) of a tiny random HF model, built once per test module."""
    made = {}

    def get(kind):
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            made[kind] = (folder, hf_tiny.build(kind, folder))
        return made[kind]

    return get


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each module, JAX's in-memory caches of compiled programs are dropped: a worker runs
    dozens of modules, and kept they grew it past 6 GB (the next module that needs a program
    reads it back from the persistent cache)."""
    yield
    import sys

    if "jax" in sys.modules:
        import gc

        sys.modules["jax"].clear_caches()
        gc.collect()
