"""Shared fixtures."""

import hf_tiny
import pytest
import xla_env


def pytest_configure(config):
    xla_env.configure()


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
