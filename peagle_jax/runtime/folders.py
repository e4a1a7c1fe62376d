"""Writing model folders without ever leaving a half-written one.

Everything is written into a temporary sibling of the destination and renamed into place at
the end; on any error (or interruption) the temporary folder is removed and the destination
is untouched. `write_hf_folder` is the one writer of Hugging Face style folders (config.json
+ model.safetensors, or shards + model.safetensors.index.json) for targets and drafters.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from peagle_jax.runtime.command_line import signals_deferred, started

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = "5GB"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def check_destination(dest: Path, overwrite: bool, marker: str) -> None:
    """An existing non-empty `dest` is replaced only with `overwrite`, and only when it holds
    `marker` (so a wrong path never wipes an unrelated folder)."""
    if not dest.exists():
        return
    if not dest.is_dir():
        raise FileExistsError(f"{dest}: exists and is not a folder")
    if not any(dest.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(f"{dest}: already exists (pass overwrite=True or --overwrite to replace it)")
    if not (dest / marker).exists():
        raise FileExistsError(f"{dest}: exists and holds no {marker}; refusing to replace it")


def unwritable(path: Path, want: str) -> str | None:
    """Why nothing of kind `want` ("file" or "folder") can be written at `path` (None: it can):
    `path` is not the other kind, and its nearest existing parent is a folder where a file can be
    created (tried: a probe file made and removed; missing parents are created)."""
    path = Path(path).absolute()
    if path.exists() and path.is_dir() != (want == "folder"):
        return f"exists and is a {'folder' if path.is_dir() else 'file'}, not a {want}"
    parent = next(p for p in path.parents if p.exists())
    if not parent.is_dir():
        return f"{parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"folder {parent} is not writable"
    with signals_deferred():  # an interrupt waits for the probe's removal
        try:  # os.access says yes to root everywhere (/proc, a read-only mount): try it
            fd, probe = tempfile.mkstemp(dir=parent, prefix=".peagle-probe-")
        except OSError as err:
            return f"folder {parent} is not writable (creating a file there fails: {err.strerror or err})"
        os.close(fd)
        os.unlink(probe)
    return None


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_temporaries(dest: Path) -> list[Path]:
    """Removes `.NAME.tmp-PID-*` / `.NAME.old-PID-*` siblings of `dest` left by writers that
    died (killed before they could clean up); a live writer's folders are left alone."""
    removed = []
    for kind in ("tmp", "old"):
        for p in dest.parent.glob(f".{dest.name}.{kind}-*"):
            pid = p.name[len(f".{dest.name}.{kind}-") :].split("-", 1)[0]
            if p.is_dir() and (not pid.isdigit() or not _pid_alive(int(pid))):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def new_sibling(dest: Path, kind: str = "tmp") -> Path:
    """A fresh `.NAME.KIND-PID-random` folder beside `dest` (the pid lets a later writer tell a
    dead writer's leftovers from a live one's)."""
    started()  # a writer: an interrupt from here unwinds, removing what it made
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.{kind}-{os.getpid()}-", dir=dest.parent))


def apply_umask_modes(root: Path) -> None:
    """Ordinary permissions (0777 / 0666 minus the umask) for a finished folder and everything
    in it: mkdtemp makes 0700 folders and some writers (orbax, mkstemp) 0600 files, which a
    server running as another user could not read."""
    umask = current_umask()
    for path in [root, *root.rglob("*")]:
        with contextlib.suppress(OSError):
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def atomic_folder(out: str | os.PathLike) -> Iterator[Path]:
    """Yields a fresh temporary folder beside `out`; when the block succeeds it replaces
    `out` (an existing one is moved aside first, then deleted). On any error, Ctrl-C or
    SIGTERM (see `command_line.terminate_as_interrupt`) the temporary folder is removed; folders of
    writers that were killed outright are removed by the next write to the same `out`."""
    dest = Path(out).absolute()
    started()
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(dest)
    tmp = new_sibling(dest, "tmp")
    try:
        yield tmp
        apply_umask_modes(tmp)
        if dest.exists():
            old = new_sibling(dest, "old")
            os.rmdir(old)
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Writes a text file through a temporary sibling and a rename (never half-written), with
    the umask's ordinary mode (mkstemp alone would leave it 0600)."""
    path = Path(path).absolute()
    started()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def parse_size(text: str | int) -> int:
    """ "5GB" -> 5 * 10**9, "2GiB" -> 2 * 2**30, "500KB", "123" (bytes). Like Hugging Face."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise ValueError(f"invalid size {text!r} (examples: 5GB, 500MB, 2GiB, 4096)")
        number, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
        if binary and not unit:
            raise ValueError(f"invalid size {text!r} (examples: 5GB, 500MB, 2GiB, 4096)")
        power = " KMGT".index(unit) if unit else 0
        value = int(number * (1024 if binary else 1000) ** power)
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def nbytes(arr) -> int:
    return int(arr.size) * int(arr.dtype.itemsize)


def shard_groups(tensors: dict, max_bytes: int) -> list[list[str]]:
    """Keys split into consecutive groups of at most `max_bytes` (a bigger tensor alone)."""
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for key, arr in tensors.items():
        n = nbytes(arr)
        if current and size + n > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(key)
        size += n
    if current or not groups:
        groups.append(current)
    return groups


def write_hf_folder(
    out: str | os.PathLike,
    config: dict,
    tensors: dict,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    overwrite: bool = False,
    extra_files: Sequence[str | os.PathLike] = (),
    check: Callable[[Path], None] | None = None,
) -> Path:
    """config.json + model.safetensors (or shards + index) of numpy `tensors`, written
    atomically. `check(tmp_folder)` runs before the rename; when it raises, nothing is left."""
    from safetensors.numpy import save_file

    limit = parse_size(max_shard_size)
    dest = Path(out).absolute()
    check_destination(dest, overwrite, CONFIG_FILE)
    with atomic_folder(dest) as tmp:
        groups = shard_groups(tensors, limit)
        if len(groups) == 1:
            save_file({k: tensors[k] for k in groups[0]}, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        else:
            n = len(groups)
            weight_map = {}
            for i, keys in enumerate(groups, 1):
                name = f"model-{i:05d}-of-{n:05d}.safetensors"
                save_file({k: tensors[k] for k in keys}, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({k: name for k in keys})
            index = {"metadata": {"total_size": sum(nbytes(a) for a in tensors.values())}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        for f in extra_files:
            shutil.copy2(f, tmp / Path(f).name)
        if check is not None:
            check(tmp)
    return dest
