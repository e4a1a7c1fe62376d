"""Timing programs, one way everywhere (`infer bench`, `infer cost`, the report, bench/).

A call is timed to the end of its device work (`wall`: `jax.block_until_ready` on what it returns;
anything else, a float or a torch tensor, passes through). `timed` makes a program's first call
(its compilation, mostly) and then times `reps` calls; `side_by_side` does the same for several
programs in turn, call after call, so that machine noise hits all of them alike and their ratios
are measured side by side. `back_to_back` times calls issued without waiting (the device's
throughput). It imports JAX alone (the speculative round's own timers: `peagle_jax.engine.costs`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
    """A program's timed calls (seconds each) and its first call's seconds (None: made apart)."""

    times: tuple[float, ...]
    first_s: float | None = None

    @property
    def ms(self) -> float:
        """The median call, in ms."""
        return 1000 * statistics.median(self.times)

    @property
    def min_ms(self) -> float:
        """The fastest call (the least disturbed), in ms."""
        return 1000 * min(self.times)

    @property
    def compile_s(self) -> float:
        """The first call less a median one: its compilation, about (0 when the first was made apart)."""
        return 0.0 if self.first_s is None else max(self.first_s - self.ms / 1000, 0.0)


def wall(fn: Callable) -> tuple[float, object]:
    """(seconds, output) of one call of `fn`, to the end of its device work."""
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - t, out


def side_by_side(fns: dict[str, Callable], reps: int, first: bool = True) -> dict[str, Timing]:
    """{name: Timing} of `fns`: each called once (with `first`; without, the caller has made and
    timed those calls with `wall`), then `reps` rounds calling each in turn."""
    firsts = {name: wall(fn)[0] if first else None for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(wall(fn)[0])
    return {name: Timing(tuple(times[name]), firsts[name]) for name in fns}


def timed(fn: Callable, reps: int) -> Timing:
    """`fn` (returning device arrays) called once, then `reps` timed calls."""
    return side_by_side({"fn": fn}, reps)["fn"]


def back_to_back(fn: Callable, reps: int) -> Timing:
    """`fn` called once and once more to warm up, then `reps` calls issued without waiting for the
    device, timed as one: each of `times` is their mean."""
    first_s, _ = wall(fn)
    jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    jax.block_until_ready(out)
    return Timing(((time.perf_counter() - t) / reps,), first_s)
