"""Our own drafter checkpoint: `drafter.json` (format, version, dtype, the DrafterConfig) and
an orbax `state/` folder, written to a temporary sibling and renamed into place. Every head
family (P-EAGLE, EAGLE-3, DFlash) is saved the same way; `peagle_jax.formats.checkpoints` re-exports
these names and reads the other tools' formats."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.dtypes import dtype_name
from peagle_jax.config.target_config import ConfigError, read_json
from peagle_jax.formats.finite import non_finite_tensors
from peagle_jax.models.eagle import abstract_drafter, state_from_arrays
from peagle_jax.runtime.folders import atomic_folder, check_destination

__all__ = [
    "OWN_CONFIG_FILE",
    "OWN_STATE_DIR",
    "OWN_FORMAT",
    "OWN_VERSION",
    "local_checkpointer",
    "write_own",
    "read_own",
    "read_own_config",
]

OWN_CONFIG_FILE = "drafter.json"
OWN_STATE_DIR = "state"
OWN_FORMAT = "peagle_jax.handles.drafter"
OWN_VERSION = 1


def local_checkpointer():
    """An orbax checkpointer for this process alone: a head folder is written and read by one
    process, also inside a multi-host run (orbax's default waits for every process)."""
    import jax
    import orbax.checkpoint as ocp

    if jax.process_count() == 1:
        return ocp.StandardCheckpointer()
    me = jax.process_index()
    opts = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"p{me}")
    return ocp.StandardCheckpointer(multiprocessing_options=opts)


def write_own(
    path: str | os.PathLike,
    config: DrafterConfig,
    arrays: dict,
    dtype="float32",
    *,
    allow_non_finite: bool = False,
    check: Callable[[Path], None] | None = None,
) -> Path:
    """Our checkpoint, written to a temporary sibling folder and renamed into place; an
    existing drafter checkpoint (or empty folder) at `path` is replaced, anything else refused.
    NaN / Inf weights are refused (ValueError naming the tensor, nothing written) unless
    `allow_non_finite`. `check(tmp_folder)` runs before the rename; when it raises, nothing is left."""
    import jax
    from flax import nnx

    dest = Path(path).absolute()
    check_destination(dest, overwrite=True, marker=OWN_CONFIG_FILE)  # replaces only a drafter checkpoint
    bad = [] if allow_non_finite else non_finite_tensors(arrays)
    if bad:
        more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
        raise ValueError(
            f"{dest}: tensor {bad[0][0]!r} holds {bad[0][1]}{more}; a head with NaN / Inf weights is not saved "
            "(allow_non_finite=True saves it anyway)"
        )
    _, state = state_from_arrays(config, arrays, dtype)
    with atomic_folder(dest) as tmp:
        meta = {"format": OWN_FORMAT, "version": OWN_VERSION, "dtype": dtype_name(dtype), "config": config.to_dict()}
        (tmp / OWN_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        with local_checkpointer() as ckptr:
            tree = nnx.to_pure_dict(state)
            if jax.process_count() > 1:  # orbax refuses process-local jax.Arrays in a multi-host run
                tree = jax.tree.map(np.asarray, tree)
            ckptr.save(tmp / OWN_STATE_DIR, tree)
            ckptr.wait_until_finished()
        if check is not None:
            check(tmp)
    return dest


def read_own_config(path: Path) -> tuple[DrafterConfig, str]:
    """(config, stored dtype) of our checkpoint's drafter.json, checked; no array is read."""
    cfg_file = path / OWN_CONFIG_FILE
    meta = read_json(cfg_file)
    if meta.get("format") != OWN_FORMAT:
        raise ConfigError(f"{cfg_file}: key 'format' is {meta.get('format')!r}, expected {OWN_FORMAT!r}")
    if meta.get("version") != OWN_VERSION:
        raise ConfigError(f"{cfg_file}: unsupported version {meta.get('version')!r} (this build reads {OWN_VERSION})")
    config = DrafterConfig.from_dict(meta.get("config") or {}, f"{cfg_file} key 'config'")
    return config, dtype_name(meta.get("dtype", "float32"))


def read_own(path: Path) -> tuple[DrafterConfig, dict, str]:
    from flax import nnx

    cfg_file = path / OWN_CONFIG_FILE
    config, stored = read_own_config(path)
    state_dir = path / OWN_STATE_DIR
    if not state_dir.is_dir():
        raise FileNotFoundError(f"{state_dir}: missing (a drafter checkpoint holds drafter.json and state/)")
    _, abstract = abstract_drafter(config, stored)
    want = _on_this_process(nnx.to_pure_dict(abstract))
    with local_checkpointer() as ckptr:
        _check_stored_shapes(ckptr, state_dir, want, f"{cfg_file} key 'config'")
        try:
            restored = ckptr.restore(state_dir.absolute(), want)
        except Exception as err:  # orbax raises many types; name the folder
            raise ValueError(f"{state_dir}: cannot restore the drafter state ({err})") from None
    arrays = {
        tuple(int(k) if isinstance(k, str) and k.isdigit() else k for k in p): np.asarray(v)
        for p, v in _flatten(restored)
    }
    return config, arrays, stored


def _on_this_process(tree):
    """The restore target on this process's first device: orbax would otherwise place the arrays
    as they were saved, which a multi-host run refuses (another topology)."""
    import jax

    if jax.process_count() == 1:
        return tree
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), tree)


def _check_stored_shapes(ckptr, state_dir: Path, want: dict, where: str) -> None:
    """ValueError naming the first tensor the state holds in another shape than the config makes
    it (or not at all), read from the checkpoint's metadata: a restore that fails part-way leaves
    orbax's background threads printing tracebacks. Without readable metadata the restore decides."""
    import jax

    try:
        meta = ckptr.metadata(state_dir.absolute())
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        stored = {tuple(str(getattr(k, "key", k)) for k in p): tuple(x.shape) for p, x in leaves}
    except Exception:  # noqa: BLE001 - an older layout, or none: restore reports what is wrong
        return
    for path, leaf in _flatten(want):
        name = ".".join(map(str, path))
        if tuple(map(str, path)) not in stored:
            raise ValueError(f"{state_dir}: no tensor {name!r}, which {where} needs")
        if stored[tuple(map(str, path))] != tuple(leaf.shape):
            raise ValueError(
                f"{state_dir}: tensor {name!r} is stored as {list(stored[tuple(map(str, path))])}, but {where} "
                f"makes it {list(leaf.shape)} (the config and the state disagree)"
            )


def _flatten(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, prefix + (k,))
    else:
        yield prefix, tree
