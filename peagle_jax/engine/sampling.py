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
