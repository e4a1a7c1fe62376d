"""A property-based fuzz of `python -m train`'s flags (hypothesis): command lines mixing valid and
hostile values (inf, nan, -1, 0, huge integers, 1e309, '', non-numbers, files where folders go)
for `--model.*`, `--data.*`, `--optim.*`, `--loop.*` and `--eval.*`.

Properties: `train.__main__.main` never raises (a traceback) and returns 0, 1 or 2; a refused
command line is one `error:` line on stderr (exit 2); a failed run ends in one `error:` line
(exit 1); a run that succeeds (exit 0) logged only finite losses.

`test_flags_parse_or_are_refused_in_one_line` goes through main's whole command-line path with the
training replaced by a stub (nothing is trained or written); `test_tiny_runs_*` train the tiny
preset for a step or two on cheap flags (optimizer values, seeds, COD ratios, time budget)."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
import typing
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from in_process import run_module

import train.__main__ as entry
from train import config as C
from train import flags as F
from train.checks import FLOAT32_MAX, INT_MAX

SECTIONS = ("model", "data", "optim", "loop", "eval")
FIELDS = {name: tp for name, tp in F.field_types().items() if name.split(".", 1)[0] in SECTIONS}

# Placeholders of paths made by the fixture (hypothesis draws plain strings)
FILE, DIR, MISSING = "@FILE", "@DIR", "@MISSING"

HOSTILE = [
    "inf", "-inf", "nan", "NaN", "-1", "0", "-0", "1e309", "-1e309", "1e300", "1e39", "5e-324", "",
    str(2**31), str(2**63), str(10**30), "9" * 400, "1.5", "1e3", "0x10", "1_000", " 7", "٣", "²", "abc",
    "None", "true", "auto", "-", "--", "-h", "x" * 300, FILE, DIR, MISSING,
]  # fmt: skip
CHOICES = [
    "parallel", "chain", "float32", "bfloat16", "auto", "kernels", "dense", "chat", "plain", "truncate",
    "drop", "skip", "error", "synthetic", "sharegpt", "mtbench", "humaneval", "tiny", "adamw", "muon", "cosine",
    "linear",
]  # fmt: skip

ints = st.one_of(st.integers(-3, 70), st.integers(-(2**70), 2**70)).map(str)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.floats(0, 2).map(str))
texts = st.text(max_size=12)
hostile = st.sampled_from(HOSTILE)
bools = st.sampled_from(["true", "false", "True", "no", "1", "0", "maybe", ""])


def _values(tp) -> st.SearchStrategy[list[str]]:
    """The values (one token or several: a tuple) drawn for a field of type `tp`."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        return st.lists(st.one_of(ints, hostile), max_size=3)
    if args:  # a union: `int | None`, `str | None`, `int | str`
        return st.one_of(*(_values(a) for a in args if a is not type(None)), st.just(["None"]))
    one = {bool: bools, int: ints, float: floats, str: st.one_of(st.sampled_from(CHOICES), texts)}[tp]
    return st.one_of(one, hostile).map(lambda v: [v])


@st.composite
def flag_pairs(draw, fields: dict) -> list[str]:
    """A flag and its value(s), as `--a.b v`, `--a.b=v`, `--a-b v` or the flag alone."""
    name = draw(st.sampled_from(sorted(fields)))
    values = draw(_values(fields[name]))
    flag = "--" + (name.replace("_", "-") if draw(st.booleans()) else name)
    form = draw(st.sampled_from(["space", "space", "space", "equals", "alone"]))
    if form == "alone":
        return [flag]
    if form == "equals" and len(values) == 1:
        return [f"{flag}={values[0]}"]
    return [flag, *values]


def command_lines(fields: dict = FIELDS, max_flags: int = 5):
    preset = st.sampled_from([[], ["--preset", "tiny"]])
    flags = st.lists(flag_pairs(fields), min_size=1, max_size=max_flags).map(lambda xs: [t for x in xs for t in x])
    return st.tuples(preset, flags).map(lambda t: t[0] + t[1])


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fuzz-paths")
    (root / "a-file").write_text("not a dataset\n")
    (root / "a-dir").mkdir()
    return {FILE: str(root / "a-file"), DIR: str(root / "a-dir"), MISSING: str(root / "missing")}


def _resolve(argv: list[str], paths: dict[str, str]) -> list[str]:
    out = []
    for a in argv:
        for k, v in paths.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def _main(argv: list[str], stub=None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of main(argv); the training replaced by `stub` when given."""
    with mock.patch.object(entry, "train", stub) if stub else contextlib.nullcontext():
        res = run_module("train", argv)
    return res.returncode, res.stdout, res.stderr


def _names_its_flag(line: str, argv: list[str]) -> bool:
    """A refusal names a flag (dotted, with _ or -) or a token of the command line."""
    norm = line.replace("-", "_")
    flags = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}
    return any(f and f in norm for f in flags) or any(a and a in line for a in argv)


def _assert_one_error_line(err: str, argv) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, (argv, err)
    return lines[0]


IN_THE_STEP = {  # float32 there
    "optim.lr", "optim.weight_decay", "optim.clip", "optim.norm_lr_scale", "optim.muon_weight_decay", "loop.chain_decay",
}  # fmt: skip


def _check_parsed(cfg) -> None:
    """What a command line that parses hands to the training: finite values in range, and a
    config.json (what a resume compares) that reads back the same."""
    assert F.from_dict(C.to_dict(cfg)) == cfg
    for section in SECTIONS:
        part = getattr(cfg, section)
        for name, value in vars(part).items():
            for v in value if isinstance(value, tuple) else (value,):
                if isinstance(v, float):
                    assert math.isfinite(v), (section, name, v)
                    assert f"{section}.{name}" not in IN_THE_STEP or abs(v) <= FLOAT32_MAX, (section, name, v)
                elif isinstance(v, int) and not isinstance(v, bool):
                    assert v <= INT_MAX, (section, name, v)
                elif isinstance(v, str):
                    assert name != "segments" or v == "auto" or int(v) >= 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=command_lines())
def test_flags_parse_or_are_refused_in_one_line(argv, paths):
    argv = _resolve(argv, paths)
    handed = []
    rc, out, err = _main(argv, stub=lambda cfg, hooks=(): handed.append(cfg) or 0)
    assert rc in (0, 2), (argv, rc, err)
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
        assert _names_its_flag(lines[0], argv), (argv, lines[0])
        assert not handed
    elif handed:
        assert err == "", (argv, err)
        _check_parsed(handed[0])
    else:  # -h / --help among the values
        assert "-h" in argv or "--help" in argv, (argv, err)
        assert out.startswith("usage: python -m train"), out[:200]


# ---------------------------------------------------------------------------------------
# runs of the tiny preset: flags that change neither the shapes nor the length of a run much,
# drawn mostly from the values a run takes (edges included: a denormal or a huge learning rate,
# a clip of 1e-30, a time budget of 1e-9 s), sometimes hostile (refused: exit 2)
EDGES = {
    "optim.lr": ["3e-3", "5e-324", "1e-30", "1e30", "3.4e38"],
    "optim.warmup_steps": ["0", "1", str(2**31 - 1)],
    "optim.min_lr_ratio": ["0", "0.5", "1"],
    "optim.b1": ["0", "0.9", "0.9999999"],
    "optim.b2": ["0", "0.95", "0.9999999"],
    "optim.weight_decay": ["0", "0.01", "1e30"],
    "optim.clip": ["1e-30", "0.5", "1e30"],
    "optim.norm_lr_scale": ["0", "1", "1e30"],
    "data.cod_r": ["1e-300", "0.5", "1"],
    "data.cod_r_min": ["0", "0.5", "1"],
    "data.seed": ["0", "7", str(2**32 - 1)],
    "model.seed": ["0", "7", str(2**32 - 1)],
    "loop.max_seconds": ["0", "1e-9", "1e308"],
    "loop.per_depth_loss": ["true", "false"],
}
SLOW_EDGES = {
    **EDGES,
    "optim.optimizer": ["adamw", "muon"],
    "optim.schedule": ["cosine", "linear"],
    "optim.muon_momentum": ["0", "0.95", "0.9999999"],
    "optim.muon_weight_decay": ["0", "0.1", "1e30"],
    "loop.eval_every": ["0", "1"],
}
RUN_BASE = ["--preset", "tiny", "--eval.enabled", "false", "--loop.progress", "false"]
NO_HELDOUT = ["--data.heldout", "0"]  # the held-out loss compiles its own step: 4 s a run on 2 cores


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> str:
    from train.tiny import build_tiny_target

    return str(build_tiny_target(tmp_path_factory.mktemp("fuzz-tiny") / "target"))


def _check_run(argv: list[str], target: str, paths: dict[str, str], base: list[str] = RUN_BASE) -> int:
    """The exit status of the tiny run of `argv`, its properties checked."""
    root = Path(tempfile.mkdtemp(prefix="fuzz-run-", dir=Path(paths[DIR]).parent))
    try:
        out = root / "out"
        full = [*base, "--model.target", target, "--out", str(out), *_resolve(argv, paths)]
        rc, stdout, err = _main(full)
        assert rc in (0, 1, 2), (full, rc, err)
        if rc == 0 and not out.exists():  # -h among the values
            assert "-h" in full and stdout.startswith("usage: python -m train"), (full, err)
        elif rc == 0:
            assert not [ln for ln in err.splitlines() if ln.startswith("error:")], err
            summary = json.loads((out / "summary.json").read_text())
            for key in ("first_loss", "final_loss"):
                assert summary[key] is None or math.isfinite(summary[key]), (full, summary)
            for rec in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
                for key in ("loss", "eval_loss", "grad_norm"):
                    assert key not in rec or math.isfinite(rec[key]), (full, rec)
        else:
            line = _assert_one_error_line(err, full)
            if rc == 2:
                assert _names_its_flag(line, full), (full, line)
        return rc
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_lines(edges: dict[str, list[str]], max_flags: int):
    edge = st.sampled_from(sorted(edges)).flatmap(lambda n: st.sampled_from(edges[n]).map(lambda v: [f"--{n}", v]))
    pair = st.one_of(edge, edge, edge, flag_pairs({n: FIELDS[n] for n in edges}))  # 1 in 4 hostile
    steps = st.sampled_from([["--loop.steps", "1"], ["--loop.steps", "2"]])
    flags = st.lists(pair, min_size=1, max_size=max_flags).map(lambda xs: [t for x in xs for t in x])
    return st.tuples(steps, flags).map(lambda t: t[0] + t[1])


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=_run_lines(EDGES, max_flags=3))
@example(argv=["--loop.steps", "2", "--optim.lr", "5e-324", "--optim.clip", "1e-30"])  # 0 in float32: refused, exit 2
@example(argv=["--loop.steps", "2", "--optim.lr", "1e30", "--optim.warmup_steps", "0"])  # a nan loss: exit 1
@example(argv=["--loop.steps", "1", "--optim.lr", "1e300"])  # inf in float32: refused, exit 2
def test_tiny_runs_end_in_0_1_or_2_and_finite_losses(argv, tiny_target, paths):
    _check_run(argv, tiny_target, paths, [*RUN_BASE, *NO_HELDOUT])


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=_run_lines(SLOW_EDGES, max_flags=5))
@example(argv=["--loop.steps", "2", "--optim.optimizer", "muon", "--optim.muon_weight_decay", "1e30"])
def test_tiny_runs_many(argv, tiny_target, paths):
    _check_run(argv, tiny_target, paths)
