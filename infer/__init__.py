"""Jitted speculative inference: `SpeculativeDecoder`, and `python -m infer generate|bench`."""

__all__ = ["GenerationResult", "SpeculativeDecoder"]


def __getattr__(name):  # on first use: `python -m infer` installs its interrupt handlers before JAX loads
    if name in __all__:
        from infer import api

        return getattr(api, name)
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
