"""`python -m peagle_jax.plan` end to end, as a user runs it (a subprocess of this venv's Python):
a folder holding only config.json planned on a v5e-8, a program that compiles but passes the
memory share a plan allows (exit 1), the compiler's refusal of a cache that cannot fit, flags it
cannot use (exit 2, one line naming the flag), and an interrupt in the middle of a compile."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from limits import HANG_S

from peagle_jax.models.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
DECODE = ["--device", "v5e-8", "--job", "serve", "--layers", "3", "--modes", "none"]


def plan(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "peagle_jax.plan", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_a_config_only_folder_compiles_and_fits(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["Llama-3.1-8B"]))
    out = tmp_path / "plan.json"
    done = plan("--target", str(tmp_path), *DECODE, "--cache-len", "2048", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    (program,) = json.loads(out.read_text())["programs"]
    assert program["compiled"] is True and program["fits"] is True
    assert {"argument_bytes", "temp_bytes", "output_bytes", "peak_bytes", "headroom_bytes"} <= set(program)
    assert 0 < program["peak_bytes"] < program["device_memory_bytes"]
    assert program["headroom_bytes"] == program["device_memory_bytes"] - program["peak_bytes"]
    assert "compiled serve/decode step" in done.stdout
    assert "v5e-8: 8 x v5e, 16.0 GiB each;" in done.stdout  # one host, as Cloud TPU's v5e-8 machine
    est = program["estimate"]  # a decode step at batch 1 reads its weights: memory-bound
    assert est["bound"] == "memory" and est["flops"] == program["flops"] / 8
    assert est["estimate_seconds"] == est["bytes"] / 8.19e11
    assert "estimate (roofline) >= " in done.stdout and "memory-bound" in done.stdout


@pytest.mark.parametrize("name, hosts", [("v5e-8", 1), ("v6e-8", 1), ("v5e-16", 4), ("v5p-8", 1), ("v5p-16", 2)])
def test_a_slice_compiles_on_the_hosts_cloud_tpu_gives_it(name, hosts):
    """libtpu lays a topology out as 2x2 chips a host unless told: a v5e-8 / v6e-8 (one 8-chip
    machine) would be planned as two hosts."""
    from peagle_jax.hardware.devices import parse_device, topology_devices

    device = parse_device(name)
    devices = topology_devices(device)
    assert device.hosts == hosts == len({d.process_index for d in devices}), name
    assert len(devices) == device.count


def test_a_program_that_compiles_but_does_not_fit_exits_1(tmp_path):
    out = tmp_path / "plan.json"
    done = plan("--target", "Llama-3.1-8B", *DECODE, "--cache-len", "2048", "--headroom", "0.001", "--json", str(out))
    assert done.returncode == 1, done.stderr[-2000:]
    (program,) = json.loads(out.read_text())["programs"]
    assert program["compiled"] is True and program["fits"] is False
    assert "compiled serve/decode step batch=1 cache=2048: DOES NOT FIT" in done.stdout


def test_a_cache_too_big_for_the_device_is_the_compilers_refusal(tmp_path):
    out = tmp_path / "plan.json"
    done = plan("--target", "Llama-3.1-8B", *DECODE, "--batch", "256", "--cache-len", "131072", "--json", str(out))
    assert done.returncode == 1
    (program,) = json.loads(out.read_text())["programs"]
    assert program["compiled"] is False and program["fits"] is False
    assert "RESOURCE_EXHAUSTED" in program["error"] and "\n" not in program["error"]
    (refused,) = [ln for ln in done.stdout.splitlines() if ln.startswith("REFUSED")]
    assert "decode step batch=256 cache=131072" in refused


@pytest.mark.parametrize(
    ("flag", "args"),
    [
        ("--device", ["--target", "Llama-3.1-8B", "--device", "h300"]),
        ("--target", ["--target", "no-such-model", "--device", "v5e-8"]),
        ("--layers", ["--target", "Llama-3.1-8B", "--device", "v5e-8", "--layers", "1"]),
        ("--headroom", ["--target", "Llama-3.1-8B", "--device", "v5e-8", "--headroom", "1.5"]),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(flag, args):
    done = plan(*args)
    assert done.returncode == 2
    (message,) = done.stderr.strip().splitlines()
    assert message.startswith("error:") and flag in message


def test_an_interrupt_in_the_middle_of_a_compile_ends_the_plan_at_once(tmp_path):
    """XLA compiles in native code, where Python runs no signal handler: the plan compiles on a
    worker thread, so SIGINT ends it (exit 130, one line, no JSON) while the compiler is still at
    work. The compiler's dumps tell where it was: the module before its passes is written, the
    optimized one never is (a compile on the main thread would finish first)."""
    dump, out = tmp_path / "xla", tmp_path / "plan.json"
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump}"}
    cmd = [sys.executable, "-m", "peagle_jax.plan", "--target", "Llama-3.1-8B", "--device", "h100", "--job", "train"]
    cmd += ["--layers", "3", "--modes", "parallel", "--json", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG_S
    while proc.poll() is None and time.monotonic() < deadline and not list(dump.glob("*before_optimizations.txt")):
        time.sleep(0.05)
    assert proc.poll() is None, "the plan ended before its compile began"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130
    assert [ln for ln in stderr.splitlines() if ln.startswith("error:")] == ["error: interrupted"]
    assert not list(dump.glob("*after_optimizations*")), "the compile ran to its end before the plan stopped"
    assert not out.exists()
