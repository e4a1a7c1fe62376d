"""The jitted inference API: `SpeculativeDecoder(target, drafter, k, mode)`.

Defined in `peagle_jax.engine.generation` (the trainer evaluates heads with it too); this module is
its public home for users: `from infer import SpeculativeDecoder`.
"""

from peagle_jax.engine import GenerationResult, SpeculativeDecoder, acceptance_stats, prompt_tokens

__all__ = ["SpeculativeDecoder", "GenerationResult", "acceptance_stats", "prompt_tokens"]
