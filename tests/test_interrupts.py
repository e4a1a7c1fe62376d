"""SIGINT and SIGTERM end `python -m train` and `python -m infer bench` with exit status 130 and
one line, whatever they are doing when the signal comes (loading, compiling, training, decoding;
both signals take one path, `peagle_jax.runtime.command_line.terminate_as_interrupt`, so each phase gets one):
never ignored (an interrupt that lands in a gc callback, where Python drops exceptions, is raised
again), never a crash at shutdown; an interrupted training run resumes from its last checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from in_process import run_module
from limits import HANG_S

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny target folder and a random head saved beside it (for the bench runs)."""
    import peagle_jax as pj
    from train.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("interrupts")
    target = build_tiny_target(root / "tiny-target")
    head = pj.new_drafter(pj.load_target(target, dtype="float32"), num_layers=1, k_train=4).save(root / "head")
    return target, head


ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def train_flags(out: Path, steps: int, target: Path | None = None) -> list[str]:
    flags = ["--preset", "tiny", "--out", str(out), "--loop.steps", str(steps), "--loop.checkpoint_every", "2"]
    flags += ["--eval.enabled", "false", "--loop.progress", "false"]
    if target is not None:
        flags += ["--model.target", str(target)]
    return flags


def train_command(out: Path, steps: int, target: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "train", *train_flags(out, steps, target)]


def catches(pid: int, sig) -> bool:
    """The process has a handler for `sig` installed (/proc/PID/status SigCgt)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    return False


def interrupt(cmd: list[str], sig, ready, logs: Path) -> subprocess.CompletedProcess:
    """Run `cmd`, send `sig` once the CLI's handlers are installed and `ready(stderr so far)` holds
    (polled), wait for the end. The CLI's handlers are up when SIGTERM is caught (`terminate_as_interrupt`
    installs it after SIGINT): Python catches SIGINT from its own start, before the CLI's handler,
    so SIGINT's bit alone would send the signal into the interpreter's start-up."""
    err_path = logs / "stderr.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=err, text=True)
        deadline = time.monotonic() + HANG_S
        while proc.poll() is None and time.monotonic() < deadline and not catches(proc.pid, signal.SIGTERM):
            time.sleep(0.01)
        while not ready(err_path.read_text()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the command ended before the signal was sent"
        proc.send_signal(sig)
        proc.wait(timeout=HANG_S)
    return subprocess.CompletedProcess(cmd, proc.returncode, "", err_path.read_text())


def assert_interrupted(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 130, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [errors[0]], res.stderr[-3000:]
    assert "interrupted" in errors[0]
    assert "Traceback" not in res.stderr


def metrics_lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_train_interrupted_while_compiling(tmp_path, tiny_run, name="SIGTERM"):
    out = tmp_path / "run"
    cmd = train_command(out, steps=200, target=tiny_run[0])
    res = interrupt(cmd, SIGNALS[name], lambda _: (out / "config.json").exists(), tmp_path)  # loading, compiling
    assert_interrupted(res)
    assert not (out / "vllm").exists()


def test_train_interrupted_while_training_resumes(tmp_path, tiny_run, name="SIGINT"):
    out = tmp_path / "run"
    cmd = train_command(out, steps=120, target=tiny_run[0])
    res = interrupt(cmd, SIGNALS[name], lambda _: metrics_lines(out) >= 3, tmp_path)
    assert_interrupted(res)
    checkpoints = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    again = run_module("train", train_flags(out, steps=checkpoints[-1] + 2, target=tiny_run[0]))
    assert again.returncode == 1  # loop.steps changed: refused, naming it
    assert "loop.steps" in again.stderr
    resumed = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=HANG_S)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == checkpoints[-1]
    assert [
        json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln
    ] == list(range(1, 121))


BENCH_PHASES = {"loading": "[infer] loading", "compiling": "warm-up (plain", "decoding": "bench b="}
BENCH_CASES = [("SIGINT", "loading"), ("SIGTERM", "compiling"), ("SIGINT", "decoding")]


@pytest.mark.parametrize("name,phase", BENCH_CASES, ids=["-".join(c) for c in BENCH_CASES])
def test_infer_bench_interrupted(tmp_path, tiny_run, name, phase):
    target, head = tiny_run
    cmd = [sys.executable, "-m", "infer", "bench", "--target", str(target), "--drafter", str(head), "--k", "1,2,3"]
    cmd += ["--prompts", "mtbench", "--limit", "24", "--max-new-tokens", "64", "--json", str(tmp_path / "b.json")]
    res = interrupt(cmd, SIGNALS[name], lambda err: BENCH_PHASES[phase] in err, tmp_path)
    assert_interrupted(res)
    assert not (tmp_path / "b.json").exists()


def after(delay: float):
    """A `ready` that holds `delay` seconds after its first call (the first poll once the CLI's
    handlers are installed), whatever the machine's speed before that."""
    start: list[float] = []

    def ready(_stderr: str) -> bool:
        if not start:
            start.append(time.monotonic())
        return time.monotonic() - start[0] >= delay

    return ready


STARTUP_DELAYS = (0.25, 0.5)  # after the CLI installed its handlers: while it imports its libraries


@pytest.mark.parametrize("delay", STARTUP_DELAYS)
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_interrupted_while_importing(tmp_path, tiny_run, name, delay):
    """An interrupt during the first second (imports: an interrupt inside an extension's
    initialisation would otherwise surface as an ImportError) is still exit 130 and one line;
    the trainer's says it wrote nothing, and its OUT was never made."""
    target, _ = tiny_run
    out = tmp_path / f"out-{delay}"
    for cmd in (
        [sys.executable, "-m", "infer", "generate", "--target", str(target), "--prompt-ids", "1,2", "--mode", "none"],
        train_command(out, 4, target),
    ):
        res = interrupt(cmd, SIGNALS[name], after(delay), tmp_path)
        assert_interrupted(res)
    assert "error: interrupted while starting: nothing was written" in res.stderr
    assert not out.exists()


STARTING_CLIS = {  # the other command lines, interrupted while they import JAX
    "convert": ["-m", "peagle_jax.formats.convert", "inspect", "{tmp}"],
    "peagle-convert": ["-c", "import sys; from peagle_jax.convert import main; sys.exit(main(['inspect', '{tmp}']))"],
    "plan": ["-m", "peagle_jax.plan", "--target", "Llama-3.1-8B", "--device", "h100", "--layers", "3"],
}


@pytest.mark.parametrize("cli", list(STARTING_CLIS))
def test_every_cli_interrupted_while_starting(tmp_path, cli):
    """Their handlers go in before their imports (the converter's package loads nothing): a
    SIGTERM caught at once is exit 130 and one line, not a process killed by the signal (-15)."""
    cmd = [sys.executable, *(a.replace("{tmp}", str(tmp_path)) for a in STARTING_CLIS[cli])]
    res = interrupt(cmd, signal.SIGTERM, after(0.0), tmp_path)
    assert_interrupted(res)


@pytest.mark.parametrize(
    "module",
    [
        "train.__main__",
        "infer.__main__",
        "peagle_jax.formats",
        "peagle_jax.convert",
        "peagle_jax.plan",
        "peagle_jax.sources.assets",
    ],
)
def test_a_command_line_loads_no_library_before_its_handlers(module):
    """What runs before a command's `main` installs its handlers (its module and the packages
    above it) imports none of JAX, torch, transformers: an interrupt there (seconds of imports)
    would be a traceback or a process killed by SIGTERM."""
    code = f"import importlib, sys; importlib.import_module({module!r}); "
    code += "print([m for m in ('jax', 'torch', 'transformers', 'flax') if m in sys.modules])"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=HANG_S
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


SLOW_IMPORT = """
import sys
from peagle_jax.runtime.command_line import run

def parse(argv):
    print("importing", file=sys.stderr, flush=True)
    import slow_library  # noqa: F401
    return argv

sys.exit(run([], parse, lambda args: print("worked")))
"""


def test_interrupt_ends_start_up_at_once(tmp_path):
    """An interrupt that lands inside an import while a command starts ends the process at once:
    it used to wait for the import to return (seconds for JAX, torch, transformers; here until
    the import's sleep ends) and only then unwind."""
    (tmp_path / "slow_library.py").write_text("import time\ntime.sleep(600)\nprint('imported', flush=True)\n")
    (tmp_path / "cmd.py").write_text(SLOW_IMPORT)
    err_path = tmp_path / "stderr.txt"
    env = {**ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    with err_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "cmd.py")], env=env, stdout=subprocess.PIPE, stderr=err)
        deadline = time.monotonic() + HANG_S
        while "importing" not in err_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # inside the import's sleep
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=HANG_S)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, "", err_path.read_text())
    assert_interrupted(res)
    assert b"imported" not in stdout and b"worked" not in stdout
