"""Device playbook: one command that measures a lent GPU or TPU end to end within a time budget.

    python -m bench.device --minutes 10 --out DIR         # on the GPU / TPU machine, in the repository
    python -m bench.device --smoke --minutes 2 --out DIR  # CPU dry run of every stage (< 90 s)

Stages, in order (docs/device.md):

1. ``kernels``: the Pallas kernel checks. GPU: ``bench.gpu_check`` (its gpu-marked tests and
   timings) as two runs, attention then decode, each with half the stage's time; below 7
   minutes for the stage its sizes are reduced (N 4096 and 16384, one decode cache fill).
   TPU: the Pallas TPU attention (forward + backward) and decode kernels checked against the
   XLA paths and timed (gpu_check is GPU only). CPU: skipped, unless --smoke (gpu_check
   --smoke, decode part: the Pallas GPU kernel interpreted).
2. ``train_step``: the trainer's cached-features step of the default Gemma-3-270M head (bf16
   compute on an accelerator) with attention "kernels" (Pallas on GPU / TPU) against the same
   step traced under ``kernels.for_platform("cpu")`` (the XLA blockwise path, compiled for the
   same device), at 4096 / 16384 / 32768 tokens, then the Pallas step at doubling lengths
   until one fails: the longest that fits. Per length: compile seconds, median step ms,
   tokens/s, the roofline estimate of the step and measured / estimated (a GPU or TPU with
   published rates: `peagle_jax.hardware.roofline`), the process's peak device memory so far (``memory_stats()["peak_bytes_in_use"]``:
   a running maximum, lengths run shortest first) and XLA's plan of the program's own
   buffers. First, the recipe's own step (256 tokens, the target inside) is timed: it sizes
   the next stage.
3. ``train_head``: ``python -m train`` with the default recipe on ShareGPT (bf16 compute on an
   accelerator), ``--loop.max-seconds`` set to the stage's time less its setup and export,
   ``--loop.steps`` to the steps that the measured recipe step rate fits in it (so the
   learning-rate schedule ends about when the time does); exports DIR/head/head and
   DIR/head/vllm.
4. ``evaluate``: ``python -m infer bench`` of that head on MT-Bench at K = 1..7 against plain
   decoding (acceptance length, per-position acceptance, tokens/s, speedup); the prompt count
   is sized to the stage's time.

Budget (--minutes, all included): kernels 15%, train_step 20%, evaluate 20%, train_head what
is left when it starts less evaluate's share (about 43%, plus whatever the earlier stages did
not use; evaluate, last, gets what is left then); 2% is kept for the script itself. With
--stages, the selected stages' shares are scaled to add up to the whole budget. --smoke: the
stages are fixed small runs, each may use the time left less 8 s for each later stage.

Every stage runs in its own subprocess (``python -m bench.device_stages``, or the CLI), in its own
process group, killed at its timeout, so a crash, an OOM or a hang ends that stage only; its
output goes to DIR/logs/STAGE.log. DIR/results.json is rewritten (atomically) after every
stage: the command line, the device, the budget and for each stage its status (ok | failed |
skipped | timeout), seconds, a one-line error and its results. Exit status 0 when the script
ran (stage failures are recorded, not fatal), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.command import command_line

ROOT = Path(__file__).resolve().parents[1]  # the repository: the stages' working folder
STAGES = ("kernels", "cost", "train_step", "train_head", "evaluate")
SHARES = {"kernels": 0.15, "cost": 0.20, "train_step": 0.20, "evaluate": 0.15}  # train_head: the rest
HEAD_STAGES = ("train_head", "evaluate")  # they need real weights and data: not run on dummy weights
# infer cost: the goal rows first (K=7, batch 1, a 4k cache), so a stage cut short still has them
COST_FLAGS = ["--modes", "parallel,chain", "--k", "7,1,3,5,2,4,6", "--batch", "1,16,64", "--prompt-len", "4096,32768"]
SMOKE_COST_FLAGS = ["--modes", "parallel,chain", "--k", "3", "--batch", "1", "--prompt-len", "32", "--reps", "2"]
SMOKE_TARGET = {  # a tiny config.json for --smoke's dummy-weight stages
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 512,
}  # fmt: skip
MARGIN, SMOKE_FLOOR_S = 0.02, 8.0
KS, SMOKE_KS = "1,2,3,4,5,6,7", "1,2,3"
ACCELERATORS = ("gpu", "tpu")
PROBE = """import json, jax
d = jax.devices()
m = d[0].memory_stats() or {}
print(json.dumps(dict(platform=d[0].platform, device_kind=d[0].device_kind, count=len(d), devices=[str(x) for x in d],
    jax=jax.__version__, memory_bytes=m.get("bytes_limit"))))"""


# --------------------------------------------------------------------------- files and processes
def write_json(path: Path, obj) -> None:
    """`obj` as JSON at `path`, atomically (a temporary sibling, then os.replace): a reader never
    sees half a file, even when this process is killed mid-write."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def read_json(path: Path):
    """The JSON at `path`, or None when it is missing or unreadable (a stage that died early)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def last_line(text: str, limit: int = 300) -> str:
    """The last non-empty line of `text` (a traceback's exception, a CLI's `error:` line), cut to `limit`."""
    lines = [s.strip() for s in text.replace("\r", "\n").splitlines() if s.strip()]
    return lines[-1][:limit] if lines else ""


def error_line(e: BaseException, limit: int = 200) -> str:
    """An exception in one line: its type and the first line of its message (XLA's out-of-memory
    errors say what they could not allocate there)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:limit]


def run_commands(cmds: list[list[str]], timeout: float, log: Path, env: dict | None = None) -> dict:
    """Runs `cmds` one after the other, all within `timeout` seconds, output appended to `log`; a
    failing command does not stop the next. {"status": "ok"}, else the first failure's
    {"status": "failed" | "timeout", "error": one line}. Each command runs in a new session, so that
    a timeout (or this process being interrupted) ends its whole process group."""
    end, rec = time.monotonic() + timeout, {"status": "ok"}
    for cmd in cmds:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                error = f"timed out after {timeout:.0f} s: {' '.join(Path(c).name for c in cmd[1:3])}"
                return {
                    "status": "timeout",
                    "error": error + (f"; before that {rec['error']}" if "error" in rec else ""),
                }
            except BaseException:  # Ctrl-C: the child is in another session and would outlive us
                _kill_group(proc)
                raise
        if rc != 0 and rec["status"] == "ok":
            rec = {"status": "failed", "error": f"exit {rc}: {last_line(log.read_text(errors='replace'))}"}
    return rec


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group of `proc`, 10 s to end, then SIGKILL to whatever of the group is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def probe_device(timeout: float = 120) -> dict:
    """The devices as a child process sees them (platform, kind, count, JAX version, memory): this
    process never starts a JAX backend, which would hold the accelerator (a TPU is one process's)."""
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        info = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": last_line(r.stderr)}
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        info = {"error": f"device probe failed: {type(e).__name__}"}
    info.setdefault("platform", "unknown")
    return {**info, "seconds": round(time.monotonic() - t0, 1)}


def prepare_assets(run: Run) -> dict:
    """Gemma-3-270M prepared (`python -m peagle_jax.assets`, once per machine; at once when its
    folder is there) before the stages that load it, so that none spends its share building it."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "peagle_jax.sources.assets", "gemma3-270m"]
    rec = run_commands([cmd], max(30.0, 0.3 * run.left()), run.path("logs", "assets.log"))
    return {**rec, "seconds": round(time.monotonic() - t0, 1), "log": "logs/assets.log"}


# --------------------------------------------------------------------------- what the image lacks
def missing_packages() -> list[str]:
    """The project's own requirements (pyproject.toml's dependencies) that are not installed in
    this Python at all, as `name==version` pins (a version other than the pinned one that is
    installed is left alone: the playbook runs with what the image has)."""
    import importlib.metadata
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    missing = []
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.\-]+", dep).group(0)
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dep.split(";")[0].split("#")[0].strip().replace(" ", ""))
    return missing


def wheel_lines(missing: list[str]) -> list[str]:
    """What to run to bring `missing` to a machine without the network: download the wheels where
    pip reaches PyPI (with their own dependencies), then install them here from the folder."""
    if not missing:
        return []
    pins = " ".join(f"'{m}'" for m in missing)
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    platforms = " ".join(
        f"--platform {p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
    )
    return [
        f"not installed here, and python -m train / infer import them: {', '.join(missing)}",
        f"bring them as wheels (a few MiB): where pip reaches PyPI, in the repository: python3 -m pip download "
        f"--only-binary=:all: --python-version {py} --implementation cp {platforms} -d .whl {pins}",
        f"then here, before this script: python3 -m pip install --no-index --find-links .whl {pins}",
    ]


# --------------------------------------------------------------------------- the budget
def shares(stages=STAGES) -> dict[str, float]:
    """Each selected stage's share of the budget: SHARES (train_head the rest) scaled so that the
    selected stages' shares add up to 1 (one stage alone gets the whole budget)."""
    nominal = {**SHARES, "train_head": 1 - sum(SHARES.values())}
    picked = {s: nominal[s] for s in STAGES if s in stages}
    return {s: v / sum(picked.values()) for s, v in picked.items()}


def stage_timeout(name: str, total: float, left: float, smoke: bool, stages=STAGES) -> float:
    """Seconds stage `name` may run, `left` seconds before the deadline of a `total`-second run
    (see the module docstring for the split): its share, or for train_head (and the last stage)
    all that is left less the later stages' shares."""
    later = [s for s in STAGES[STAGES.index(name) + 1 :] if s in stages]
    if smoke:
        return left - SMOKE_FLOOR_S * len(later)
    share = shares(stages)
    if name == "train_head" or not later:
        return left - sum(share[s] * total for s in later)
    return min(share[name] * total, left)


class Run:
    """One playbook run: its options, its deadline and results.json (rewritten after every stage)."""

    def __init__(self, args, argv: list[str]):
        self.args, self.out, self.smoke = args, Path(args.out).absolute(), args.smoke
        self.total = args.minutes * 60
        self.start = time.monotonic()
        self.deadline = self.start + self.total * (1 - MARGIN)
        self.platform = "unknown"
        self.results = {
            "command": command_line("bench.device", argv),
            "argv": argv,
            "smoke": self.smoke,
            "minutes": args.minutes,
            "budget_seconds": self.total,
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "budget": {**{s: f"{v:.0%}" for s, v in shares(args.stages).items()}, "margin": f"{MARGIN:.0%}"},
            "device": None,
            "stages": {s: {"status": "pending"} for s in STAGES},
            "head": None,
            "complete": False,
        }

    def path(self, *parts: str) -> Path:
        return self.out.joinpath(*parts)

    @property
    def accelerator(self) -> bool:
        return self.platform in ACCELERATORS

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.results["seconds"] = round(time.monotonic() - self.start, 1)
        write_json(self.path("results.json"), self.results)


# --------------------------------------------------------------------------- the stages' commands
def _self(run: Run, stage: str, seconds: float) -> list[str]:
    """One stage's child: `python -m bench.device_stages`."""
    cmd = [sys.executable, "-m", "bench.device_stages", "--stage", stage]
    cmd += ["--out", str(run.out), "--target", run.args.target, "--load-format", run.args.load_format]
    return cmd + ["--seconds", f"{seconds:.0f}"] + (["--smoke"] if run.smoke else [])


def target_folder(run: Run) -> str:
    """What `--target` names for a command line: --smoke's tiny config (written here, run with dummy
    weights), an asset's prepared folder (`peagle_jax.sources.assets`), else the name itself (a folder, a Hub
    id, a preset)."""
    if run.smoke:
        folder = run.path("smoke-target")
        folder.mkdir(exist_ok=True)
        write_json(folder / "config.json", SMOKE_TARGET)
        return str(folder)
    from peagle_jax.sources.assets import ASSETS, prepare

    return str(prepare(run.args.target)) if run.args.target in ASSETS else run.args.target


def cost_plan(run: Run) -> tuple[list[list[str]], dict]:
    """`python -m infer cost` of --target with fresh heads (P-EAGLE and EAGLE-3) on the devices of
    `cost_mesh`: its rows (the plain step and its roofline, each round, break-even acceptance,
    compile seconds) in DIR/cost.json."""
    target = target_folder(run)
    mesh = cost_mesh(run, target)
    cmd = [sys.executable, "-m", "infer", "cost", "--target", target, "--drafter", "new", *mesh]
    load_format = "dummy" if run.smoke else run.args.load_format
    flags = list(SMOKE_COST_FLAGS if run.smoke else COST_FLAGS)
    if run.args.data > 1:  # the rows are split over the data groups: the batches they divide, else one each
        at = flags.index("--batch") + 1
        flags[at] = ",".join(b for b in flags[at].split(",") if int(b) % run.args.data == 0) or str(run.args.data)
    cmd += ["--load-format", load_format, *flags]
    return [cmd + ["--json", str(run.path("cost.json"))]], {"mesh": " ".join(mesh)}


def cost_mesh(run: Run, target: str) -> list[str]:
    """The cost stage's mesh flags: those given (--tensor, --data, --devices), else every device of
    the machine, tensor-parallel (--devices auto), or for a target whose heads or vocabulary do not
    split over them all (`sharding.tensor_problem`), the most devices they split over (--tensor T)."""
    a = run.args
    if a.tensor or a.devices or a.data > 1:
        given = [f"--tensor={a.tensor}"] if a.tensor else [f"--devices={a.devices}"] if a.devices else []
        return given + ([f"--data={a.data}"] if a.data > 1 else [])
    from peagle_jax.handles.target import target_source
    from peagle_jax.runtime.sharding import tensor_problem

    count = (run.results["device"] or {}).get("count") or 1
    try:
        config = target_source(target, "dummy")[0]  # config.json (or the preset) only
    except (OSError, ValueError):  # the stage itself says what is wrong with the target
        return ["--devices=auto"]
    tensor = max(t for t in range(1, count + 1) if count % t == 0 and tensor_problem(config, t) is None)
    return ["--devices=auto"] if tensor == count else [f"--tensor={tensor}"]


def kernels_plan(run: Run, seconds: float):
    """(commands, reason to skip or None) of the kernels stage on this platform."""
    gc = [sys.executable, "-m", "bench.gpu_check"]
    if run.smoke:
        return [[*gc, "--smoke", "--parts", "decode", "--json", str(run.path("kernels", "decode.json"))]], None
    if run.platform == "tpu":
        return [_self(run, "kernels_tpu", seconds)], None
    if run.platform != "gpu":
        return [], "skipped: no GPU/TPU"
    reduced = seconds < 420  # gpu_check in full takes up to 8 minutes
    attention = ["--n", "4096", "16384", "--iters", "3"] if reduced else []
    decode = ["--decode-fills", "4096", "--decode-batches", "1", "--decode-windows", "0", "512"] if reduced else []
    decode += ["--decode-splits", "1", "32", "--decode-iters", "10"] if reduced else []
    return [
        [*gc, "--parts", "attention", *attention, "--json", str(run.path("kernels", "attention.json"))],
        [*gc, "--parts", "decode", *decode, "--json", str(run.path("kernels", "decode.json"))],
    ], None


def kernels_results(run: Run) -> dict:
    """gpu_check's (or the TPU check's) JSON files of the stage, by part."""
    parts = {p.stem: read_json(p) for p in sorted(run.path("kernels").glob("*.json"))}
    return {k: v for k, v in parts.items() if v is not None}


def kernels_error(results: dict) -> str | None:
    """What failed in the kernel checks, in one line: the tests' summary, the rows not ok."""
    why = []
    for part, r in results.items():
        tests = r.get("tests") or {}
        if tests.get("returncode"):
            why.append(f"{part} tests: {tests.get('summary', '')}")
        rows = [x for key in ("timings", "decode", "rows") for x in r.get(key) or []]
        bad = [x for x in rows if not (x["status"] == "ok" or x["status"].startswith("skipped"))]
        if bad:
            why.append(f"{part}: {len(bad)} of {len(rows)} not ok, first {bad[0]['impl']}: {bad[0]['status']}")
    return "; ".join(why)[:300] or None


def head_plan(run: Run, seconds: float) -> tuple[list[list[str]], dict]:
    """The `python -m train` command of the train_head stage and what it was sized to: the
    default recipe (or --preset tiny for --smoke), stopped by --loop.max-seconds, its steps the
    measured recipe step rate fits in that time (checkpoints and the held-out loss at the end only)."""
    base = [sys.executable, "-m", "train", "--out", str(run.path("head")), "--loop.progress", "False"]
    base += ["--eval.enabled", "False"]
    if run.smoke:  # the tiny target train_step built, if it did (else the preset builds one)
        tiny = run.path("tiny-target")
        target = str(tiny) if (tiny / "tokenizer.json").exists() else "tiny"
        plan = {"preset": "tiny", "target": target, "steps": 3, "max_seconds": max(5, round(seconds - 20))}
        flags = ["--preset", "tiny", "--model.target", target, "--loop.steps", "3"]
        return [[*base, *flags, "--loop.max-seconds", str(plan["max_seconds"])]], plan
    step = read_json(run.path("stages", "train_step.json")) or {}
    step_s = (step.get("recipe") or {}).get("step_s") or (0.1 if run.accelerator else 2.0)  # a guess without it
    steps = max(200, min(200_000, int((seconds - 60) * 0.7 / step_s)))  # 0.7: host work, the first compile
    conversations = max(2000, min(20_000, steps))  # ~1 pass over the data, ~2 s per 1000 to read them
    max_seconds = max(30, round(seconds - 60 - conversations / 500))  # setup, tokenising, checkpoint, export
    plan = dict(recipe_step_s=step_s, steps=steps, max_seconds=max_seconds, max_conversations=conversations)
    plan["compute_dtype"] = "bfloat16" if run.accelerator else "float32"
    flags = ["--model.compute-dtype", plan["compute_dtype"], "--loop.steps", str(steps)]
    flags += ["--loop.max-seconds", str(max_seconds), "--loop.checkpoint-every", str(steps)]
    flags += ["--loop.eval-every", "0", "--data.max-conversations", str(conversations)]
    return [[*base, *flags]], plan


HEAD_KEYS = (
    "steps", "train_tokens", "train_seconds", "wall_seconds", "first_loss", "final_loss", "stopped_early",
    "simulated_acceptance_length", "per_depth_accuracy", "heldout", "head_dir", "vllm_dir", "target", "serve",
)  # fmt: skip


def head_results(run: Run) -> dict:
    """The training summary's main numbers (DIR/head/summary.json holds them all)."""
    s = read_json(run.path("head", "summary.json")) or {}
    res = {k: s[k] for k in HEAD_KEYS if k in s}
    if s.get("train_seconds") and s.get("train_tokens"):
        res["tokens_per_second"] = round(s["train_tokens"] / s["train_seconds"], 1)
    return res


def evaluate_plan(run: Run, seconds: float):
    """(commands, plan) of the evaluate stage: `python -m infer bench` of the trained head against
    its target; MT-Bench prompts sized to the stage's time (about 6 s a prompt over all K after
    ~90 s of loading and compiling on an accelerator)."""
    target = read_json(run.path("head", "summary.json"))["target"]  # Gemma-3-270M's folder, or --smoke's tiny one
    if run.smoke:
        plan = dict(k=SMOKE_KS, prompts=2, max_new_tokens=8)
    else:
        per_prompt, setup = (6, 90) if run.accelerator else (60, 120)
        plan = dict(k=KS, prompts=max(4, min(80, int((seconds - setup) / per_prompt))), max_new_tokens=128)
    cmd = [sys.executable, "-m", "infer", "bench", "--target", target, "--drafter", str(run.path("head", "head"))]
    cmd += ["--k", plan["k"], "--prompts", "mtbench", "--limit", str(plan["prompts"])]
    cmd += ["--max-new-tokens", str(plan["max_new_tokens"]), "--json", str(run.path("evaluate.json"))]
    return [cmd], {**plan, "target": target}


EVAL_KEYS = (
    "k",
    "acceptance_length",
    "per_position_acceptance",
    "speedup",
    "tokens_per_second",
    "identical_greedy_outputs",
)


def evaluate_results(run: Run) -> dict:
    """Acceptance and speedup per K (DIR/evaluate.json holds everything `infer bench` measured)."""
    r = read_json(run.path("evaluate.json"))
    if not r:
        return {}
    per_k = [{k: x.get(k) for k in EVAL_KEYS} for x in r.get("runs", [])]
    base = (r.get("baseline") or {}).get("tokens_per_second")
    return {
        "prompts": r.get("prompts"),
        "batches": r.get("batches"),
        "baseline_tokens_per_second": base,
        "per_k": per_k,
    }


# --------------------------------------------------------------------------- running the stages
def plan_stage(run: Run, name: str, seconds: float):
    """(commands, plan, skip reason or None, child environment) of stage `name`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if run.smoke and "xla_backend_optimization_level" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()  # faster compiles
    if name == "kernels":
        cmds, skip = kernels_plan(run, seconds)
        return cmds, {}, skip, env
    if name == "cost":
        cmds, plan = cost_plan(run)
        return cmds, plan, None, env
    if name == "train_step":
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the longest that fits: most of the device
        return [_self(run, "train_step", seconds)], {}, None, env
    if name == "train_head":
        cmds, plan = head_plan(run, seconds)
        return cmds, plan, None, env
    if not run.path("head", "head").is_dir() or not (read_json(run.path("head", "summary.json")) or {}).get("target"):
        return [], {}, "skipped: no trained head (train_head did not finish)", env
    cmds, plan = evaluate_plan(run, seconds)
    return cmds, plan, None, env


COLLECT = {
    "kernels": kernels_results,
    "cost": lambda run: read_json(run.path("cost.json")) or {},
    "train_step": lambda run: read_json(run.path("stages", "train_step.json")) or {},
    "train_head": head_results,
    "evaluate": evaluate_results,
}


def run_stage(run: Run, name: str) -> dict:
    """Runs stage `name` within its share of the time left: its record for results.json."""
    args = run.args
    if name in HEAD_STAGES and args.load_format == "dummy":
        return {"status": "skipped: dummy weights (no head worth training or evaluating)", "seconds": 0.0}
    if name not in args.stages:
        return {"status": "skipped: not selected (--stages)", "seconds": 0.0}
    seconds = stage_timeout(name, run.total, run.left(), run.smoke, args.stages)
    if seconds < 5:
        return {"status": "skipped: out of time", "seconds": 0.0}
    cmds, plan, skip, env = plan_stage(run, name, seconds)
    if skip:
        return {"status": skip, "seconds": 0.0}
    if args.fail_stage == name:  # tests: this stage's child fails as a crashing one would
        cmds = [[sys.executable, "-c", f"raise SystemExit('forced failure (--fail-stage {name})')"]]
    if args.hang_stage == name:  # tests: this stage's child outlives any budget
        cmds = [[sys.executable, "-c", "import time; time.sleep(86400)"]]
    print(f"[device] {name}: up to {seconds:.0f} s", flush=True)
    t0 = time.monotonic()
    rec = run_commands(cmds, seconds, run.path("logs", f"{name}.log"), env)
    rec.update(started_at_s=round(t0 - run.start, 1), seconds=round(time.monotonic() - t0, 1), timeout_s=round(seconds))
    rec.update(log=f"logs/{name}.log", **({"plan": plan} if plan else {}))
    rec["results"] = COLLECT[name](run)  # what a failed or timed-out stage left is kept too
    if name == "kernels" and rec["status"] == "failed":
        rec["error"] = kernels_error(rec["results"]) or rec["error"]
    print(f"[device] {name}: {rec['status']} in {rec['seconds']} s {rec.get('error', '')}", flush=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from peagle_jax.runtime.command_line import UsageError, one_line

    try:
        args = parse_args(argv)
    except UsageError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    missing = missing_packages()
    for line in wheel_lines(missing):  # before anything: a bare image says at once what to bring
        print(f"[device] {line}", flush=True)
    run = Run(args, argv)
    run.results["missing_packages"] = missing
    for sub in ("logs", "stages", "kernels"):
        run.path(sub).mkdir(parents=True, exist_ok=True)
    run.results["device"] = probe_device()
    run.platform = run.results["device"]["platform"]
    if not run.smoke and args.load_format == "auto" and set(args.stages) - {"kernels"}:  # they load Gemma-3-270M
        run.results["assets"] = prepare_assets(run)
    run.save()
    for name in STAGES:
        run.results["stages"][name] = {"status": "running"}
        run.save()
        run.results["stages"][name] = run_stage(run, name)
        run.save()
    head = run.path("head", "head")
    run.results.update(head=str(head) if head.is_dir() else None, complete=True)
    run.results["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    run.save()
    summary = ", ".join(f"{s} {r['status']}" for s, r in run.results["stages"].items())
    print(f"[device] wrote {run.path('results.json')} in {run.results['seconds']} s: {summary}", flush=True)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, each checked before any stage runs: UsageError (one line naming the flag)."""
    from infer.flags import add_mesh_flags
    from peagle_jax.runtime.command_line import OneLineParser
    from peagle_jax.runtime.folders import unwritable

    p = OneLineParser(prog="python -m bench.device", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="the whole run's time budget (default 10)")
    p.add_argument("--out", required=True, help="output folder (new or empty): results.json, logs, the head")
    p.add_argument("--smoke", action="store_true", help="CPU dry run of every stage at tiny sizes (< 90 s)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"stages to run (default: all of {','.join(STAGES)})")
    p.add_argument(
        "--target",
        default="gemma3-270m",
        help="the target of the cost and train_step stages: an asset name, a folder, a Hub id, or with "
        "--load-format dummy a preset (Llama-3.1-8B, ...) or a folder with only config.json",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="dummy: random weights, nothing to fetch (a bare machine); train_head and evaluate are skipped",
    )
    add_mesh_flags(p)  # the cost stage's devices (default: every device of the machine)
    p.add_argument("--fail-stage", choices=STAGES, help="testing: make this stage's child fail")
    p.add_argument("--hang-stage", choices=STAGES, help="testing: make this stage's child hang past its budget")
    args = p.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    if bad := [s for s in args.stages if s not in STAGES]:
        p.error(f"--stages: unknown stage(s) {', '.join(bad)}; choose from {', '.join(STAGES)}")
    if args.load_format == "dummy":  # their shares go to the other stages
        args.stages = [s for s in args.stages if s not in HEAD_STAGES]
    if not 0 < args.minutes < float("inf"):
        p.error(f"--minutes must be positive and finite, got {args.minutes}")
    out = Path(args.out)
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        p.error(f"--out {args.out}: exists and is not an empty folder (each run writes a new one)")
    why = unwritable(out, "folder")
    if why:
        p.error(f"--out {args.out}: {why}")
    return args


if __name__ == "__main__":
    sys.exit(main())
