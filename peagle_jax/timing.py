"""Timing programs, one way everywhere (`infer bench`, `infer cost`, the report, bench/).

A call is timed to the end of its device work (`wall`: `jax.block_until_ready` on what it returns;
anything else, a float or a torch tensor, passes through). `timed` makes a program's first call
(its compilation, mostly) and then times `reps` calls; `side_by_side` does the same for several
programs in turn, call after call, so that machine noise hits all of them alike and their ratios
are measured side by side. `back_to_back` times calls issued without waiting (the device's
throughput). `round_timing` and `round_breakdown` time the speculative round and its two parts;
they load the engine (and Flax) when called, so that the timers themselves import JAX alone.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # the engine loads when a round is timed: the timers need JAX alone
    from peagle_jax.engine import SpeculativeDecoder


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


@functools.partial(jax.jit, static_argnums=(0, 1))
def _draft_only(cfg, ddef, dstate, tokens, aux, positions, bonus_slot, cache):
    from flax import nnx

    from peagle_jax.engine import speculative as sp

    return sp.draft(cfg, nnx.merge(ddef, dstate), tokens, aux, positions, bonus_slot, cache)[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _verify_only(aux_layer_ids, tdef, tstate, tokens, positions, cache):
    from flax import nnx

    out = nnx.merge(tdef, tstate)(tokens, positions, cache, aux_layer_ids=aux_layer_ids)
    return out.logits, out.aux_hidden


def _as_batch(prompts) -> list:
    """One prompt (ids or text) or a batch of them -> a batch."""
    return prompts if prompts and isinstance(prompts[0], (list, tuple)) else [prompts]


def round_timing(dec: SpeculativeDecoder, prompts, reps: int = 5) -> Timing:
    """One whole round (verify + accept + draft) after `prompts` (one prompt or a batch);
    in mode "none", one plain decode step."""
    from peagle_jax.engine import speculative as sp

    cfg, _, state = dec.start(_as_batch(prompts), max_new_tokens=(reps + 2) * (dec.k + 1) + 8)
    mods = dec.modules()
    box = [state]

    def step():
        box[0] = sp.jit_round(cfg, *mods, box[0])  # the state is donated: each call takes the last one
        return box[0]

    return timed(step, reps)


def round_breakdown(dec: SpeculativeDecoder, prompts, reps: int = 5) -> dict:
    """Milliseconds per round of the drafter alone (half the drafts accepted) and of the
    target's verification of K+1 tokens alone, and each program's compile seconds, timed on
    the state after `prompts` (one prompt, or a batch of them)."""
    cfg, _, state = dec.start(_as_batch(prompts), max_new_tokens=8)
    tdef, tstate, ddef, dstate = dec.modules()
    k, b = dec.k, state.last.shape[0]
    slots = jnp.arange(k + 1)[None, :]
    positions = state.length[:, None] + slots
    tokens = jnp.concatenate([state.last[:, None], state.drafts], axis=1)
    verify = timed(lambda: _verify_only(cfg.aux_layer_ids, tdef, tstate, tokens, positions, state.target_cache), reps)
    result = {"target_ms_per_round": verify.ms, "target_compile_s": verify.compile_s}
    if dec.mode != "none":
        aux = jnp.zeros((b, k + 1, dec.drafter.config.fc_in), state.target_cache[0][0].dtype)  # the aux states it reads
        n = jnp.full((b,), k // 2, jnp.int32)
        draft_pos = jnp.where(slots <= n[:, None], positions, -1)
        draft = timed(lambda: _draft_only(cfg, ddef, dstate, tokens, aux, draft_pos, n, state.drafter_cache), reps)
        result.update(drafter_ms_per_round=draft.ms, drafter_compile_s=draft.compile_s)
    return result
