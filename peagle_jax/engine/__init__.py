"""The engine: speculative decoding at run time.

`Engine` (engine.py) is what a compiled speculative decoder is: its static settings, modules,
cache specs, the fit rule, and the verbs over a state. Under it: one jitted round (the target
verifies K drafts, acceptance, the drafter's next pass) and the device loop around it
(`speculative`), per-row sampling on the device (`sampler`) from per-request settings
(`sampling.SamplingParams`), the KV caches and their length rule (`cache`). On it: generation
(`SpeculativeDecoder`, `generate_greedy`), decode slots for continuous batching (`Slots`), and
the evaluation prompt sets (`load_prompts`). It reads heads and targets as handles; it never
reads a checkpoint format (`peagle_jax.formats`).
"""

from peagle_jax.engine import cache, speculative
from peagle_jax.engine.engine import DepthError, Engine, check_depth, check_drafter, largest_k
from peagle_jax.engine.generation import (
    GenerationResult,
    SpeculativeDecoder,
    acceptance_stats,
    check_vocab,
    generate_greedy,
    prompt_tokens,
)
from peagle_jax.engine.prompts import PROMPT_SETS, load_prompts, prompt_ids
from peagle_jax.engine.sampling import SamplingParams, row_key
from peagle_jax.engine.slots import Slots

__all__ = [
    "PROMPT_SETS",
    "DepthError",
    "Engine",
    "GenerationResult",
    "SamplingParams",
    "Slots",
    "SpeculativeDecoder",
    "acceptance_stats",
    "cache",
    "check_depth",
    "check_drafter",
    "check_vocab",
    "generate_greedy",
    "largest_k",
    "load_prompts",
    "prompt_ids",
    "prompt_tokens",
    "row_key",
    "speculative",
]
