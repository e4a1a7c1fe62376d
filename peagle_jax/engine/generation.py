"""Generation on the speculative engine: `SpeculativeDecoder(target, drafter, k, mode)` and
`generate_greedy` (plain greedy decoding = the engine's mode "none").

Prompts (token ids, strings, or chat conversations) are tokenized with the target's
tokenizer (`peagle_jax.chat`), right-padded into a batch bucket, and decoded by the engine of
`peagle_jax.engine.speculative` in one device loop. Shapes are bucketed (batch to a power of two,
prompt and cache lengths to multiples of 64), so repeated calls reuse compiled code.
`infer` re-exports `SpeculativeDecoder` as the public inference API.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax import chat
from peagle_jax.config import NUM_AUX, TargetConfig, validate_aux_layer_ids
from peagle_jax.drafter_config import DrafterConfig
from peagle_jax.engine import cache as kv
from peagle_jax.engine import speculative as sp
from peagle_jax.sharding import ROLES, role_sharding, shard_state

Prompt = Sequence[int] | str | Sequence[dict]


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # the new tokens of each prompt
    stats: dict[str, Any]
    texts: list[str] | None = None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows_on_mesh(mesh, *arrays):
    """The arrays as device arrays, their rows split over the mesh's batch axes (data x fsdp, as the
    train step splits its batch) when those divide them; else placed as jit places them."""
    if mesh is not None:
        shards = math.prod(mesh.shape[a] for a in ROLES["batch"][0])
        if shards > 1 and arrays[0].shape[0] % shards == 0:
            return tuple(jax.device_put(a, role_sharding(mesh, "batch", a.ndim)) for a in arrays)
    return tuple(jnp.asarray(a) for a in arrays)


def _param_dtype(state):
    """The floating dtype of a model's parameters (its KV caches use the same)."""
    return next(x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating))


DEEP_K = ("error", "warn")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_int(name: str, value, minimum: int) -> int:
    """`value` as an int >= minimum; ValueError naming `name` for floats, bools, or smaller values."""
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


SEED_MAX = 2**63 - 1  # jax.random.key takes a C long (int64): larger seeds raise OverflowError
SEED_RANGE = "[0, 2**63 - 1]"


def check_seed(seed) -> int:
    """`seed` as an int in [0, SEED_MAX], what `jax.random.key` accepts; ValueError naming `seed`."""
    if not _is_int(seed) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed must be an integer in {SEED_RANGE} (what jax.random.key accepts), got {seed!r}")
    return int(seed)


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


def check_sampling(temperature, top_p) -> tuple[float, float]:
    """(temperature, top_p) as floats: temperature finite and >= 0 (0 = greedy), 0 < top_p <= 1."""
    try:
        t, p = float(temperature), float(top_p)
    except (TypeError, ValueError):
        raise ValueError(f"temperature and top_p must be numbers, got {temperature!r}, {top_p!r}") from None
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not math.isfinite(p) or not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return t, p


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


def _token_ids(prompt, where: str) -> list[int]:
    ids = np.asarray(prompt).tolist() if isinstance(prompt, (np.ndarray, jax.Array)) else list(prompt)
    bad = next((t for t in ids if not _is_int(t)), None)
    if bad is not None:
        raise ValueError(f"{where}: token ids must be integers, got {bad!r}")
    return [int(t) for t in ids]


def check_vocab(ids: Sequence[int], vocab: int, where: str) -> None:
    """ValueError naming `where`, the first id outside [0, vocab) and the vocabulary's size."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{where}: token id {bad} outside the target's vocabulary [0, {vocab})")


def prompt_tokens(tokenizer, prompt: Prompt, where: str = "prompt") -> list[int]:
    """Token ids of one prompt: ids (a list, or a 1-D NumPy / JAX array) pass through; strings
    and conversations go through `peagle_jax.chat.encode_prompt` (the chat template when
    the tokenizer has one)."""
    if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and len(prompt) and isinstance(prompt[0], dict)):
        if tokenizer is None:
            raise ValueError("a text prompt needs a target folder with a tokenizer; pass token ids instead")
        return chat.encode_prompt(tokenizer, prompt)
    return _token_ids(prompt, where)


def as_prompt_list(prompts) -> list:
    """A batch of prompts from: one string, one list / 1-D array of ids, one conversation, a
    2-D array of ids, or a list of any of these."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        arr = np.asarray(prompts)
        if arr.ndim not in (1, 2):
            raise ValueError(f"prompts: expected a 1-D or 2-D array of token ids, got shape {arr.shape}")
        return [arr] if arr.ndim == 1 else list(arr)
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and (_is_int(prompts[0]) or isinstance(prompts[0], dict)):
        return [prompts]  # one prompt: token ids or a conversation
    return prompts


class SpeculativeDecoder:
    """Speculative decoding of `target` with `drafter` ("parallel" | "chain" | "dflash"), or
    plain decoding ("none", drafter unused). `mode` None: "dflash" for a DFlash head (the only
    mode it drafts in), else "parallel".

    k: drafts per round (a DFlash head: 1 <= k <= block_size - 1, the first k of its block); DepthError (a ValueError) when no call could hold one round of k drafts
    in the KV cache (`check_depth`). `deep_k`: what to do when k exceeds the depth the drafter was
    trained for ("error" or "warn"). `cache_len`: fixed KV cache length (default: sized per
    call from the prompts and max_new_tokens). `prompt_pad`: prompts are right-padded to a
    multiple of it (a larger value = fewer compiles over varied prompts). `eos_ids`: tokens
    that end a row (default: the target config's eos_token_id).

    Aux layers: the drafter's `aux_layer_ids` decide (they are what it was trained on); a head
    that records none (a vLLM folder without the key) reads the target's default ids, as vLLM
    does. `res.stats["aux_layer_ids"]` and `["aux_layer_ids_from"]` say which were used.
    """

    def __init__(
        self,
        target,
        drafter=None,
        k: int = 7,
        mode: str | None = None,
        *,
        deep_k: str = "error",
        cache_len: int | None = None,
        prompt_pad: int = 64,
        eos_ids: Sequence[int] | None = None,
    ):
        check_handles(target, drafter)
        if mode is None:
            mode = "dflash" if drafter is not None and drafter.config.mode == "dflash" else "parallel"
        if mode not in sp.MODES:
            raise ValueError(f"mode must be one of {sp.MODES}, got {mode!r}")
        if deep_k not in DEEP_K:
            raise ValueError(f"deep_k must be one of {DEEP_K}, got {deep_k!r}")
        self.target, self.drafter, self.mode = target, drafter, mode
        self.k = 0 if mode == "none" else check_int("k", k, 1)
        self.cache_len = None if cache_len is None else check_int("cache_len", cache_len, 1)
        self.prompt_pad = check_int("prompt_pad", prompt_pad, 1)
        tcfg = target.config
        self.aux_layer_ids, self.aux_layer_ids_from = tuple(target.aux_layer_ids), "target"
        if mode != "none":
            check_depth(self.k, self.cache_len, tcfg.max_position_embeddings)  # before any compile
            if drafter is None:
                raise ValueError(f"mode {mode!r} needs a drafter")
            self._check_drafter(drafter.config, tcfg, deep_k)
            if drafter.config.aux_layer_ids is not None:
                self.aux_layer_ids, self.aux_layer_ids_from = drafter.config.aux_layer_ids, "drafter"
            else:
                self.aux_layer_ids, self.aux_layer_ids_from = tcfg.default_aux_layer_ids(), "target default"
            mesh = getattr(target, "mesh", None)
            if mesh is not None:  # the drafter runs beside the target: same devices, same rules
                drafter.state = shard_state(drafter.state, mesh)
        default_eos = getattr(target, "eos_token_ids", tcfg.eos_token_id)  # config + generation_config
        self.eos_ids = tuple(default_eos if eos_ids is None else _token_ids(eos_ids, "eos_ids"))

    def _check_drafter(self, dcfg, tcfg, deep_k: str) -> None:
        if dcfg.target_hidden_size != tcfg.hidden_size:
            raise ValueError(
                f"drafter reads target hidden size {dcfg.target_hidden_size}, target has {tcfg.hidden_size}"
            )
        if dcfg.vocab_size != tcfg.vocab_size:
            raise ValueError(f"drafter vocabulary {dcfg.vocab_size} != target vocabulary {tcfg.vocab_size}")
        dflash = dcfg.mode == "dflash"
        if dcfg.aux_layer_ids is not None:
            count = None if dflash else NUM_AUX  # a DFlash head reads one context layer per head layer
            validate_aux_layer_ids(dcfg.aux_layer_ids, tcfg.num_layers, "the drafter's aux_layer_ids", count=count)
        if dflash != (self.mode == "dflash"):
            raise ValueError(f"a {dcfg.mode!r} head cannot draft in mode {self.mode!r} (a DFlash head: mode 'dflash')")
        if dflash and self.k > dcfg.block_size - 1:
            raise ValueError(
                f"k={self.k} exceeds what this DFlash head drafts in one pass: block_size {dcfg.block_size} "
                f"gives at most k={dcfg.block_size - 1}"
            )
        if self.mode == "parallel" and dcfg.mask_token_id is None:
            raise ValueError("parallel drafting needs a drafter with a mask_token_id")
        if dcfg.k_train is not None and self.k > dcfg.k_train:
            msg = f"k={self.k} exceeds the drafter's trained depth k_train={dcfg.k_train}"
            if deep_k == "error":
                raise ValueError(msg + " (to run anyway: deep_k='warn' in Python, --deep-k warn on the command line)")
            warnings.warn(msg, stacklevel=3)

    # ---------------------------------------------------------------- batching

    def _batch(self, prompts, max_new_tokens: int):
        ids = [prompt_tokens(self.target.tokenizer, p, f"prompt {i}") for i, p in enumerate(as_prompt_list(prompts))]
        if not ids:
            raise ValueError("no prompts")
        vocab = self.target.config.vocab_size
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"prompt {i} is empty")
            check_vocab(row, vocab, f"prompt {i}")
        longest = max(len(r) for r in ids)
        need = kv.length_for(longest, max_new_tokens, self.k)
        cache_len = self.cache_len or kv.bucket_length(longest, max_new_tokens, self.k)
        if need > cache_len:
            raise ValueError(
                f"prompt of {longest} tokens + {max_new_tokens} new tokens + 2k={2 * self.k} "
                f"does not fit the KV cache of {cache_len} positions"
            )
        limit = self.target.config.max_position_embeddings
        if longest + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the "
                f"target's max_position_embeddings={limit}"
            )
        b = _pow2(len(ids))
        p = min(kv.round_up(longest, self.prompt_pad), cache_len)
        prompt = np.zeros((b, p), np.int32)
        lens = np.zeros((b,), np.int32)
        for i, row in enumerate(ids):
            prompt[i, : len(row)] = row
            lens[i] = len(row)
        prompt, lens = _rows_on_mesh(getattr(self.target, "mesh", None), prompt, lens)
        return ids, prompt, lens, cache_len

    def engine_config(self, temperature: float = 0.0, top_p: float = 1.0, stop_token_ids=None) -> sp.EngineConfig:
        """The engine's static settings: this decoder's K, mode and aux ids, the sampling of a
        call, and the stop ids (the eos ids, plus `stop_token_ids`)."""
        stops = self.eos_ids
        if stop_token_ids is not None:
            extra = _token_ids(stop_token_ids, "stop_token_ids")
            check_vocab(extra, self.target.config.vocab_size, "stop_token_ids")
            stops = tuple(sorted(set(stops) | set(extra)))
        return sp.EngineConfig(
            k=self.k,
            mode=self.mode,
            aux_layer_ids=self.aux_layer_ids,
            eos_ids=stops,
            temperature=temperature,
            top_p=top_p,
            mesh=getattr(self.target, "mesh", None),
        )

    def cache_specs(self, batch: int, cache_len: int) -> tuple:
        """(target, drafter) cache specs (`peagle_jax.engine.cache.spec`) of `batch` rows of
        `cache_len` positions, in the parameters' dtypes; the drafter's is None in mode "none"."""
        _, tstate, _, dstate = self.modules()
        tspec = kv.spec(self.target.config, batch, cache_len, _param_dtype(tstate))
        if self.mode == "none":
            return tspec, None
        dlen = kv.drafter_length(self.drafter.config, cache_len, self.k)
        return tspec, kv.spec(self.drafter.config, batch, dlen, _param_dtype(dstate))

    def modules(self) -> tuple:
        """(target graphdef, target state, drafter graphdef, drafter state): the engine's
        arguments (the drafter pair is None in mode "none")."""
        d = self.drafter if self.mode != "none" else None
        return (
            self.target.graphdef,
            self.target.state,
            None if d is None else d.graphdef,
            None if d is None else d.state,
        )

    # ---------------------------------------------------------------- public calls

    def start(
        self,
        prompts,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
    ):
        """(engine config, prompt ids, prefilled DecodeState): the first step of `generate`."""
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
        temperature, top_p = check_sampling(temperature, top_p)
        seed = check_seed(seed)
        ids, prompt, lens, cache_len = self._batch(prompts, max_new_tokens)
        cfg = self.engine_config(temperature, top_p, stop_token_ids)
        tdef, tstate, ddef, dstate = self.modules()
        tspec, dspec = self.cache_specs(prompt.shape[0], cache_len)
        budget = jnp.full(lens.shape, max_new_tokens, jnp.int32)
        state = sp.jit_prefill(
            cfg, tdef, tstate, ddef, dstate, prompt, lens, budget, tspec, dspec, jax.random.key(seed)
        )
        return cfg, ids, state

    def generate(
        self,
        prompts,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
    ) -> GenerationResult:
        """Decode every prompt (see `as_prompt_list` for the accepted forms) until an eos id,
        one of `stop_token_ids` (this call only, added to the target's eos ids; each distinct
        set compiles once), or `max_new_tokens`. Stop tokens are kept in the output."""
        start = time.perf_counter()
        cfg, ids, state = self.start(prompts, max_new_tokens, temperature, top_p, seed, stop_token_ids)
        state = sp.jit_generate(cfg, *self.modules(), state)
        out, out_len, rounds, hist = jax.device_get((state.out, state.out_len, state.rounds, state.accept_hist))
        seconds = time.perf_counter() - start
        tokens = [out[i, : out_len[i]].tolist() for i in range(len(ids))]
        stats = acceptance_stats(hist, int(rounds[: len(ids)].sum()))
        new_tokens = sum(len(t) for t in tokens)
        stats.update(
            new_tokens=new_tokens,
            seconds=seconds,
            tokens_per_second=new_tokens / seconds if seconds > 0 else float("inf"),
            aux_layer_ids=list(self.aux_layer_ids),
            aux_layer_ids_from=self.aux_layer_ids_from,
        )
        tok = self.target.tokenizer
        texts = [tok.decode(t, skip_special_tokens=True) for t in tokens] if tok is not None else None
        return GenerationResult(tokens=tokens, stats=stats, texts=texts)

    def propose(self, prompt_ids: Prompt) -> list[int]:
        """Greedy: target prefill, its next token b, one draft pass -> [b, d1, ..., dK]."""
        _, _, state = self.start([prompt_ids], max_new_tokens=1)
        first, drafts = jax.device_get((state.out[0, 0], state.drafts[0]))
        return [int(first), *map(int, drafts)]


def generate_greedy(
    target, prompt_ids, max_new_tokens: int, eos: int | Sequence[int] | None = None, *, cache_len: int | None = None
) -> list[list[int]]:
    """Greedy continuation of each prompt (the engine's plain decoding, mode "none"), stopping
    per row at EOS. eos: token id(s) ending a row (kept in its output); None = the config's
    eos ids merged with generation_config.json's, () = never stop early. Returns the new
    tokens of each prompt."""
    if max_new_tokens == 0:
        return [[] for _ in as_prompt_list(prompt_ids)]
    eos_ids = None if eos is None else ((eos,) if _is_int(eos) else tuple(eos))
    dec = SpeculativeDecoder(target, mode="none", cache_len=cache_len, eos_ids=eos_ids)
    return dec.generate(prompt_ids, max_new_tokens=max_new_tokens).tokens


def acceptance_stats(hist: np.ndarray, rounds: int) -> dict[str, Any]:
    """vLLM's definitions: acceptance length = 1 + accepted drafts per round (averaged);
    per-position acceptance[i] = share of rounds whose draft i+1 was accepted."""
    hist = np.asarray(hist, np.int64)
    total = max(int(hist.sum()), 1)
    accepted = np.arange(len(hist))
    per_position = [float(hist[i + 1 :].sum() / total) for i in range(len(hist) - 1)]
    return {
        "acceptance_length": float(((accepted + 1) * hist).sum() / total) if hist.sum() else 0.0,
        "per_position_acceptance": per_position,
        "rounds": rounds,
    }
