"""peagle_jax.runtime.timing, the one timer of `infer bench`, `infer cost`, the report and bench/: programs
called in turn, the first call apart, a call timed to the end of its device work, the median /
min / compile figures of a Timing, calls issued back to back, and an import that loads JAX alone
(the round timers are exercised by `infer cost` in tests/test_dummy.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax.runtime.timing import Timing, back_to_back, side_by_side, timed, wall


def test_side_by_side_calls_each_program_in_turn_after_its_first_call():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("plain", "head")}
    got = side_by_side(fns, reps=3)
    assert calls == ["plain", "head"] * 4  # the first calls, then 3 rounds of both in turn
    assert set(got) == {"plain", "head"}
    for t in got.values():
        assert len(t.times) == 3 and t.first_s is not None and min(t.times) >= 0


def test_side_by_side_without_first_calls_times_every_call():
    calls = []
    got = side_by_side({"a": lambda: calls.append("a")}, reps=2, first=False)
    assert calls == ["a", "a"] and len(got["a"].times) == 2
    assert got["a"].first_s is None and got["a"].compile_s == 0.0


def test_timing_figures():
    t = Timing((0.003, 0.001, 0.002), first_s=0.010)
    assert t.ms == pytest.approx(2.0) and t.min_ms == pytest.approx(1.0)
    assert t.compile_s == pytest.approx(0.008)  # the first call less a median one
    assert Timing((0.004,), first_s=0.001).compile_s == 0.0  # never negative


def test_wall_times_the_call_and_returns_its_output():
    seconds, out = wall(lambda: time.sleep(0.05) or "done")
    assert out == "done" and seconds >= 0.05
    x = jnp.arange(12.0).reshape(3, 4)
    seconds, out = wall(lambda: jax.jit(lambda a: a @ a.T)(x))
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) @ np.asarray(x).T)


def test_timed_is_the_first_call_then_reps_calls():
    calls = []
    t = timed(lambda: calls.append(1) or jnp.ones(3), reps=4)
    assert len(calls) == 5 and len(t.times) == 4 and t.ms > 0


def test_back_to_back_issues_every_call_and_times_their_mean():
    calls = []

    def call():
        calls.append(1)
        time.sleep(0.01)
        return jnp.zeros(2)

    t = back_to_back(call, reps=5)
    assert len(calls) == 2 + 5  # the first, one to warm up, the timed ones
    assert len(t.times) == 1 and t.times[0] >= 0.01 and t.first_s >= 0.01


def test_the_timers_import_jax_alone():
    code = "import sys, peagle_jax.runtime.timing; print('flax' in sys.modules, 'peagle_jax.engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
