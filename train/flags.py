"""The trainer's command line: `--preset`, `--config FILE` and dotted flags, parsed into a
`train.config.TrainConfig` and checked (`train.checks.validate`).

Precedence (later wins): the dataclass defaults < the preset (`--preset NAME`) < the file
(`--config FILE`, nested keys as in `to_dict`) < command-line flags (`--optim.lr 3e-4`).
Flags are parsed by tyro (typed, `--help` lists every field with its default and the comment
below it); unknown names, in a flag or in the file, are refused first with one line naming
them and the closest valid names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import json
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from peagle_jax.runtime.command_line import UsageError, one_line
from train.checks import validate
from train.config import PRESETS, TrainConfig
from train.init_head import adopt_head

__all__ = ["parse_args", "from_dict", "apply_dict", "field_names", "field_types", "read_file", "PROG"]


def field_types(cls=TrainConfig, prefix: str = "") -> dict[str, Any]:
    """Every settable dotted name (nested dataclasses flattened) and its type."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out.update(field_types(t, prefix + f.name + "."))
        else:
            out[prefix + f.name] = t
    return out


def field_names(cls=TrainConfig, prefix: str = "") -> list[str]:
    return list(field_types(cls, prefix))


def _suggest(name: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    if not close:  # a right leaf under a wrong section, or the reverse
        leaf = name.rsplit(".", 1)[-1]
        close = [v for v in valid if v.rsplit(".", 1)[-1] == leaf][:3]
    return f" (did you mean: {', '.join(close)}?)" if close else ""


_EXPECTED = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}


def _convert(value, tp, where: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # `int | None`, `int | str`: the first member that takes it
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            return _convert(value, members[0], where)
        for member in members:
            with contextlib.suppress(UsageError):
                return _convert(value, member, where)
        wanted = " or ".join(_EXPECTED.get(m, getattr(m, "__name__", str(m))) for m in members)
        raise UsageError(f"{where}: expected {wanted}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            value = [value]
        return tuple(_convert(v, args[0], where) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UsageError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UsageError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer past float's range (a JSON number of 400 digits)
                raise UsageError(
                    f"{where}: expected a finite number, got an integer of {len(str(value))} digits"
                ) from None
        raise UsageError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise UsageError(f"{where}: expected a string, got {value!r}")
    return value


def apply_dict(cfg, data: dict, where: str = "config", prefix: str = ""):
    """A copy of `cfg` with the nested `data` applied; unknown keys raise one-line UsageError."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: {prefix.rstrip('.') or 'top level'} must be a mapping")
    hints = typing.get_type_hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}
    changes = {}
    for key, value in data.items():
        if key not in names:
            raise UsageError(
                f"{where}: unknown field {prefix + str(key)!r}" + _suggest(prefix + str(key), field_names())
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            changes[key] = apply_dict(getattr(cfg, key), value, where, prefix + key + ".")
        else:
            changes[key] = _convert(value, tp, f"{where}: {prefix + key}")
    return dataclasses.replace(cfg, **changes)


def from_dict(data: dict, where: str = "config") -> TrainConfig:
    return apply_dict(TrainConfig(), data, where)


def read_file(path: str) -> dict:
    if not path.strip():
        raise UsageError("--config must name a YAML or JSON file, got ''")
    p = Path(path)
    try:
        if not p.is_file():
            raise UsageError(f"--config {path}: " + ("not a file" if p.exists() else "no such file"))
        text = p.read_text()
    except (OSError, ValueError) as e:  # unreadable, not text (UnicodeDecodeError), a NUL in the name
        raise UsageError(f"--config {path}: cannot read it: {one_line(e)}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error becomes one line
        raise UsageError(f"--config {path}: cannot parse: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: the top level must be a mapping of fields")
    return data


# ---------------------------------------------------------------------------------------
# command line
def _pop(argv: list[str], flag: str) -> str | None:
    """The value of `flag` (its last occurrence, as tyro reads it), None when absent."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _check_flags(argv: Sequence[str]) -> None:
    valid = field_names()
    for a in argv:
        if not a.startswith("--") or a in ("--help",):
            continue
        name = a[2:].split("=", 1)[0].replace("-", "_")
        if name.startswith("no_"):
            name = name[3:]
        if name not in valid:
            raise UsageError(
                f"unknown option --{a[2:].split('=', 1)[0]}"
                + _suggest(name, valid).replace("(did you mean: ", "(did you mean: --").replace(", ", ", --")
            )


PROG = "python -m train"  # the usage line's command (tyro would print the path of train/__main__.py)


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """TrainConfig from a command line (see the module docstring). Raises UsageError;
    `--help` prints the fields with the defaults of `--preset` and `--config` when given, and
    exits (SystemExit 0)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = "-h" in argv or "--help" in argv
    _check_flags(["--help"] if wants_help else argv)
    preset = _pop(argv, "--preset")
    preset = "default" if preset is None else preset
    if preset not in PRESETS:
        raise UsageError(
            f"unknown preset {preset!r}" + _suggest(preset, list(PRESETS)) + f" (presets: {', '.join(PRESETS)})"
        )
    base = from_dict(PRESETS[preset](), f"preset {preset}")
    base = dataclasses.replace(base, preset=preset)
    file = _pop(argv, "--config")
    given = _flag_names(argv)  # what the user set, not the preset: model.init_head's settings give way only to these
    if file is not None:
        data = read_file(file)
        base = apply_dict(base, data, f"--config {file}")
        base = dataclasses.replace(base, config=file)
        given |= _dotted(data)
    if wants_help:  # the defaults shown are the preset's and the file's; other flags are not parsed
        argv = ["--help"]
    import tyro

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            cfg = tyro.cli(
                TrainConfig,
                prog=PROG,
                default=base,
                args=_bool_words(argv),
                config=(tyro.conf.FlagConversionOff,),
                description="Train a P-EAGLE (or EAGLE-3, or DFlash) drafter head for a Hugging Face target.",
            )
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise UsageError(_box_message(errors.getvalue())) from None
    cfg = validate(cfg)  # train.checks
    return validate(adopt_head(cfg, given)) if cfg.model.init_head is not None else cfg


def _flag_names(argv: Sequence[str]) -> set[str]:
    """The dotted fields a command line sets ("--model.num-layers 2" -> "model.num_layers")."""
    return {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}


def _dotted(data: dict, prefix: str = "") -> set[str]:
    """The dotted fields a --config file's nested mapping sets."""
    out = set()
    for key, value in data.items():
        name = prefix + str(key)
        out |= _dotted(value, name + ".") if isinstance(value, dict) else {name}
    return out


_BOOLS = {"true": "True", "yes": "True", "1": "True", "false": "False", "no": "False", "0": "False"}


def _bool_words(argv: list[str]) -> list[str]:
    """tyro takes True/False; the docs and YAML habits write true/false."""
    bools = {"--" + n for n, t in field_types().items() if t is bool}
    out = []
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if eq and flag in bools:
            a = f"{flag}={_BOOLS.get(value.lower(), value)}"
        elif i > 0 and argv[i - 1] in bools:
            a = _BOOLS.get(a.lower(), a)
        out.append(a)
    return out


def _box_message(text: str) -> str:
    """The message of tyro's error, as one line. On a terminal (and through a pipe) tyro draws a
    box, its title in the top border; where its console decides otherwise (under pytest's capture)
    the title is a plain line over a rule of '-'. The message ends at the next rule."""
    lines = [ln.strip().strip("│╭╮╰╯").strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    rule = lambda ln: set(ln) <= set("─-")
    if lines and lines[0].startswith("─"):  # the box's top border, with the title
        lines = lines[1:]
    elif len(lines) > 1 and rule(lines[1]):  # a plain title line and its rule
        lines = lines[2:]
    body = []
    for ln in lines:
        if rule(ln) or ln.startswith("─"):
            break
        body.append(ln)
    message = " ".join(body).replace(" .", ".")
    if message.endswith(":"):  # what tyro lists after it was an empty argument ('')
        message += " ''"
    return f"invalid command line: {message or 'see --help'}"
