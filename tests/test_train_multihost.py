"""The trainer over two processes on localhost through jax.distributed (CPU collectives: gloo),
4 simulated CPU devices each, one (2,2,2) mesh over the 8: it trains the same 3 steps as one
device in one process (losses and the trained head within 1e-5), process 0 alone writes and
evaluates, and a process killed mid-run makes the other exit with an error instead of hanging."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import train_runs
import xla_env
from limits import HANG_S

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(target, out, port: int, extra=(), kill_after: dict | None = None) -> list[subprocess.Popen]:
    """The two processes; kill_after {process: step}: that process kills itself after that step."""
    procs = []
    for i in range(2):
        env = {**xla_env.simulated_devices(4), "PYTHONPATH": str(ROOT)}
        kill = (kill_after or {}).get(i)
        program = ["-m", "train"] if kill is None else [str(ROOT / "tests" / "programs" / "train_killed.py"), str(kill)]
        argv = train_runs.flags(target, out, (2, 2, 2)) + [
            "--dist.coordinator",
            f"localhost:{port}",
            "--dist.num_processes",
            "2",
            "--dist.process_id",
            str(i),
            *extra,
        ]
        procs.append(
            subprocess.Popen(
                [sys.executable, *program, *argv],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def finish(procs, timeout: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


# the final speculative evaluation (process 0 alone, on its own copy of the target) doubles the
# run's compile time: checked in `make test-slow`
@pytest.mark.parametrize("evaluate", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_two_processes_train_like_one(tmp_path_factory, evaluate):
    target, ref = train_runs.reference(str(tmp_path_factory.getbasetemp() / "train-reference"))
    out = tmp_path_factory.mktemp("multihost") / "out"
    procs = launch(target, out, free_port(), extra=["--eval.enabled", str(evaluate)])
    (rc0, so0, se0), (rc1, so1, se1) = finish(procs, timeout=HANG_S)
    assert rc0 == 0, se0[-4000:]
    assert rc1 == 0, se1[-4000:]
    assert "head:" in so0 and "head:" not in so1  # process 0 reports, writes and exports
    train_runs.assert_same_run(out, ref)
    summary = json.loads((out / "summary.json").read_text())
    if evaluate:
        assert summary["eval"]["identical_to_greedy"] == 1.0
    else:
        assert "eval" not in summary or not summary["eval"]
    config = json.loads((out / "config.json").read_text())
    assert config["dist"]["num_processes"] == 2 and config["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}


def test_lost_process_stops_the_other_with_an_error(tmp_path_factory):
    target, _ = train_runs.reference(str(tmp_path_factory.getbasetemp() / "train-reference"))
    out = tmp_path_factory.mktemp("multihost-kill") / "out"
    # process 1 is SIGKILLed after its first step; process 0 then waits on it in the second step
    procs = launch(
        target,
        out,
        free_port(),
        extra=["--dist.heartbeat_timeout", "5"],
        kill_after={1: 1},
    )
    ((rc1, _, _),) = finish(procs[1:], timeout=HANG_S)
    assert rc1 == -9  # the kill
    # the survivor stops by itself (heartbeat timeout 5 s) rather than waiting on its peer forever
    ((rc0, _, se0),) = finish(procs[:1], timeout=HANG_S)
    assert rc0 != 0, se0[-3000:]
    assert "another task died" in se0 or "stopped sending heartbeats" in se0, se0[-3000:]
