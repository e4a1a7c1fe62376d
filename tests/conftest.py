"""Shared fixtures, the suite's XLA settings and its file order."""

import file_order
import hf_tiny
import pytest
import xla_env

FILE_SECONDS = file_order.FileSeconds()  # this run's, saved by the controller at the end
LAST_RUN = file_order.read()  # the last run's: the controller hands its copy to every worker


def pytest_configure(config):
    xla_env.configure()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["file_seconds"] = LAST_RUN  # one order for all workers, whatever runs beside


def pytest_collection_modifyitems(config, items):
    seconds = getattr(config, "workerinput", {}).get("file_seconds", LAST_RUN)
    items[:] = file_order.longest_first(items, seconds)


def pytest_runtest_logreport(report):
    FILE_SECONDS.add(report)


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the controller, or a run without workers
        FILE_SECONDS.save()


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
