"""`Engine`: what a compiled speculative decoder is, in one object.

It owns the static settings (K, mode, aux ids, mesh, what the state records: `EngineConfig`),
the modules, the cache specs, the one rule of what fits (`fit`), the prompt buckets, and the
verbs over a `DecodeState`: `prefill` (prompts -> rows), `empty` (free rows), `insert` (rows
into a state), `step` (rounds), `run` (rounds until every row is done), `release`, `read` (the
tokens on the host). `SpeculativeDecoder.generate`, the server's `Slots`, `infer bench`,
`infer cost` and the plan all build on it. Per-request settings are data (`SamplingParams` ->
`Sampling` rows), so no setting of a request compiles anything.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.target_config import NUM_AUX, TargetConfig, validate_aux_layer_ids
from peagle_jax.engine import cache as kv
from peagle_jax.engine import speculative as sp
from peagle_jax.engine.sampling import STOP_WIDTH, SamplingParams, row_key, sampling_rows
from peagle_jax.runtime.sharding import shard_state

DEEP_K = ("error", "warn")


def check_int(name: str, value, minimum: int) -> int:
    """`value` as an int >= minimum; ValueError naming `name` for floats, bools, or smaller values."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class DepthError(ValueError):
    """k too deep for the KV cache: no call could hold one round (the CLIs make it a usage error)."""


def largest_k(positions: int) -> int:
    """The deepest k whose smallest call (a 1-token prompt, 1 new token) fits `positions` KV-cache
    slots: `kv.length_for(1, 1, k)` = 2k + 4 <= positions."""
    return (int(positions) - kv.length_for(1, 1)) // 2


def check_depth(k: int, cache_len: int | None, max_position_embeddings: int) -> None:
    """DepthError naming k and the cache length when even the smallest call cannot hold one round
    of k drafts: the KV cache is `cache_len` when fixed, and never sized for more than the
    target's context (`max_position_embeddings`)."""
    if cache_len is not None and cache_len < max_position_embeddings:
        limit, what = cache_len, f"the KV cache of cache_len={cache_len} positions"
    else:
        limit, what = max_position_embeddings, f"the target's max_position_embeddings={max_position_embeddings}"
    need = kv.length_for(1, 1, k)
    if need > limit:
        raise DepthError(
            f"k={k} does not fit {what}: one round writes k+1 target and up to 2k drafter cache slots past "
            f"the last token, so even a 1-token prompt and 1 new token need 2k+4={need} positions; "
            f"the largest k is {max(largest_k(limit), 0)}"
        )


def check_handles(target, drafter) -> None:
    """TypeError naming the argument when `target` is no Target (a `.config` TargetConfig) or
    `drafter` no Drafter (a `.config` DrafterConfig), e.g. a Target passed as the drafter."""
    if not isinstance(getattr(target, "config", None), TargetConfig):
        raise TypeError(f"target: expected a Target (peagle_jax.load_target), got {_shown(target)}")
    if drafter is not None and not isinstance(getattr(drafter, "config", None), DrafterConfig):
        raise TypeError(
            f"drafter: expected a Drafter (peagle_jax.load_drafter / new_drafter) or None, got {_shown(drafter)}"
        )


def _shown(x) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:80] + '...' if len(text) > 80 else text}"


def check_drafter(dcfg: DrafterConfig, tcfg: TargetConfig, mode: str, k: int, deep_k: str) -> None:
    """ValueError when the head cannot draft for this target in `mode` at depth k (deep_k "warn":
    a k past the trained depth only warns)."""
    if dcfg.target_hidden_size != tcfg.hidden_size:
        raise ValueError(f"drafter reads target hidden size {dcfg.target_hidden_size}, target has {tcfg.hidden_size}")
    if dcfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"drafter vocabulary {dcfg.vocab_size} != target vocabulary {tcfg.vocab_size}")
    dflash = dcfg.mode == "dflash"
    if dcfg.aux_layer_ids is not None:
        count = None if dflash else NUM_AUX  # a DFlash head reads one context layer per head layer
        validate_aux_layer_ids(dcfg.aux_layer_ids, tcfg.num_layers, "the drafter's aux_layer_ids", count=count)
    if dflash != (mode == "dflash"):
        raise ValueError(f"a {dcfg.mode!r} head cannot draft in mode {mode!r} (a DFlash head: mode 'dflash')")
    if dflash and k > dcfg.block_size - 1:
        raise ValueError(
            f"k={k} exceeds what this DFlash head drafts in one pass: block_size {dcfg.block_size} "
            f"gives at most k={dcfg.block_size - 1}"
        )
    if mode == "parallel" and dcfg.mask_token_id is None:
        raise ValueError("parallel drafting needs a drafter with a mask_token_id")
    if dcfg.k_train is not None and k > dcfg.k_train:
        msg = f"k={k} exceeds the drafter's trained depth k_train={dcfg.k_train}"
        if deep_k == "error":
            raise ValueError(msg + " (to run anyway: deep_k='warn' in Python, --deep-k warn on the command line)")
        warnings.warn(msg, stacklevel=4)


RECORD_FIELDS = ("k_train", "verifier", "target_model_type", "dummy_target")  # what a head records, not its network


def network_fields(config: DrafterConfig) -> list[str]:
    """The DrafterConfig fields that shape a head's network (the others only record its training)."""
    return [f.name for f in dataclasses.fields(config) if f.name not in RECORD_FIELDS]


def _abstract(state) -> bool:
    """Whether a state is shapes only (the plan's weights), not arrays."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))


def _param_dtype(state):
    """The floating dtype of a model's parameters (its KV caches use the same)."""
    return next(x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating))


def _rows_on_mesh(mesh, *arrays):
    """The arrays as device arrays, their rows split over the mesh as the state's rows are
    (`speculative.row_axes`: data x fsdp, when they divide them); else placed as jit places them."""
    axes = None if mesh is None else sp.row_axes(mesh, arrays[0].shape[0])
    if axes is not None:
        return tuple(jax.device_put(a, NamedSharding(mesh, P(axes))) for a in arrays)
    return tuple(jnp.asarray(a) for a in arrays)


@dataclasses.dataclass(frozen=True)
class Call:
    """One of the engine's programs and its arguments: the engine's verbs `run` it, the plan
    compiles the very same pair (`trace`)."""

    program: Callable
    args: tuple

    def run(self):
        return self.program(*self.args)

    def trace(self):
        return self.program.trace(*self.args)


@dataclasses.dataclass(frozen=True)
class Tokens:
    """What a state holds for each row, read to the host from `start` on (`Engine.read`)."""

    start: np.ndarray  # [B] the out position read from
    end: np.ndarray  # [B] out_len
    done: np.ndarray  # [B] bool
    tail: np.ndarray  # [B, width] the row's tokens from `start` on
    rounds: np.ndarray  # [B] rounds each row ran so far
    accepted: np.ndarray  # [B, K + 1] rounds of each row that accepted n drafts, so far
    logprobs: tuple | None  # (token [B, width], top_ids [B, width, n], top [B, width, n]) from `start` on

    def new(self, row: int) -> list[int]:
        return self.tail[row, : self.end[row] - self.start[row]].tolist()


class Engine:
    """Speculative decoding of `target` with `drafter` ("parallel" | "chain" | "dflash"), or plain
    decoding ("none", drafter unused); `mode` None: "dflash" for a DFlash head, else "parallel".

    k: drafts per round; DepthError when no call could hold one round of k drafts. `deep_k`:
    "error" or "warn" when k exceeds the head's trained depth. `eos_ids`: the ids that end a row
    (default: the target's, config.json + generation_config.json). `logprobs`: None, or how many
    top log-probabilities the state keeps per token (rows ask for up to that many); `penalties`:
    the state counts each row's tokens, so rows may ask for presence / frequency / repetition
    penalties. Aux layers: the head's `aux_layer_ids` (what it was trained on); a head that records
    none reads the target's default ids, as vLLM does.
    """

    def __init__(
        self,
        target,
        drafter=None,
        k: int = 7,
        mode: str | None = None,
        *,
        deep_k: str = "error",
        eos_ids: Sequence[int] | None = None,
        logprobs: int | None = None,
        penalties: bool = False,
    ):
        check_handles(target, drafter)
        if mode is None:
            mode = "dflash" if drafter is not None and drafter.config.mode == "dflash" else "parallel"
        if mode not in sp.MODES:
            raise ValueError(f"mode must be one of {sp.MODES}, got {mode!r}")
        if deep_k not in DEEP_K:
            raise ValueError(f"deep_k must be one of {DEEP_K}, got {deep_k!r}")
        tcfg = target.config
        mesh = getattr(target, "mesh", None)
        mesh = mesh if mesh is not None and mesh.size > 1 else None  # one device: nothing to partition
        k = 0 if mode == "none" else check_int("k", k, 1)
        aux, aux_from = tuple(target.aux_layer_ids), "target"
        if mode != "none":
            check_depth(k, None, tcfg.max_position_embeddings)  # before any compile
            if drafter is None:
                raise ValueError(f"mode {mode!r} needs a drafter")
            check_drafter(drafter.config, tcfg, mode, k, deep_k)
            if drafter.config.aux_layer_ids is not None:
                aux, aux_from = tuple(drafter.config.aux_layer_ids), "drafter"
            else:
                aux, aux_from = tuple(tcfg.default_aux_layer_ids()), "target default"
            if mesh is not None and not _abstract(drafter.state):  # beside the target: same devices, same rules
                drafter.state = shard_state(drafter.state, mesh)
        self.target, self.drafter = target, (drafter if mode != "none" else None)
        self.aux_layer_ids_from = aux_from
        self.config = sp.EngineConfig(k, mode, aux, mesh, logprobs, bool(penalties))
        default_eos = getattr(target, "eos_token_ids", tcfg.eos_token_id)  # config + generation_config
        self.eos_ids = tuple(int(t) for t in (default_eos if eos_ids is None else eos_ids))

    @property
    def k(self) -> int:
        return self.config.k

    @property
    def mode(self) -> str:
        return self.config.mode

    def with_records(self, logprobs: int | None, penalties: bool) -> Engine:
        """This engine keeping `logprobs` top log-probabilities and token counts as asked (a
        different state: other programs); itself when it already does."""
        if (logprobs, penalties) == (self.config.logprobs, self.config.penalties):
            return self
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, logprobs=logprobs, penalties=penalties)
        return other

    def with_drafter(self, drafter) -> Engine:
        """This engine drafting with `drafter`, a head of this one's network (the same shapes and
        settings: only its weights and what it records of its training may differ), so the
        compiled programs run it as they are: the new weights are an argument of the same
        programs. ValueError naming what differs otherwise."""
        old = self.drafter
        if old is None:
            raise ValueError("this engine drafts with no head (mode 'none')")
        check_handles(self.target, drafter)
        differ = [f for f in network_fields(old.config) if getattr(old.config, f) != getattr(drafter.config, f)]
        if differ:
            shown = ", ".join(f"{f} {getattr(old.config, f)!r} -> {getattr(drafter.config, f)!r}" for f in differ)
            raise ValueError(f"the new head's network differs from the one being served: {shown}")
        shapes = lambda state: jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), state)  # noqa: E731
        if shapes(drafter.state) != shapes(old.state):
            raise ValueError("the new head's weights do not have the served head's shapes and dtypes")
        state = drafter.state
        if self.config.mesh is not None:
            state = jax.device_put(state, jax.tree.map(lambda x: x.sharding, old.state))  # where the old weights are
        other = copy.copy(self)
        other.drafter = type(old)(old.config, old.graphdef, state, path=getattr(drafter, "path", None))
        return other

    # ---------------------------------------------------------------- shapes

    def modules(self) -> tuple:
        """(target graphdef, target state, drafter graphdef, drafter state): the programs'
        arguments (the drafter pair is None in mode "none")."""
        d = self.drafter
        t = self.target
        return t.graphdef, t.state, None if d is None else d.graphdef, None if d is None else d.state

    def cache_specs(self, batch: int, length: int) -> tuple:
        """(target, drafter) cache specs of `batch` rows of `length` positions, in the parameters'
        dtypes; the drafter's is None in mode "none"."""
        tspec = kv.spec(self.target.config, batch, length, _param_dtype(self.target.state))
        if self.drafter is None:
            return tspec, None
        dlen = kv.drafter_length(self.drafter.config, length, self.k)
        return tspec, kv.spec(self.drafter.config, batch, dlen, _param_dtype(self.drafter.state))

    def fit(self, prompt_len: int, length: int) -> int:
        """The most new tokens a prompt of `prompt_len` tokens may ask for in caches of `length`
        positions (the prompt, its new tokens and one round's overshoot) within the target's
        context; < 1: it does not fit."""
        room = length - kv.length_for(prompt_len, 0, self.k)
        return min(room, self.target.config.max_position_embeddings - prompt_len)

    def check_fit(self, prompt_len: int, max_new_tokens: int, length: int) -> None:
        """ValueError naming the bound when `max_new_tokens` after a prompt of `prompt_len` tokens
        do not fit caches of `length` positions or the target's context (`fit`)."""
        if kv.length_for(prompt_len, max_new_tokens, self.k) > length:
            raise ValueError(
                f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens + 2k={2 * self.k} "
                f"does not fit the KV cache of {length} positions"
            )
        limit = self.target.config.max_position_embeddings
        if prompt_len + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens exceeds the "
                f"target's max_position_embeddings={limit}"
            )

    @staticmethod
    def bucket(prompt_len: int, length: int, pad: int = kv.LENGTH_MULTIPLE) -> int:
        """The padded length a prompt is prefilled at (each bucket compiles once)."""
        return min(kv.round_up(prompt_len, pad), length)

    @staticmethod
    def buckets(length: int) -> list[int]:
        return list(range(kv.LENGTH_MULTIPLE, length + 1, kv.LENGTH_MULTIPLE))

    # ---------------------------------------------------------------- verbs

    def sampling(self, params: list[SamplingParams], rows: int, keys=None, stop_width=None, bias_width=None):
        """The rows' `Sampling` (`sampling.sampling_rows`) with this engine's eos ids; keys:
        one per params (default `row_key(p.seed, i)`)."""
        if keys is None:
            keys = [row_key(p.seed, i) for i, p in enumerate(params)]
        return sampling_rows(params, self.eos_ids, rows, keys, stop_width, bias_width)

    def prefill_call(self, prompts: list[list[int]], params: list[SamplingParams], length: int, *, rows=None,
                     pad=None, keys=None, stop_width=None, bias_width=None) -> Call:  # fmt: skip
        """`prefill`'s program and arguments (what the plan compiles)."""
        rows = rows or len(prompts)
        longest = max(len(p) for p in prompts)
        for ids, p in zip(prompts, params):
            self.check_fit(len(ids), p.max_tokens, length)
        prompt = np.zeros((rows, self.bucket(longest, length, pad or kv.LENGTH_MULTIPLE)), np.int32)
        lens, budget = np.zeros((rows,), np.int32), np.zeros((rows,), np.int32)
        for i, (ids, p) in enumerate(zip(prompts, params)):
            prompt[i, : len(ids)], lens[i], budget[i] = ids, len(ids), p.max_tokens
        prompt, lens, budget = _rows_on_mesh(self.config.mesh, prompt, lens, budget)
        sampling = self.sampling(params, rows, keys, stop_width, bias_width)
        tspec, dspec = self.cache_specs(rows, length)
        return Call(sp.jit_prefill, (self.config, *self.modules(), prompt, lens, budget, tspec, dspec, sampling))

    def prefill(self, prompts: list[list[int]], params: list[SamplingParams], length: int, **kw) -> sp.DecodeState:
        """`rows` rows (default: len(prompts)) of caches of `length` positions: each prompt's
        prefill, first token and drafts under its params; padding rows are done at once. Prompts
        are right-padded to `pad` (default LENGTH_MULTIPLE: one compile per bucket); `keys`,
        `stop_width`, `bias_width`: as `sampling`."""
        return self.prefill_call(prompts, params, length, **kw).run()

    def empty(self, batch: int, length: int, stop_width: int = STOP_WIDTH, bias_width: int = 0) -> sp.DecodeState:
        """`batch` free rows (done, nothing written) of caches of `length` positions."""
        sampling = self.sampling([], batch, [], stop_width, bias_width)
        vocab = self.target.config.vocab_size
        return _empty(self.config, *self.cache_specs(batch, length), vocab, sampling)

    def state_shardings(self, state: sp.DecodeState):
        """Where a state's arrays live on the target's mesh (`speculative.state_placement`: rows over
        `data`, each KV cache also by KV heads over `tensor`, where they divide); None: no mesh."""
        mesh = getattr(self.target, "mesh", None)  # a mesh of one device too: the plan's
        return None if mesh is None else sp.state_placement(mesh, state)

    def run_call(self, state: sp.DecodeState) -> Call:
        return Call(sp.jit_generate, (self.config, *self.modules(), state))

    def run(self, state: sp.DecodeState) -> sp.DecodeState:
        """Rounds until every row is done, in one device loop (the state is donated)."""
        return self.run_call(state).run()

    def round_call(self, state: sp.DecodeState) -> Call:
        return Call(sp.jit_round, (self.config, *self.modules(), state))

    def round(self, state: sp.DecodeState) -> sp.DecodeState:
        """One round over every row (the state is donated)."""
        return self.round_call(state).run()

    def step_call(self, state: sp.DecodeState, rounds: int = 1, rows: int | None = None) -> Call:
        mesh = self.config.mesh
        if mesh is not None and sp.row_axes(mesh, state.done.shape[0]) is not None:
            rows = None  # rows split over devices: the first rows would be gathered from them; each device runs its own
        return Call(sp.jit_rounds, (self.config, *self.modules(), state, rounds, rows))

    def step(self, state: sp.DecodeState, rounds: int = 1, rows: int | None = None) -> sp.DecodeState:
        """Up to `rounds` rounds, ending after one in which a row finished, over the first `rows`
        rows (None: all) when the others are free; over all of them when the rows are split over
        devices (each runs its own: the first rows lie on a few of them). The state is donated."""
        return self.step_call(state, rounds, rows).run()

    def insert_call(self, state: sp.DecodeState, part: sp.DecodeState, slots) -> Call:
        return Call(_insert, (state, part, jnp.asarray(slots, jnp.int32), self.config.mesh))

    def insert(self, state: sp.DecodeState, part: sp.DecodeState, slots) -> sp.DecodeState:
        """`state` with row slots[i] replaced by `part`'s row i (slots[i] >= len(state): row i is
        not inserted); the state is donated."""
        return self.insert_call(state, part, slots).run()

    def release(self, state: sp.DecodeState, rows: np.ndarray) -> sp.DecodeState:
        """`state` with the rows of the mask `rows` [B] done: they stop from the next round on."""
        return _release(state, jnp.asarray(rows), self.config.mesh)

    def extend_call(self, state: sp.DecodeState, rows, chunk: sp.Chunk, sampling) -> Call:
        """`extend`'s program and arguments: `chunk` (a piece of each row's prompt) into rows
        `rows` of `state` in place (the state is donated; an index past its last row: padding)."""
        return Call(sp.jit_extend, (self.config, *self.modules(), state, jnp.asarray(rows, jnp.int32), chunk, sampling))

    @staticmethod
    def read(state: sp.DecodeState, start: np.ndarray, width: int) -> Tokens:
        """Each row's tokens (and log-probabilities, when kept) from `start` on, `width` of them."""
        got = to_host(_read(state, jnp.asarray(start, jnp.int32), width))
        out_len, done, tail, rounds, accepted, logprobs = got
        return Tokens(np.asarray(start), out_len, done, tail, rounds, accepted, logprobs)


def to_host(tree):
    """numpy copies of a tree of arrays; rows that lie on other processes' devices (a mesh over
    several hosts) are gathered from them, every process taking part."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _empty(cfg: sp.EngineConfig, target_spec, drafter_spec, vocab: int, sampling) -> sp.DecodeState:
    return sp.placed(cfg.mesh, sp.empty_state(cfg, target_spec, drafter_spec, vocab, sampling))


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def _insert(state: sp.DecodeState, part: sp.DecodeState, slots, mesh) -> sp.DecodeState:
    whole = jax.tree.map(lambda whole, rows: whole.at[slots].set(rows.astype(whole.dtype), mode="drop"), state, part)
    return sp.placed(mesh, whole)


@functools.partial(jax.jit, static_argnums=(2,), donate_argnums=(0,))
def _release(state: sp.DecodeState, rows, mesh) -> sp.DecodeState:
    return sp.placed(mesh, state._replace(done=state.done | rows))


@functools.partial(jax.jit, static_argnums=(2,))
def _read(state: sp.DecodeState, start, width: int):
    index = jnp.minimum(start[:, None] + jnp.arange(width), state.out.shape[1] - 1)

    def tail(x):
        at = index.reshape(index.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, at, axis=1)

    logprobs = None if state.logprobs is None else jax.tree.map(tail, tuple(state.logprobs))
    return state.out_len, state.done, tail(state.out), state.rounds, state.accepted, logprobs
