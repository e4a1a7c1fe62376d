"""Every KV cache of the project, and the rule that sizes it.

A cache is a tuple over layers of (k, v), each [batch, length, num_kv_heads, head_dim], indexed
by position (a token at position p writes slot p; position -1 writes nothing). Targets and
drafters both describe their caches by a config with `num_layers`, `num_kv_heads`, `head_dim`.
Inside jit, caches are allocated from a `spec` (static, hashable), so a compiled function
owns its buffers. A DFlash head's cache has the same shape: per layer the context K/V of the
tokens the target has run (its blocks are never written), so it needs no more slots than the
target's. A DFlash head whose every layer slides keeps a ring instead (`drafter_length`): slot =
position mod its length.
"""

from __future__ import annotations

import jax.numpy as jnp

LENGTH_MULTIPLE = 64  # cache lengths are rounded up to this, so similar calls share a compile

CacheSpec = tuple  # per layer (dtype, shape): hashable, a jit static argument


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def spec(config, batch: int, length: int, dtype) -> CacheSpec:
    """The (dtype, shape) of every layer's k and v for a model config."""
    shape = (int(batch), int(length), config.num_kv_heads, config.head_dim)
    return tuple((jnp.dtype(dtype), shape) for _ in range(config.num_layers))


def allocate(cache_spec: CacheSpec | None) -> tuple | None:
    """Zero buffers for a spec (None stays None: no drafter)."""
    if cache_spec is None:
        return None
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for dtype, shape in cache_spec)


def init(config, batch: int, length: int, dtype=jnp.float32) -> tuple:
    """An empty cache for a model config."""
    return allocate(spec(config, batch, length, dtype))


def length_for(longest_prompt: int, max_new_tokens: int, k: int = 0) -> int:
    """Slots one generation call needs: the prompt, the new tokens, and one round's overshoot
    (a round writes K+1 target slots and up to 2K drafter slots past the last accepted token)."""
    return int(longest_prompt) + int(max_new_tokens) + 2 * int(k) + 2


def drafter_length(config, length: int, k: int) -> int:
    """Slots of a drafter's cache in calls whose caches hold `length` and whose rounds draft `k`.
    A DFlash head whose every layer slides (window W, `DrafterConfig.context_window`) reads only
    the W positions before a block's anchor p, and a round writes its verified slots, at most
    position p + k - 1: a ring of W + k slots holds p - W .. p - 1 with nothing newer written over
    them (`DFlashModel.write_context`). Rounded up to LENGTH_MULTIPLE, at most `length`."""
    window = getattr(config, "context_window", None)
    if window is None:
        return int(length)
    return min(int(length), round_up(window + int(k), LENGTH_MULTIPLE))


def bucket_length(longest_prompt: int, max_new_tokens: int, k: int = 0) -> int:
    """`length_for`, rounded up to LENGTH_MULTIPLE."""
    return round_up(length_for(longest_prompt, max_new_tokens, k), LENGTH_MULTIPLE)
