"""peagle-jax: P-EAGLE (parallel drafting EAGLE) speculative decoding in JAX/Flax."""

from peagle_jax.config import ConfigError, RopeConfig, TargetConfig

_LAZY = {
    "load_target": "peagle_jax.target",
    "Target": "peagle_jax.target",
    "new_drafter": "peagle_jax.drafter",
    "load_drafter": "peagle_jax.drafter",
    "Drafter": "peagle_jax.drafter",
    "DrafterConfig": "peagle_jax.drafter",
}

__all__ = ["ConfigError", "RopeConfig", "TargetConfig", *_LAZY]


def __getattr__(name):  # heavy modules load on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'peagle_jax' has no attribute {name!r}")
