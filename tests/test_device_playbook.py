"""`python -m bench.device`, the device playbook: the --smoke run on CPU goes through every stage (kernels,
train_step, train_head, evaluate) and records each in results.json; a stage that fails or
overruns its budget is recorded and the next one still runs; usage errors exit 2; the TPU
kernel check runs interpreted. No test here depends on how fast this machine is: the smoke's
budget is far above what it needs, and the overrunning stage is one made to hang on purpose."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from limits import HANG_S

ROOT = Path(__file__).resolve().parents[1]
PLAYBOOK = [sys.executable, "-m", "bench.device"]
STAGES = ("kernels", "cost", "train_step", "train_head", "evaluate")


def _module(name: str = "device"):
    return importlib.import_module(f"bench.{name}")


def _playbook(out: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict | None, float]:
    """The --smoke run: ~85 s alone on a 2-core CPU; a budget of an hour, so that however loaded
    the machine is, the stages end by finishing their work, never by their budgets (the timeout
    is a hang guard only)."""
    t0 = time.monotonic()
    cmd = [*PLAYBOOK, "--smoke", "--out", str(out), "--minutes", "60", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    path = out / "results.json"
    return proc, json.loads(path.read_text()) if path.exists() else None, time.monotonic() - t0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("device") / "run"
    proc, res, wall = _playbook(out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, res, wall


@pytest.mark.slow  # the --smoke run of every stage: ~85 s of the 2-core CI
def test_smoke_runs_every_stage_and_records_it(smoke):
    out, res, wall = smoke
    print(f"device playbook --smoke: {res['seconds']} s recorded, {wall:.1f} s wall")
    for name in STAGES:
        stage = res["stages"][name]
        assert stage["status"] == "ok", (name, stage, (out / "logs" / f"{name}.log").read_text()[-3000:])
        assert stage["seconds"] > 0 and stage["timeout_s"] > 0, name
        assert stage["results"], name
        assert (out / stage["log"]).is_file()
    assert res["complete"] is True
    assert res["command"].startswith("python -m bench.device --smoke")
    assert res["device"]["platform"] == "cpu" and res["device"]["jax"]
    assert Path(res["head"]).is_dir() and (out / "head" / "vllm" / "config.json").is_file()
    assert sum(s["seconds"] for s in res["stages"].values()) <= res["seconds"]


@pytest.mark.slow  # the --smoke run of every stage: ~85 s of the 2-core CI
def test_smoke_results_hold_each_stages_numbers(smoke):
    _, res, _ = smoke
    st = res["stages"]
    assert all(r["status"] == "ok" for r in st["kernels"]["results"]["decode"]["decode"])
    step = st["train_step"]["results"]
    assert step["recipe"]["status"] == "ok" and step["recipe"]["step_s"] > 0
    by = {(r["variant"], r["tokens"]): r for r in step["rows"]}
    assert {("pallas", 64), ("xla", 64), ("pallas", 128)} <= set(by)  # 128: the doubling, up to the smoke cap
    for r in by.values():
        assert r["status"] == "ok" and r["step_ms"] > 0 and r["compile_s"] > 0 and r["tokens_per_second"] > 0
    # both variants start from one state on the same rows: on CPU both are the XLA path
    assert by["pallas", 64]["first_loss"] == pytest.approx(by["xla", 64]["first_loss"], rel=1e-4)
    assert step["longest_fits"] == {"pallas": 128, "xla": 64} and step["longest_fits_capped"] is True
    cost = st["cost"]["results"]
    assert {(r["mode"], r["k"]) for r in cost["rounds"]} == {("parallel", 3), ("chain", 3)}
    assert cost["load_format"] == "dummy" and cost["plain"][0]["step_ms"] > 0
    assert all(r["break_even_acceptance_length"] > 0 for r in cost["rounds"])
    head = st["train_head"]["results"]
    assert head["steps"] == 3 and head["train_tokens"] > 0 and head["tokens_per_second"] > 0
    ev = st["evaluate"]["results"]
    assert [r["k"] for r in ev["per_k"]] == [1, 2, 3]
    for r in ev["per_k"]:
        assert r["acceptance_length"] >= 1 and r["speedup"] > 0 and r["identical_greedy_outputs"] is True


def test_a_failed_stage_is_recorded_and_the_next_one_runs(tmp_path):
    proc, res, _ = _playbook(tmp_path / "run", "--fail-stage", "train_step", "--stages", "train_step,train_head")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    st = res["stages"]
    assert st["kernels"]["status"].startswith("skipped: not selected")
    assert st["train_step"]["status"] == "failed"
    assert "forced failure (--fail-stage train_step)" in st["train_step"]["error"]
    assert st["train_head"]["status"] == "ok" and st["train_head"]["results"]["steps"] == 3
    assert st["evaluate"]["status"].startswith("skipped")
    assert res["complete"] is True


def test_an_overrunning_stage_is_stopped_and_the_next_one_runs(tmp_path):
    """A stage made to hang is stopped at its budget and recorded as a timeout, and the next stage
    then starts with the time it was kept (the smoke split: each later stage's floor)."""
    mod = _module()
    argv = ["--smoke", "--out", str(tmp_path / "run"), "--stages", "kernels,train_step"]
    argv += ["--hang-stage", "kernels", "--fail-stage", "train_step"]
    run = mod.Run(mod.parse_args(argv), argv)
    run.path("logs").mkdir(parents=True)
    run.deadline = time.monotonic() + mod.SMOKE_FLOOR_S + 6  # kernels may run 6 s, train_step keeps its floor
    kernels, train_step = (mod.run_stage(run, name) for name in ("kernels", "train_step"))
    assert kernels["status"] == "timeout" and kernels["timeout_s"] == 6, kernels
    assert "timed out after 6 s" in kernels["error"]
    assert train_step["status"] == "failed", train_step  # it ran: its (forced) failure is recorded
    assert "forced failure (--fail-stage train_step)" in train_step["error"]


def test_a_hanging_stage_times_out_with_its_process_group(tmp_path):
    mod = _module()
    pid_file = tmp_path / "grandchild.pid"
    hang = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(86400)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(86400)"
    )
    rec = mod.run_commands([[sys.executable, "-c", hang]], 3, tmp_path / "hang.log")
    assert rec["status"] == "timeout" and "timed out after 3 s" in rec["error"]  # returned: it did not wait a day
    pid = int(pid_file.read_text())
    for _ in range(50):  # the grandchild got the SIGTERM too (its parent may not have reaped it yet)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the stage's grandchild survived its timeout")


def test_failed_command_reports_its_last_line(tmp_path):
    mod = _module()
    cmds = [[sys.executable, "-c", "print('fine')"], [sys.executable, "-c", "raise ValueError('bad thing')"]]
    rec = mod.run_commands(cmds, 60, tmp_path / "x.log")
    assert rec == {"status": "failed", "error": "exit 1: ValueError: bad thing"}
    assert "fine" in (tmp_path / "x.log").read_text()


def test_budget_split():
    mod = _module()
    total = 600
    assert mod.stage_timeout("kernels", total, 588, False) == pytest.approx(90)
    assert mod.stage_timeout("train_step", total, 500, False) == pytest.approx(120)
    assert mod.stage_timeout("cost", total, 500, False) == pytest.approx(120)
    assert mod.stage_timeout("train_head", total, 380, False) == pytest.approx(380 - 90)  # the rest less evaluate's
    assert mod.stage_timeout("evaluate", total, 130, False) == pytest.approx(130)  # the last stage: what is left
    assert mod.stage_timeout("kernels", total, 50, False) == pytest.approx(50)  # never past the deadline
    assert mod.stage_timeout("kernels", 120, 117, True) == pytest.approx(117 - 4 * mod.SMOKE_FLOOR_S)
    # a subset of the stages shares the whole budget in the same proportions
    assert mod.stage_timeout("train_step", total, 588, False, ["train_step"]) == pytest.approx(588)
    two = ["kernels", "train_step"]
    assert mod.stage_timeout("kernels", total, 588, False, two) == pytest.approx(600 * 0.15 / 0.35)
    assert mod.stage_timeout("train_step", total, 400, False, two) == pytest.approx(400)  # the last: what is left
    assert sum(mod.shares().values()) == pytest.approx(1) and mod.shares()["train_head"] == pytest.approx(0.30)
    # dummy weights: no head stages, the other three share the whole budget
    dummy = mod.parse_args(["--out", "x", "--load-format", "dummy", "--target", "Llama-3.1-8B"]).stages
    assert dummy == ["kernels", "cost", "train_step"] and sum(mod.shares(dummy).values()) == pytest.approx(1)


def _run(mod, tmp_path, platform: str, *flags: str):
    argv = ["--out", str(tmp_path / "run"), *flags]
    run = mod.Run(mod.parse_args(argv), argv)
    run.platform = platform
    run.path("stages").mkdir(parents=True)
    return run


def test_head_plan_fits_the_measured_step_rate_in_its_time(tmp_path):
    mod = _module()
    run = _run(mod, tmp_path, "gpu")
    mod.write_json(run.path("stages", "train_step.json"), {"recipe": {"status": "ok", "step_s": 0.05}})
    (cmd,), plan = mod.head_plan(run, 300)
    assert cmd[1:4] == ["-m", "train", "--out"] and "--preset" not in cmd
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert flag("--model.compute-dtype") == "bfloat16" and flag("--eval.enabled") == "False"
    assert plan["steps"] == int(flag("--loop.steps")) == int(240 * 0.7 / 0.05)
    assert int(flag("--loop.checkpoint-every")) == plan["steps"]  # one checkpoint, at the end
    assert 30 <= int(flag("--loop.max-seconds")) < 300 - 60
    assert int(flag("--data.max-conversations")) == plan["steps"]  # about one pass over the data
    run.platform = "cpu"  # the CPU plan: float32, and without a measured step its guess
    run.path("stages", "train_step.json").unlink()
    (cmd,), plan = mod.head_plan(run, 300)
    assert cmd[cmd.index("--model.compute-dtype") + 1] == "float32" and plan["recipe_step_s"] == 2.0


def test_evaluate_plan_sizes_the_prompts_to_its_time(tmp_path):
    mod = _module()
    run = _run(mod, tmp_path, "tpu")
    (run.path("head")).mkdir()
    mod.write_json(run.path("head", "summary.json"), {"target": "/models/gemma"})
    (cmd,), plan = mod.evaluate_plan(run, 120)
    assert cmd[cmd.index("--target") + 1] == "/models/gemma" and cmd[cmd.index("--k") + 1] == "1,2,3,4,5,6,7"
    assert cmd[cmd.index("--prompts") + 1] == "mtbench" and plan["prompts"] == 5
    assert mod.evaluate_plan(run, 3600)[1]["prompts"] == 80  # all of MT-Bench


def test_the_cost_stage_runs_on_every_device_the_target_splits_over(tmp_path):
    """By default every device of the machine (--devices auto), or the most the target's heads
    split over; the mesh flags given are passed on as they are."""
    mod = _module()

    def mesh(count: int, *flags: str) -> list[str]:
        run = _run(mod, tmp_path / f"{count}{'-'.join(flags)}", "gpu", "--smoke", *flags)
        run.results["device"] = {"count": count}
        (cmd,), plan = mod.cost_plan(run)  # --smoke's tiny target: 4 attention heads, 2 KV heads
        assert cmd[cmd.index("--target") + 1] == str(run.path("smoke-target"))
        assert " ".join(cmd[cmd.index("--drafter") + 2 : cmd.index("--load-format")]) == plan["mesh"]
        return plan["mesh"]

    assert mesh(1) == mesh(4) == "--devices=auto"
    assert mesh(8) == "--tensor=4"  # its 4 heads do not split 8 ways
    assert mesh(8, "--tensor", "2", "--data", "4") == "--tensor=2 --data=4"
    assert mesh(8, "--devices", "auto", "--data", "2") == "--devices=auto --data=2"
    run = _run(mod, tmp_path / "data3", "gpu", "--smoke", "--data", "3")
    run.results["device"] = {"count": 6}
    (cmd,), _ = mod.cost_plan(run)
    assert cmd[cmd.index("--batch") + 1] == "3"  # --smoke's batch 1 does not split 3 ways: one row per group


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--minutes", "0"], "--minutes must be positive"),
        (["--stages", "kernels,nope"], "unknown stage(s) nope"),
        (["--fail-stage", "nope"], "invalid choice"),
        (["--tensor", "2", "--devices", "auto"], "argument --devices: not allowed with argument --tensor"),
    ],
)
def test_usage_errors_exit_2(tmp_path, flags, message):
    proc = subprocess.run(
        [*PLAYBOOK, "--out", str(tmp_path / "o"), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 2 and message in proc.stderr


def test_out_must_be_new_or_empty(tmp_path):
    (tmp_path / "results.json").write_text("{}")
    proc = subprocess.run([*PLAYBOOK, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "not an empty folder" in proc.stderr


def test_tpu_kernel_check_interpreted(tmp_path):
    stages = _module("device_stages")
    stages.tpu_kernels_stage(tmp_path / "tpu.json", time.monotonic() + 3600, smoke=True)  # every row, any load
    rows = json.loads((tmp_path / "tpu.json").read_text())["rows"]
    assert {(r["kind"], r["impl"]) for r in rows} == {
        ("attention", "xla"),
        ("attention", "pallas_tpu"),
        ("decode", "xla_decode"),
        ("decode", "pallas_tpu"),
    }
    for r in rows:
        assert r["status"] == "ok" and r["ms"] > 0, r
        if r["impl"] == "pallas_tpu":
            assert r["rel_err_vs_xla"] < 1e-4


def test_the_train_step_stage_estimates_a_step_where_the_device_has_rates():
    """The roofline estimate each timed step records beside its measurement (measured / estimated
    calibrates the model): a compiled step's jaxpr FLOPs and XLA's bytes on an H200's rates; none on
    a device without published rates (the CPU)."""
    import jax
    import jax.numpy as jnp

    from peagle_jax.hardware.devices import rates

    stages = _module("device_stages")
    w, x = jnp.ones((256, 512)), jnp.ones((64, 256))
    traced = jax.jit(lambda w, x: jnp.tanh(x @ w)).trace(w, x)
    compiled = traced.lower().compile()
    h200 = rates("h200")
    est = stages.step_estimate(traced, compiled, h200)
    assert est.flops == 2 * 64 * 256 * 512
    assert est.bytes == 4 * (w.size + x.size + 64 * 512)  # both inputs read, the output written
    assert est.seconds == max(est.flops / h200.peak_flops, est.bytes / h200.bandwidth)
    assert stages.step_estimate(traced, compiled, None) is None


def test_what_a_bare_image_lacks_is_named_with_the_wheels_to_bring(monkeypatch):
    import importlib.metadata

    mod = _module()
    real = importlib.metadata.version

    def version(name):
        if name in ("tyro", "tensorboardX"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    missing = mod.missing_packages()
    assert missing == ["tyro==1.0.17", "tensorboardX==2.6.5"]  # the pins of pyproject.toml
    lines = mod.wheel_lines(missing)
    assert "pip download --only-binary=:all:" in lines[1] and lines[1].endswith("'tyro==1.0.17' 'tensorboardX==2.6.5'")
    assert "pip install --no-index --find-links .whl 'tyro==1.0.17'" in lines[2]
    assert mod.wheel_lines([]) == []
