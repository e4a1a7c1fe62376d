"""Generation on the speculative engine: `SpeculativeDecoder(target, drafter, k, mode)` and
`generate_greedy` (plain greedy decoding = the engine's mode "none").

Prompts (token ids, strings, or chat conversations) are tokenized with the target's
tokenizer (`peagle_jax.conversations.chat`), right-padded into a batch bucket, and decoded by the engine of
`peagle_jax.engine.speculative` in one device loop. Shapes are bucketed (batch to a power of two,
prompt and cache lengths to multiples of 64), so repeated calls reuse compiled code.
`infer` re-exports `SpeculativeDecoder` as the public inference API.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from peagle_jax.conversations import chat
from peagle_jax.engine import cache as kv
from peagle_jax.engine.engine import Engine, check_depth, check_int
from peagle_jax.engine.sampling import SEED_MAX, SamplingParams

Prompt = Sequence[int] | str | Sequence[dict]


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # the new tokens of each prompt
    stats: dict[str, Any]
    texts: list[str] | None = None
    logprobs: list[list[tuple[float, list[tuple[int, float]]]]] | None = None  # asked with logprobs=N


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


SEED_RANGE = "[0, 2**63 - 1]"


def check_seed(seed) -> int:
    """`seed` as an int in [0, SEED_MAX], what `jax.random.key` accepts; ValueError naming `seed`."""
    if not _is_int(seed) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed must be an integer in {SEED_RANGE} (what jax.random.key accepts), got {seed!r}")
    return int(seed)


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
    and conversations go through `peagle_jax.conversations.chat.encode_prompt` (the chat template when
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
    """Generation on an `Engine`: prompts (token ids, strings or conversations) tokenized with the
    target's tokenizer, batched (rows to a power of two, prompts right-padded to a multiple of
    `prompt_pad`: a larger value = fewer compiles over varied prompts), decoded in one device loop.

    target, drafter, k, mode, deep_k, eos_ids: the `Engine`'s (DepthError, a ValueError, when no
    call could hold one round of k drafts). `cache_len`: fixed KV cache length (default: sized per
    call from the prompts and max_new_tokens). Sampling settings and stop ids are data: calls with
    other temperatures, top-p or stop sets reuse the compiled programs.

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
        eos = None if eos_ids is None else _token_ids(eos_ids, "eos_ids")
        self.engine = Engine(target, drafter, k, mode, deep_k=deep_k, eos_ids=eos)
        self.drafter = drafter
        self.cache_len = None if cache_len is None else check_int("cache_len", cache_len, 1)
        if self.mode != "none":
            check_depth(self.k, self.cache_len, target.config.max_position_embeddings)
        self.prompt_pad = check_int("prompt_pad", prompt_pad, 1)

    @property
    def target(self):
        return self.engine.target

    @property
    def mode(self) -> str:
        return self.engine.mode

    @property
    def k(self) -> int:
        return self.engine.k

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.engine.eos_ids

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.engine.config.aux_layer_ids

    @property
    def aux_layer_ids_from(self) -> str:
        return self.engine.aux_layer_ids_from

    def modules(self) -> tuple:
        return self.engine.modules()

    # ---------------------------------------------------------------- public calls

    def _prompts(self, prompts) -> list[list[int]]:
        ids = [prompt_tokens(self.target.tokenizer, p, f"prompt {i}") for i, p in enumerate(as_prompt_list(prompts))]
        if not ids:
            raise ValueError("no prompts")
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"prompt {i} is empty")
            check_vocab(row, self.target.config.vocab_size, f"prompt {i}")
        return ids

    def params(self, max_new_tokens, temperature=0.0, top_p=1.0, seed=0, stop_token_ids=None, **more) -> SamplingParams:
        """One call's SamplingParams (ValueError naming the value that is off); `more`: the
        other SamplingParams fields (top_k, min_p, penalties, min_tokens, ignore_eos, logprobs,
        logit_bias)."""
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
        stops = () if stop_token_ids is None else tuple(_token_ids(stop_token_ids, "stop_token_ids"))
        check_vocab(stops, self.target.config.vocab_size, "stop_token_ids")
        fields = {f.name for f in dataclasses.fields(SamplingParams)} - {"max_tokens", "stop_token_ids"}
        unknown = sorted(set(more) - fields)
        if unknown:
            raise TypeError(f"unknown sampling settings {unknown}; known: {sorted(fields)}")
        bias = tuple((int(t), float(b)) for t, b in dict(more.pop("logit_bias", None) or {}).items())
        check_vocab([t for t, _ in bias], self.target.config.vocab_size, "logit_bias")
        return SamplingParams(
            max_new_tokens, temperature, top_p, seed=seed, stop_token_ids=stops, logit_bias=bias, **more
        )

    def start(self, prompts, max_new_tokens: int, temperature=0.0, top_p=1.0, seed=0, stop_token_ids=None, **more):
        """(engine config, prompt ids, prefilled DecodeState): the first step of `generate`;
        `more`: the other SamplingParams fields (see `params`)."""
        params = self.params(max_new_tokens, temperature, top_p, seed, stop_token_ids, **more)
        ids = self._prompts(prompts)
        longest = max(len(r) for r in ids)
        length = self.cache_len or kv.bucket_length(longest, params.max_tokens, self.k)
        engine = self.engine.with_records(params.logprobs, params.penalized)
        state = engine.prefill(ids, [params] * len(ids), length, rows=_pow2(len(ids)), pad=self.prompt_pad)
        return engine.config, ids, state

    def generate(
        self,
        prompts,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        **more,
    ) -> GenerationResult:
        """Decode every prompt (see `as_prompt_list` for the accepted forms) until an eos id,
        one of `stop_token_ids` (this call only, added to the target's eos ids), or
        `max_new_tokens`. Stop tokens are kept in the output. Prompt i samples with the key
        `sampling.row_key(seed, i)`. `more`: the other SamplingParams fields (top_k, min_p,
        presence_penalty, frequency_penalty, repetition_penalty, min_tokens, ignore_eos,
        logit_bias as {id: bias}, logprobs: the result's `logprobs` then holds, per prompt and
        token, (its log-probability under the target, [(id, log-probability)] of the `logprobs`
        most likely tokens))."""
        start = time.perf_counter()
        cfg, ids, state = self.start(prompts, max_new_tokens, temperature, top_p, seed, stop_token_ids, **more)
        engine = self.engine.with_records(cfg.logprobs, cfg.penalties)
        state = engine.run(state)
        got = jax.device_get((state.out, state.out_len, state.rounds, state.accepted, state.logprobs))
        out, out_len, rounds, accepted, record = got
        seconds = time.perf_counter() - start
        n = len(ids)
        tokens = [out[i, : out_len[i]].tolist() for i in range(n)]
        stats = acceptance_stats(accepted[:n].sum(axis=0), int(rounds[:n].sum()))
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
        logprobs = None if record is None else [token_logprobs(record, i, int(out_len[i])) for i in range(n)]
        return GenerationResult(tokens=tokens, stats=stats, texts=texts, logprobs=logprobs)

    def propose(self, prompt_ids: Prompt) -> list[int]:
        """Greedy: target prefill, its next token b, one draft pass -> [b, d1, ..., dK]."""
        _, _, state = self.start([prompt_ids], max_new_tokens=1)
        first, drafts = jax.device_get((state.out[0, 0], state.drafts[0]))
        return [int(first), *map(int, drafts)]


def token_logprobs(record, row: int, count: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Row `row`'s first `count` tokens' (log-probability, [(id, log-probability)] of the top
    ones) from a state's `Logprobs` on the host."""
    token, top_ids, top = (np.asarray(x)[row, :count] for x in record)
    return [(float(token[i]), [(int(t), float(v)) for t, v in zip(top_ids[i], top[i])]) for i in range(count)]


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
