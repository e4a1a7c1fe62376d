"""peagle-jax: P-EAGLE (parallel drafting EAGLE) speculative decoding in JAX/Flax."""

_LAZY = {  # every name loads on first use: `import peagle_jax.runtime.command_line` stays instant (a CLI's handlers go in first)
    "ConfigError": "peagle_jax.config.target_config",
    "RopeConfig": "peagle_jax.config.target_config",
    "TargetConfig": "peagle_jax.config.target_config",
    "load_target": "peagle_jax.handles.target",
    "Target": "peagle_jax.handles.target",
    "new_drafter": "peagle_jax.handles.drafter",
    "load_drafter": "peagle_jax.handles.drafter",
    "Drafter": "peagle_jax.handles.drafter",
    "DrafterConfig": "peagle_jax.handles.drafter",
    "make_mesh": "peagle_jax.runtime.sharding",
}

__all__ = [*_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'peagle_jax' has no attribute {name!r}")
