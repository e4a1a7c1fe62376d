"""The names a training configuration holds, checked before any work starts (`train.checks.validate`
runs `path_checks`): empty names, files where folders are read or written, unwritable folders,
an --out that is another tool's or model's folder, names that are neither a folder, a preset,
an asset nor a Hub id."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path


def path_checks(cfg) -> list[tuple[bool, str]]:
    """Names that cannot be right whatever the run does: empty ones (the current folder), a file
    where a folder is written or read, an evaluation prompt set that is neither known nor a file."""
    m, d, e = cfg.model, cfg.data, cfg.eval
    out = [
        (cfg.out.strip() != "", "--out must name a folder, got ''"),
        (m.target.strip() != "", "model.target must not be empty (a Hugging Face folder, an asset name, or tiny)"),
        (d.source.strip() != "", "data.source must not be empty (sharegpt, synthetic, or a file or folder)"),
        (d.cache_features is None or d.cache_features.strip() != "", "data.cache_features must not be empty"),
        (
            m.init_head is None or m.init_head.strip() != "",
            "model.init_head must not be empty (a head's folder or Hub id)",
        ),
    ]
    if not all(ok for ok, _ in out):
        return out
    out += _written_folder_checks(cfg)
    out += [
        (
            not _a_file_target(m.target),
            f"model.target {m.target}: a file, not a folder (a Hugging Face folder, an asset name, or tiny)",
        ),
        (
            _named_target(m.target) or (m.load_format == "dummy" and _preset(m.target)),
            f"model.target {m.target}: no such folder, nor an asset name, a Hub id (org/name) or tiny"
            + (", nor a preset" if m.load_format == "dummy" else " (a preset needs --model.load_format dummy)"),
        ),
        _init_head_check(m.init_head),
        (
            _named_source(d.source),
            f"data.source {d.source}: no such file or folder, nor sharegpt, synthetic or a Hub dataset id (org/name)",
        ),
    ]
    # one check per Hub-only flag, so the error names the flag that was given
    out += [
        (
            value is None or _a_hub_source(d.source),
            f"data.{name} {value}: picks a part of a Hub dataset; data.source {d.source} is not a Hub id "
            "(org/name, with no local file or folder of that name)",
        )
        for name, value in (("split", d.split), ("subset", d.subset), ("revision", d.revision))
    ]
    if e.enabled:
        out.append(
            (
                _prompts_ok(e.prompts),
                f"eval.prompts {e.prompts!r}: neither mtbench, humaneval, synthetic nor an existing JSONL file",
            )
        )
    return out


def _written_folder_checks(cfg) -> list[tuple[bool, str]]:
    """The folders the run writes (--out, data.cache_features): folders or missing, writable, and
    --out no head's or model's folder."""
    d = cfg.data
    out = [
        (_kind(cfg.out) in ("dir", "missing"), f"--out {cfg.out}: exists and is not a folder"),
        (
            d.cache_features is None or _kind(d.cache_features) in ("dir", "missing"),
            f"data.cache_features {d.cache_features}: exists and is not a folder",
        ),
    ]
    if not all(ok for ok, _ in out):
        return out
    foreign = foreign_out(cfg.out)
    out.append((foreign is None, f"--out {cfg.out}: {foreign}"))
    for flag, folder in (("--out", cfg.out), ("data.cache_features", d.cache_features)):
        why = folder is not None and _unwritable_folder(folder)
        out.append((not why, f"{flag} {folder}: {why}"))
    return out


def foreign_out(out: str) -> str | None:
    """What an existing --out holds when it is no training run's folder: a drafter head (this
    project's format, vLLM, speculators) or a model (a config.json that is not a run's), which a
    run would write into (its config.json replaced by the run's). None: a new folder, an empty
    one, a run's, or one without a config.json."""
    from peagle_jax.formats.head_config import head_kind, is_run_config

    p = Path(out)
    if _kind(out) != "dir":
        return None
    kind = head_kind(p)
    if kind is None and (p / "config.json").is_file():
        try:
            raw = json.loads((p / "config.json").read_text())
        except (OSError, ValueError):
            raw = None
        if is_run_config(raw):
            return None
        if not (isinstance(raw, dict) and ("model_type" in raw or "architectures" in raw)):
            return "holds a config.json that is not a training run's (a run writes its own there): give a new folder"
        kind = "a Hugging Face model folder"
    if kind is None:
        return None
    return f"{kind}, not a training run's (a run writes its own config.json there): give a new folder"


def _unwritable_folder(path: str) -> str | None:
    """Why the run cannot write into folder `path` (made when missing), None when it can."""
    from peagle_jax.runtime.folders import unwritable

    p = Path(path)
    try:
        if p.is_dir():  # written into, not beside
            return None if os.access(p, os.W_OK | os.X_OK) else f"folder {p} is not writable"
        return unwritable(p, "folder")
    except (OSError, ValueError):  # a name the system refuses (too long, a NUL byte): the run's own error names it
        return None


def _kind(path: str, expand: bool = False) -> str:
    """dir, file, other (a device, a socket ...) or missing; a name the system refuses (too long,
    a NUL byte) is missing here, and the run's own error names it. `expand`: ~ is the home folder."""
    try:
        p = Path(path).expanduser() if expand else Path(path)
        return "dir" if p.is_dir() else "file" if p.is_file() else "other" if p.exists() else "missing"
    except (OSError, ValueError, RuntimeError):  # RuntimeError: ~user of no such user
        return "missing"


def _a_file_target(target: str) -> bool:
    if target == "tiny" or _kind(target) in ("dir", "missing"):
        return False
    from peagle_jax.sources.assets import ASSETS

    return target not in ASSETS


def _named_target(target: str) -> bool:
    """What `train.loop.resolve_target` can find: tiny, an asset, a path, or a Hub id to download."""
    from peagle_jax.sources.assets import ASSETS
    from peagle_jax.sources.hub import is_repo_id

    named = target == "tiny" or target in ASSETS or _kind(target) != "missing" or is_repo_id(target)
    return named or _refused_name(target)


def _preset(target: str) -> bool:
    """A preset target (`peagle_jax.models.presets`): shapes only, which dummy weights can fill."""
    from peagle_jax.models.presets import preset_fields

    return preset_fields(target) is not None


def _init_head_check(name: str | None) -> tuple[bool, str]:
    """model.init_head names a folder (its head is read once the flags are) or a Hub id."""
    from peagle_jax.sources.hub import is_repo_id

    kind = "missing" if name is None else _kind(name)
    if name is None or kind == "dir" or (kind == "missing" and is_repo_id(name)):
        return True, ""
    why = "a file, not a head's folder" if kind == "file" else "no such folder, nor a Hub id (org/name)"
    return False, f"model.init_head {name}: {why}"


def _named_source(source: str) -> bool:
    """What `train.data.load_conversations` reads: the two built-in sets, a path, or a Hub dataset id."""
    from train.data import hub_source

    named = source in ("sharegpt", "synthetic") or _kind(source) != "missing" or hub_source(source)
    return named or _refused_name(source)


def _refused_name(path: str) -> bool:
    """A name the system refuses (too long, a NUL byte): left to the run, whose error names it."""
    try:
        os.stat(path)
    except ValueError:  # a NUL byte
        return True
    except OSError as err:
        return err.errno == errno.ENAMETOOLONG
    return False


def _a_hub_source(source: str) -> bool:
    from train.data import hub_source

    return _kind(source) == "missing" and hub_source(source)


def _prompts_ok(prompts: str) -> bool:
    """What `train.loop` evaluates on: synthetic, a set of `peagle_jax.engine.prompts.load_prompts`, a file."""
    from peagle_jax.engine import PROMPT_SETS

    if prompts == "synthetic" or prompts.lower().replace("-", "").replace("_", "") in PROMPT_SETS:
        return True
    return _kind(prompts, expand=True) == "file"
