"""What one request asks of the engine besides its prompt: `SamplingParams`.

Every field is data to the engine (traced per row), never a compile-time setting: requests with
different temperatures, penalties or stop sets share one compiled program. The meanings are
vLLM's (and OpenAI's where it has the field):
- temperature 0 is greedy; top_p, top_k (0: off) and min_p filter the target's distribution;
- presence / frequency penalties count the generated tokens, the repetition penalty the prompt's
  and the generated ones (vLLM's rule: logits > 0 divided by it, others multiplied);
- stop_token_ids end a request (the token is kept), as the target's eos ids do unless
  `ignore_eos`; no stop or eos id can end it before `min_tokens` new tokens (their logits are
  masked until then);
- logit_bias adds a bias to a token's logit before anything else (OpenAI's, in [-100, 100]);
- logprobs: None, or how many of the most likely tokens to report beside each emitted token's own
  log-probability (0: only its own), from the target's raw distribution (its log-softmax).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SEED_MAX = 2**63 - 1  # jax.random.key takes a C long (int64)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)

    def __post_init__(self):
        problems = list(self._problems())
        if problems:
            raise ValueError("; ".join(problems))

    def _problems(self):
        def finite(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        def whole(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not whole(self.max_tokens) or self.max_tokens < 1:
            yield f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
        if not finite(self.temperature) or self.temperature < 0:
            yield f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
        if not finite(self.top_p) or not 0 < self.top_p <= 1:
            yield f"top_p must be in (0, 1], got {self.top_p!r}"
        if not whole(self.top_k) or self.top_k < 0:
            yield f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"
        if not finite(self.min_p) or not 0 <= self.min_p <= 1:
            yield f"min_p must be in [0, 1], got {self.min_p!r}"
        for name in ("presence_penalty", "frequency_penalty"):
            if not finite(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                yield f"{name} must be in [-2, 2], got {getattr(self, name)!r}"
        if not finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            yield f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}"
        if not whole(self.seed) or not 0 <= self.seed <= SEED_MAX:
            yield f"seed must be an integer in [0, 2**63 - 1] (what jax.random.key accepts), got {self.seed!r}"
        if any(not whole(t) or t < 0 for t in self.stop_token_ids):
            yield f"stop_token_ids must be token ids (integers >= 0), got {list(self.stop_token_ids)!r}"
        if not whole(self.min_tokens) or self.min_tokens < 0:
            yield f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
        if self.logprobs is not None and (not whole(self.logprobs) or self.logprobs < 0):
            yield f"logprobs must be None or an integer >= 0, got {self.logprobs!r}"
        if any(not whole(t) or t < 0 or not finite(b) or not -100 <= b <= 100 for t, b in self.logit_bias):
            yield f"logit_bias must map token ids to biases in [-100, 100], got {dict(self.logit_bias)!r}"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0.0, 0.0, 1.0)


STOP_WIDTH = 8  # stop ids a row holds (eos ids and stop_token_ids), at least: wider sets round up to a power of two


def _width(n: int, least: int) -> int:
    return 0 if n == 0 and least == 0 else max(least, 1 << max(0, (n - 1).bit_length()))


class Sampling(NamedTuple):
    """The rows' SamplingParams as device arrays (traced: no compile per value), and each row's
    own key, so a row's draws never depend on the other rows. Padded entries are -1."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_p: jax.Array  # [B] f32
    top_k: jax.Array  # [B] i32, 0 = off
    min_p: jax.Array  # [B] f32
    presence: jax.Array  # [B] f32
    frequency: jax.Array  # [B] f32
    repetition: jax.Array  # [B] f32
    min_tokens: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] i32, -1 = off
    stop_ids: jax.Array  # [B, S] i32: the ids that end the row (its eos ids unless ignore_eos, and its stop ids)
    bias_ids: jax.Array  # [B, NB] i32
    bias: jax.Array  # [B, NB] f32
    key: jax.Array  # [B] typed PRNG keys


def row_key(seed: int, index: int) -> jax.Array:
    """The key of row `index` of a call seeded `seed` (a request's choices, a batch's prompts):
    `generate([p], seed=s)` and a server request of seed s draw alike."""
    return jax.random.fold_in(jax.random.key(seed), index)


def stop_ids(params: SamplingParams, eos_ids) -> list[int]:
    """The ids that end a row: its stop_token_ids, and the eos ids unless ignore_eos."""
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids)))


def sampling_rows(params: list[SamplingParams], eos_ids, rows: int, keys: list, stop_width=None, bias_width=None):
    """Sampling arrays of `rows` rows: one per params (with its key), then greedy padding rows.
    Stop ids and logit biases are padded to `stop_width` / `bias_width` entries (None: the
    smallest power of two that holds them, at least STOP_WIDTH stop ids); ValueError when a row
    holds more than a given width (a state's rows all have its widths)."""
    stops = [stop_ids(p, eos_ids) for p in params]
    most_stops = max((len(s) for s in stops), default=0)
    most_biases = max((len(p.logit_bias) for p in params), default=0)
    s_width = _width(most_stops, STOP_WIDTH) if stop_width is None else stop_width
    b_width = _width(most_biases, 0) if bias_width is None else bias_width
    if most_stops > s_width or most_biases > b_width:
        raise ValueError(
            f"a row holds {most_stops} stop ids (eos ids included) and {most_biases} logit biases; "
            f"at most {s_width} and {b_width} fit"
        )
    table = np.full((rows, s_width), -1, np.int32)
    bias_ids, bias = np.full((rows, b_width), -1, np.int32), np.zeros((rows, b_width), np.float32)
    for i, (p, s) in enumerate(zip(params, stops)):
        table[i, : len(s)] = s
        for j, (t, b) in enumerate(p.logit_bias):
            bias_ids[i, j], bias[i, j] = t, b

    def column(name, fill, dtype, value=lambda p, name: getattr(p, name)):
        col = np.full((rows,), fill, dtype)
        col[: len(params)] = [value(p, name) for p in params]
        return jnp.asarray(col)

    padding = jax.random.split(jax.random.key(0), rows - len(keys))  # one op, however many rows
    return Sampling(
        temperature=column("temperature", 0.0, np.float32),
        top_p=column("top_p", 1.0, np.float32),
        top_k=column("top_k", 0, np.int32),
        min_p=column("min_p", 0.0, np.float32),
        presence=column("presence_penalty", 0.0, np.float32),
        frequency=column("frequency_penalty", 0.0, np.float32),
        repetition=column("repetition_penalty", 1.0, np.float32),
        min_tokens=column("min_tokens", 0, np.int32),
        logprobs=column("logprobs", -1, np.int32, lambda p, _: -1 if p.logprobs is None else p.logprobs),
        stop_ids=jnp.asarray(table),
        bias_ids=jnp.asarray(bias_ids),
        bias=jnp.asarray(bias),
        key=jnp.concatenate([jnp.stack(keys), padding]) if keys else padding,
    )
