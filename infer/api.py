"""The jitted inference API: `SpeculativeDecoder(target, drafter, k, mode)`.

Prompts (token ids, strings, or chat conversations) are tokenized with the target's
tokenizer and chat template, right-padded into a batch bucket, and decoded by the engine of
`peagle_jax.speculative` in one device loop. Shapes are bucketed (batch to a power of two,
prompt and cache lengths to multiples of 64), so repeated calls reuse compiled code.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from infer.prompts import encode_conversation
from peagle_jax import speculative as sp
from peagle_jax.sharding import shard_state

Prompt = Sequence[int] | str | Sequence[dict]


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # the new tokens of each prompt
    stats: dict[str, Any]
    texts: list[str] | None = None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _param_dtype(state):
    """The floating dtype of a model's parameters (its KV caches use the same)."""
    return next(x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating))


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of one prompt: ids pass through; strings and conversations go through
    `infer.prompts.encode_conversation` (the chat template when the tokenizer has one)."""
    if isinstance(prompt, str) or (len(prompt) and isinstance(prompt[0], dict)):
        if tokenizer is None:
            raise ValueError("a text prompt needs a target folder with a tokenizer; pass token ids instead")
        return encode_conversation(tokenizer, prompt)
    return [int(t) for t in prompt]


class SpeculativeDecoder:
    """Speculative decoding of `target` with `drafter` ("parallel" | "chain"), or plain
    decoding ("none", drafter unused).

    k: drafts per round. `deep_k`: what to do when k exceeds the depth the drafter was
    trained for ("error" or "warn"). `cache_len`: fixed KV cache length (default: sized per
    call from the prompts and max_new_tokens). `prompt_pad`: prompts are right-padded to a
    multiple of it (a larger value = fewer compiles over varied prompts).
    """

    def __init__(self, target, drafter=None, k: int = 7, mode: str = "parallel", *,
                 deep_k: str = "error", cache_len: int | None = None, prompt_pad: int = 64):
        if mode not in sp.MODES:
            raise ValueError(f"mode must be one of {sp.MODES}, got {mode!r}")
        self.target, self.drafter, self.mode = target, drafter, mode
        self.k = 0 if mode == "none" else int(k)
        self.cache_len, self.prompt_pad = cache_len, prompt_pad
        tcfg = target.config
        self.aux_layer_ids = tuple(target.aux_layer_ids)
        if mode != "none":
            if drafter is None:
                raise ValueError(f"mode {mode!r} needs a drafter")
            if self.k < 1:
                raise ValueError(f"k must be >= 1, got {k}")
            self._check_drafter(drafter.config, tcfg, deep_k)
            self.aux_layer_ids = tuple(drafter.config.aux_layer_ids)
            mesh = getattr(target, "mesh", None)
            if mesh is not None:  # the drafter runs beside the target: same devices, same rules
                drafter.state = shard_state(drafter.state, mesh)
        self.eos_ids = tuple(tcfg.eos_token_id)

    def _check_drafter(self, dcfg, tcfg, deep_k: str) -> None:
        if dcfg.target_hidden_size != tcfg.hidden_size:
            raise ValueError(f"drafter reads target hidden size {dcfg.target_hidden_size}, "
                             f"target has {tcfg.hidden_size}")
        if dcfg.vocab_size != tcfg.vocab_size:
            raise ValueError(f"drafter vocabulary {dcfg.vocab_size} != target vocabulary {tcfg.vocab_size}")
        bad = [i for i in dcfg.aux_layer_ids if not 0 <= i < tcfg.num_layers]
        if bad:
            raise ValueError(f"drafter aux layer ids {dcfg.aux_layer_ids} out of range for a "
                             f"{tcfg.num_layers}-layer target")
        if self.mode == "parallel" and dcfg.mask_token_id is None:
            raise ValueError("parallel drafting needs a drafter with a mask_token_id")
        if dcfg.k_train is not None and self.k > dcfg.k_train:
            msg = f"k={self.k} exceeds the drafter's trained depth k_train={dcfg.k_train}"
            if deep_k == "error":
                raise ValueError(msg + " (pass deep_k='warn' to run anyway)")
            warnings.warn(msg, stacklevel=3)

    # ---------------------------------------------------------------- batching

    def _batch(self, prompts: Sequence[Prompt], max_new_tokens: int):
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [encode_prompt(self.target.tokenizer, p) for p in prompts]
        vocab = self.target.config.vocab_size
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"prompt {i} is empty")
            if min(row) < 0 or max(row) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        longest = max(len(r) for r in ids)
        need = longest + max_new_tokens + 2 * self.k + 2
        cache_len = self.cache_len or _round_up(need, 64)
        if need > cache_len:
            raise ValueError(f"prompt of {longest} tokens + {max_new_tokens} new tokens + 2k={2 * self.k} "
                             f"does not fit the KV cache of {cache_len} positions")
        limit = self.target.config.max_position_embeddings
        if longest + max_new_tokens > limit:
            raise ValueError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the "
                             f"target's max_position_embeddings={limit}")
        b = _pow2(len(ids))
        p = min(_round_up(longest, self.prompt_pad), cache_len)
        prompt = np.zeros((b, p), np.int32)
        lens = np.zeros((b,), np.int32)
        for i, row in enumerate(ids):
            prompt[i, : len(row)] = row
            lens[i] = len(row)
        return ids, jnp.asarray(prompt), jnp.asarray(lens), cache_len

    def _cache_specs(self, batch: int, cache_len: int):
        def spec(cfg, dtype):
            shape = (batch, cache_len, cfg.num_kv_heads, cfg.head_dim)
            return tuple((dtype, shape) for _ in range(cfg.num_layers))

        tspec = spec(self.target.config, _param_dtype(self.target.state))
        dspec = None if self.mode == "none" else spec(self.drafter.config, _param_dtype(self.drafter.state))
        return tspec, dspec

    def _engine(self, temperature: float, top_p: float) -> sp.EngineConfig:
        return sp.EngineConfig(k=self.k, mode=self.mode, aux_layer_ids=self.aux_layer_ids, eos_ids=self.eos_ids,
                               temperature=float(temperature), top_p=float(top_p))

    def _modules(self):
        d = self.drafter if self.mode != "none" else None
        return (self.target.graphdef, self.target.state,
                None if d is None else d.graphdef, None if d is None else d.state)

    # ---------------------------------------------------------------- public calls

    def prefill(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                seed: int = 0):
        """(engine config, rows, prefilled DecodeState): the first step of `generate`."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        ids, prompt, lens, cache_len = self._batch(prompts, max_new_tokens)
        cfg = self._engine(temperature, top_p)
        tdef, tstate, ddef, dstate = self._modules()
        tspec, dspec = self._cache_specs(prompt.shape[0], cache_len)
        budget = jnp.full(lens.shape, max_new_tokens, jnp.int32)
        state = sp.jit_prefill(cfg, tdef, tstate, ddef, dstate, prompt, lens, budget, tspec, dspec,
                               jax.random.key(seed))
        return cfg, ids, state

    def generate(self, prompts, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> GenerationResult:
        start = time.perf_counter()
        cfg, ids, state = self.prefill(prompts, max_new_tokens, temperature, top_p, seed)
        tdef, tstate, ddef, dstate = self._modules()
        state = sp.jit_generate(cfg, tdef, tstate, ddef, dstate, state)
        out, out_len, rounds, hist = jax.device_get((state.out, state.out_len, state.rounds,
                                                     state.accept_hist))
        seconds = time.perf_counter() - start
        tokens = [out[i, : out_len[i]].tolist() for i in range(len(ids))]
        stats = acceptance_stats(hist, int(rounds[: len(ids)].sum()))
        new_tokens = sum(len(t) for t in tokens)
        stats.update(new_tokens=new_tokens, seconds=seconds,
                     tokens_per_second=new_tokens / seconds if seconds > 0 else float("inf"))
        tok = self.target.tokenizer
        texts = [tok.decode(t, skip_special_tokens=True) for t in tokens] if tok is not None else None
        return GenerationResult(tokens=tokens, stats=stats, texts=texts)

    def propose(self, prompt_ids: Prompt) -> list[int]:
        """Greedy: target prefill, its next token b, one draft pass -> [b, d1, ..., dK]."""
        _, _, state = self.prefill([prompt_ids], max_new_tokens=1)
        first, drafts = jax.device_get((state.out[0, 0], state.drafts[0]))
        return [int(first), *map(int, drafts)]


def acceptance_stats(hist: np.ndarray, rounds: int) -> dict[str, Any]:
    """vLLM's definitions: acceptance length = 1 + accepted drafts per round (averaged);
    per-position acceptance[i] = share of rounds whose draft i+1 was accepted."""
    hist = np.asarray(hist, np.int64)
    total = max(int(hist.sum()), 1)
    accepted = np.arange(len(hist))
    per_position = [float(hist[i + 1:].sum() / total) for i in range(len(hist) - 1)]
    return {
        "acceptance_length": float(((accepted + 1) * hist).sum() / total) if hist.sum() else 0.0,
        "per_position_acceptance": per_position,
        "rounds": rounds,
    }
