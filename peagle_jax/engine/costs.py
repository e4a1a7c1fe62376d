"""What a speculative round costs: the whole round, and its two parts as programs of their own
(the target verifying K + 1 tokens, the drafter's pass), timed on a decoder's state after a
batch of prompts (`infer cost`, `infer bench`, the report)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from peagle_jax.engine import speculative as sp
from peagle_jax.engine.generation import SpeculativeDecoder
from peagle_jax.runtime.timing import Timing, timed


@functools.partial(jax.jit, static_argnums=(0, 1))
def _draft_only(cfg, ddef, dstate, tokens, aux, positions, bonus_slot, cache):
    return sp.draft(cfg, nnx.merge(ddef, dstate), tokens, aux, positions, bonus_slot, cache)[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _verify_only(aux_layer_ids, tdef, tstate, tokens, positions, cache):
    out = nnx.merge(tdef, tstate)(tokens, positions, cache, aux_layer_ids=aux_layer_ids)
    return out.logits, out.aux_hidden


def _as_batch(prompts) -> list:
    """One prompt (ids or text) or a batch of them -> a batch."""
    return prompts if prompts and isinstance(prompts[0], (list, tuple)) else [prompts]


def round_timing(dec: SpeculativeDecoder, prompts, reps: int = 5) -> Timing:
    """One whole round (verify + accept + draft) after `prompts` (one prompt or a batch);
    in mode "none", one plain decode step."""
    _, _, state = dec.start(_as_batch(prompts), max_new_tokens=(reps + 2) * (dec.k + 1) + 8)
    box = [state]

    def step():
        box[0] = dec.engine.round(box[0])  # the state is donated: each call takes the last one
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
