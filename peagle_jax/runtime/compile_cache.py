"""JAX's persistent compilation cache, on by default for the command lines (`python -m train`,
`python -m infer`): a program compiled once on a machine is read back by the next run instead of
compiled again (a real-size target's serving programs take tens of seconds to compile cold).

Where: `$PEAGLE_JAX_COMPILE_CACHE` (a folder, or `off`), else `$JAX_COMPILATION_CACHE_DIR` when set,
else `~/.cache/peagle_jax/xla-cache` (under `$XDG_CACHE_HOME` when set). JAX keys every entry by the
program, the compile options, the device and the jax / jaxlib versions, so an edited program or
another GPU compiles afresh. Only programs that took at least a second to compile are kept (JAX's
default; `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` changes it), at most 8 GiB unless
`JAX_COMPILATION_CACHE_MAX_SIZE` says otherwise. XLA's own settings (GPU autotuning:
`XLA_FLAGS=--xla_gpu_autotune_level=N`, 0 off, 4 the default) pass through `XLA_FLAGS` as usual.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "PEAGLE_JAX_COMPILE_CACHE"
OFF = ("off", "0", "false", "no", "none")
MAX_BYTES = 8 << 30


def cache_folder() -> Path | None:
    """The folder the command lines cache compiled programs in, None when turned off."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in OFF:
        return None
    if value:
        return Path(value).expanduser()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "peagle_jax" / "xla-cache"


def enable_compile_cache() -> Path | None:
    """Points JAX's persistent cache at `cache_folder()` (made when missing); None when it is off
    or the folder cannot be made (the cache only saves time: the run goes on without it)."""
    folder = cache_folder()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(folder))
    if not os.environ.get("JAX_COMPILATION_CACHE_MAX_SIZE"):
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return folder
