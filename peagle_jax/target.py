"""The target model handle: load a Hugging Face folder, run it functionally, generate greedily.

```python
target = pj.load_target(path, dtype="bfloat16", aux_layer_ids=None)
out = target.forward(input_ids)            # logits [B,T,V] f32, aux_hidden [B,T,3H], hidden [B,T,H]
cache = target.init_cache(batch, max_len)  # per layer (k, v) [B, S, Hkv, D] in the target dtype
out = target.apply(tokens, positions, cache, logits_at=None)  # jitted, cache donated
```
Pure functions for use inside `jax.jit` (the speculative engine): `target_apply` (one
forward over any number of tokens: prefill, a K+1-token verification, one decode step),
`prefill` and `decode_loop` (the two halves of `generate_greedy`).

Positions convention: the cache index of a token is its position; position -1 marks a
padding slot (its K/V is not written, its outputs are meaningless). Rows of a batch may be
at different lengths.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from peagle_jax.config import TargetConfig
from peagle_jax.models.decoder import DecoderOutput, init_cache
from peagle_jax.sharding import shard_state
from peagle_jax.weights import WeightsError, export_target, load_params, resolve_dtype

__all__ = [
    "Target",
    "load_target",
    "target_apply",
    "prefill",
    "decode_loop",
    "generate_greedy",
    "validate_aux_layer_ids",
    "DecoderOutput",
]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


# ---------------------------------------------------------------------------------------
# pure functions
def target_apply(
    graphdef,
    state,
    tokens: jax.Array,
    positions: jax.Array,
    cache: tuple | None = None,
    *,
    aux_layer_ids: tuple[int, ...] = (),
    logits_at: jax.Array | None = None,
    compute_logits: bool = True,
) -> DecoderOutput:
    """One forward of the target over tokens [B, T] at positions [B, T] (-1 = padding).

    `cache` (per layer (k, v) [B, S, Hkv, D]) is written at the positions and read whole;
    None attends within this call only. `logits_at` [B, n] selects the rows that get
    logits. Returns DecoderOutput(logits f32, aux_hidden [B, T, 3H], hidden [B, T, H], cache).
    Pure: call it inside `jax.jit` with `graphdef` static.
    """
    model = nnx.merge(graphdef, state)
    return model(
        tokens,
        positions,
        cache,
        aux_layer_ids=tuple(aux_layer_ids),
        logits_at=logits_at,
        compute_logits=compute_logits,
    )


_apply_jit = jax.jit(
    target_apply,
    static_argnums=(0,),
    static_argnames=("aux_layer_ids", "compute_logits"),
    donate_argnames=("cache",),
)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("aux_layer_ids",))
def _forward_jit(graphdef, state, tokens, *, aux_layer_ids):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return target_apply(graphdef, state, tokens, positions, None, aux_layer_ids=aux_layer_ids)


def _prefill(graphdef, state, tokens, lengths, cache):
    """Right-padded prompts tokens [B, T] with per-row `lengths` [B] -> (next-token logits
    [B, V] at each row's last prompt token, filled cache)."""
    t = tokens.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)[None, :]
    positions = jnp.where(idx < lengths[:, None], idx, -1)
    out = target_apply(graphdef, state, tokens, positions, cache, logits_at=(lengths - 1)[:, None])
    return out.logits[:, 0], out.cache


prefill = jax.jit(_prefill, static_argnums=(0,), donate_argnames=("cache",))


def _decode_loop(graphdef, state, cache, first, lengths, eos_ids, *, max_new_tokens: int):
    """Greedy decode on a static cache after `prefill`.

    first [B]: the token chosen from the prefill logits (it sits at position lengths[b]);
    eos_ids [E] (E may be 0). Returns tokens [B, max_new_tokens] (first included), -1
    after a row's EOS, plus the cache. A `lax.while_loop` that stops when every row is done.
    """
    b = first.shape[0]
    out = jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)

    def is_eos(tok):
        return jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)

    def cond(carry):
        i, _, _, done, _, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, tok, pos, done, cache, out = carry
        res = target_apply(graphdef, state, tok[:, None], jnp.where(done, -1, pos)[:, None], cache)
        nxt = jnp.argmax(res.logits[:, 0], axis=-1).astype(jnp.int32)
        nxt = jnp.where(done, -1, nxt)
        out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
        return i + 1, nxt, pos + 1, done | is_eos(nxt), res.cache, out

    carry = (jnp.int32(1), first.astype(jnp.int32), lengths.astype(jnp.int32), is_eos(first), cache, out)
    _, _, _, _, cache, out = jax.lax.while_loop(cond, body, carry)
    return out, cache


decode_loop = jax.jit(
    _decode_loop, static_argnums=(0,), static_argnames=("max_new_tokens",), donate_argnames=("cache",)
)


# ---------------------------------------------------------------------------------------
# the handle
def validate_aux_layer_ids(ids, num_layers: int, where: str = "aux_layer_ids") -> tuple[int, int, int]:
    """3 distinct ints in [0, num_layers) (vLLM convention: the residual stream entering layer i)."""
    try:
        ids = tuple(ids)
    except TypeError:
        raise ValueError(f"{where}: expected 3 layer ids, got {ids!r}") from None
    ok = (
        len(ids) == 3
        and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids)
        and len(set(int(i) for i in ids)) == 3
        and all(0 <= int(i) < num_layers for i in ids)
    )
    if not ok:
        raise ValueError(
            f"{where}: expected 3 distinct ints in [0, {num_layers}) for a {num_layers}-layer target, got {ids!r}"
        )
    return tuple(int(i) for i in ids)


class Target:
    """A loaded target model: config, NNX graphdef + params state, jitted entry points."""

    def __init__(
        self,
        config: TargetConfig,
        graphdef,
        state,
        *,
        aux_layer_ids: Sequence[int] | None = None,
        path: str | os.PathLike | None = None,
    ):
        self.config = config
        self.graphdef = graphdef
        self.state = state
        self.aux_layer_ids = validate_aux_layer_ids(
            config.default_aux_layer_ids() if aux_layer_ids is None else aux_layer_ids, config.num_layers
        )
        self.path = None if path is None else Path(path)
        leaves = jax.tree.leaves(state)
        self.dtype = leaves[0].dtype if leaves else jnp.dtype(jnp.float32)
        self._tokenizer = None
        self._tokenizer_loaded = False
        self.mesh = None  # set by load_target(mesh=...)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Target({c.model_type}, layers={c.num_layers}, hidden={c.hidden_size}, vocab={c.vocab_size}, "
            f"dtype={self.dtype}, aux_layer_ids={self.aux_layer_ids}, path={str(self.path)!r})"
        )

    @property
    def model(self):
        """The NNX Decoder (merged on demand; the state is shared, not copied)."""
        return nnx.merge(self.graphdef, self.state)

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state))

    @property
    def param_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.state))

    @property
    def tokenizer(self):
        """transformers AutoTokenizer of the folder, or None when it has no tokenizer files."""
        if not self._tokenizer_loaded:
            self._tokenizer_loaded = True
            if self.path is not None and any(
                (self.path / f).exists() for f in ("tokenizer.json", "tokenizer.model")
            ):
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        return self._tokenizer

    def _check_tokens(self, tokens, name="input_ids") -> np.ndarray | jax.Array:
        if isinstance(tokens, jax.Array):
            arr = tokens
        else:
            arr = np.asarray(tokens)
        if arr.ndim != 2 or not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name}: expected an int array [batch, tokens], got shape {arr.shape} {arr.dtype}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.config.vocab_size):
            raise ValueError(f"{name}: token ids must lie in [0, {self.config.vocab_size})")
        return arr

    def forward(self, input_ids) -> DecoderOutput:
        """Full forward without a cache: int [B, T] -> logits [B, T, V] (f32), aux_hidden
        [B, T, 3H], hidden [B, T, H] (cache None). Jitted; recompiles per shape."""
        tokens = jnp.asarray(self._check_tokens(input_ids), jnp.int32)
        return _forward_jit(self.graphdef, self.state, tokens, aux_layer_ids=self.aux_layer_ids)

    def apply(self, tokens, positions, cache=None, *, logits_at=None, compute_logits=True) -> DecoderOutput:
        """`target_apply` jitted with this target's aux ids; the cache buffers are donated.

        Raises ValueError when a position does not fit the cache (it would be dropped)."""
        if cache is not None:
            try:
                concrete = np.asarray(positions)
            except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
                concrete = None  # traced (called inside jit): not checked
            size = cache[0][0].shape[1]
            top = int(concrete.max()) if concrete is not None and concrete.size else -1
            if top >= size:
                raise ValueError(f"positions: position {top} does not fit a KV cache of {size} slots")
        return _apply_jit(
            self.graphdef,
            self.state,
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(positions, jnp.int32),
            cache,
            aux_layer_ids=self.aux_layer_ids,
            logits_at=None if logits_at is None else jnp.asarray(logits_at, jnp.int32),
            compute_logits=compute_logits,
        )

    def init_cache(self, batch: int, max_len: int, dtype=None) -> tuple:
        """Empty KV cache: per layer (k, v), each [batch, max_len, Hkv, D], in the target dtype."""
        return init_cache(self.config, batch, max_len, self.dtype if dtype is None else dtype)

    def generate(self, prompt_ids, max_new_tokens: int, eos=None) -> list[list[int]]:
        return generate_greedy(self, prompt_ids, max_new_tokens, eos=eos)

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Exports a Hugging Face folder (config.json + model.safetensors, plus the source
        folder's tokenizer files when it has them)."""
        extra = []
        if self.path is not None:
            extra = [self.path / f for f in TOKENIZER_FILES if (self.path / f).exists()]
        return export_target(self.config, self.state, path, overwrite=overwrite, extra_files=extra)


def load_target(path: str | os.PathLike, dtype="bfloat16", aux_layer_ids: Sequence[int] | None = None,
                mesh=None) -> Target:
    """Loads a Hugging Face folder (config.json + safetensors) as a `Target`.

    mesh: a (data, fsdp, tensor) `jax.sharding.Mesh` (see `peagle_jax.sharding.make_mesh`):
    the weights are placed on it by the sharding rule table (tensor parallel over `tensor`);
    the jitted entry points and the speculative engine then run sharded, unchanged.

    dtype: "bfloat16" or "float32" (params, activations and KV cache; norms and softmax run
    in f32, logits are f32). aux_layer_ids: 3 distinct layer ids, default (2, L//2, L-3).
    Raises ConfigError / WeightsError (ValueErrors naming the file and key).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise WeightsError(f"{folder}: no such folder")
    cfg = TargetConfig.from_hf(folder)
    # fail before reading any weight
    validate_aux_layer_ids(cfg.default_aux_layer_ids() if aux_layer_ids is None else aux_layer_ids, cfg.num_layers)
    graphdef, state = load_params(folder, cfg, resolve_dtype(dtype))
    if mesh is not None:
        state = shard_state(state, mesh)
    target = Target(cfg, graphdef, state, aux_layer_ids=aux_layer_ids, path=folder)
    target.mesh = mesh
    return target


# ---------------------------------------------------------------------------------------
# greedy generation
def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_prompts(prompt_ids: Sequence[Sequence[int]], vocab_size: int, bucket: int = 16):
    """Right-padded int32 tokens [B, T_bucket] (pad id 0) and lengths [B]."""
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        prompt_ids = np.asarray(prompt_ids).tolist()
    prompts = [list(map(int, p)) for p in prompt_ids]
    if not prompts:
        raise ValueError("prompt_ids: no prompts")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt_ids[{i}]: empty prompt")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt_ids[{i}]: token ids must lie in [0, {vocab_size})")
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), _round_up(int(lengths.max()), bucket)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def _eos_array(eos_ids) -> jax.Array:
    """EOS ids padded to a multiple of 4 with -2 (never a token), so they do not retrace."""
    ids = [int(e) for e in eos_ids]
    return jnp.asarray(ids + [-2] * (_round_up(max(len(ids), 1), 4) - len(ids)), jnp.int32)


def generate_greedy(
    target: Target,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos: int | Sequence[int] | None = None,
    *,
    cache_len: int | None = None,
) -> list[list[int]]:
    """Greedy continuation of each prompt: a jitted prefill (right padding, per-row lengths)
    then a jitted `lax.while_loop` decode on a static cache, stopping per row at EOS.
    The cache holds max prompt length + max_new_tokens - 1 slots, rounded up to 32 (or
    `cache_len`); prompts are padded to a multiple of 16, so similar calls reuse compilations.

    eos: token id(s) ending a row (kept in its output); None = the config's eos_token_id,
    () = never stop early. Returns the new tokens of each prompt (prompt not included).
    """
    if max_new_tokens < 1:
        return [[] for _ in prompt_ids]
    cfg = target.config
    eos_ids = cfg.eos_token_id if eos is None else ((eos,) if isinstance(eos, (int, np.integer)) else tuple(eos))
    tokens, lengths = pad_prompts(prompt_ids, cfg.vocab_size)
    need = int(lengths.max()) + max_new_tokens - 1  # the last new token is never fed back
    size = _round_up(need, 32) if cache_len is None else cache_len
    if size < need:
        raise ValueError(
            f"cache_len {size} is too small for prompts of {int(lengths.max())} + {max_new_tokens} tokens"
        )
    cache = target.init_cache(tokens.shape[0], size)
    logits, cache = prefill(target.graphdef, target.state, jnp.asarray(tokens), jnp.asarray(lengths), cache)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out, _ = decode_loop(
        target.graphdef,
        target.state,
        cache,
        first,
        jnp.asarray(lengths),
        _eos_array(eos_ids),
        max_new_tokens=max_new_tokens,
    )
    return [[int(t) for t in row if t >= 0] for row in np.asarray(out)]  # -1 = after the row's EOS
