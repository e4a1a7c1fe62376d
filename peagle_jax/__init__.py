"""peagle-jax: P-EAGLE (parallel drafting EAGLE) speculative decoding in JAX/Flax."""

_LAZY = {  # every name loads on first use: `import peagle_jax.cli` stays instant (a CLI's handlers go in first)
    "ConfigError": "peagle_jax.config",
    "RopeConfig": "peagle_jax.config",
    "TargetConfig": "peagle_jax.config",
    "load_target": "peagle_jax.target",
    "Target": "peagle_jax.target",
    "new_drafter": "peagle_jax.drafter",
    "load_drafter": "peagle_jax.drafter",
    "Drafter": "peagle_jax.drafter",
    "DrafterConfig": "peagle_jax.drafter",
}

__all__ = [*_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'peagle_jax' has no attribute {name!r}")
