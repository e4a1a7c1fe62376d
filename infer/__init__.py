"""Jitted speculative inference: `SpeculativeDecoder`, and `python -m infer generate|bench`."""

from infer.api import GenerationResult, SpeculativeDecoder

__all__ = ["GenerationResult", "SpeculativeDecoder"]
