"""The engine: speculative decoding at run time.

One jitted round (the target verifies K drafts, acceptance, the drafter's next pass) and the
device loop around it (`speculative`), the KV caches and their length rule (`cache`),
generation on top of them (`SpeculativeDecoder`, `generate_greedy`), decode slots for
continuous batching (`Slots`), and the evaluation prompt sets (`load_prompts`). It reads heads
and targets as handles; it never reads a checkpoint format (`peagle_jax.formats`).
"""

from peagle_jax.engine import cache, speculative
from peagle_jax.engine.generation import (
    DepthError,
    GenerationResult,
    SpeculativeDecoder,
    acceptance_stats,
    check_depth,
    check_vocab,
    generate_greedy,
    largest_k,
    prompt_tokens,
)
from peagle_jax.engine.prompts import PROMPT_SETS, load_prompts, prompt_ids
from peagle_jax.engine.slots import Slots

__all__ = [
    "PROMPT_SETS",
    "DepthError",
    "GenerationResult",
    "Slots",
    "SpeculativeDecoder",
    "acceptance_stats",
    "cache",
    "check_depth",
    "check_vocab",
    "generate_greedy",
    "largest_k",
    "load_prompts",
    "prompt_ids",
    "prompt_tokens",
    "speculative",
]
