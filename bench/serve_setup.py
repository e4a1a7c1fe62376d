"""What the server's load benchmarks (`bench.guidellm_sweep`, `bench.serve_soak`) share: the target
and head they serve, and the facts about the run they record."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# where `make demo` (python -m train) leaves its trained head, relative to the root (the server's cwd)
DEMO_HEAD = "runs/peagle-gemma3-270m/head"


def target_folder(name: str) -> str:
    """A HF folder: `name` itself, or the prepared asset's folder for "gemma3-270m"."""
    if name != "gemma3-270m":
        return name
    from peagle_jax.sources.assets import prepare

    return str(prepare(name))


def default_drafter() -> str:
    """The head `make demo` trained when it is there, else a fresh random head (`new`)."""
    return DEMO_HEAD if (ROOT / DEMO_HEAD / "drafter.json").is_file() else "new"


def add_server_args(p: argparse.ArgumentParser, max_batch: int, results: str) -> None:
    """The flags both benchmarks give their server (and their results file's)."""
    p.add_argument("--target", default="gemma3-270m", help="a HF folder, or gemma3-270m (the prepared asset)")
    p.add_argument("--drafter", default=default_drafter(), help="a head folder, or new (default: the make demo head)")
    p.add_argument("--k", type=int, default=3, help="drafts per round")
    p.add_argument("--max-batch", type=int, default=max_batch, help="the server's decode slots")
    p.add_argument("--max-len", type=int, default=512, help="the server's positions per slot")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / results), help="the results file")


def server_flags(args, folder: str) -> list[str]:
    """`python -m infer serve` flags for `args` (add_server_args'), the target read from `folder`."""
    flags = ["--target", folder, "--drafter", args.drafter, "--k", str(args.k), "--served-model-name", "bench"]
    return flags + ["--max-batch", str(args.max_batch), "--max-len", str(args.max_len)]


def save(path: str, data: dict) -> None:
    """Writes a results file (`python -m bench.render_results` makes its table in docs/benchmarks.md)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


def head_words(drafter: str) -> str:
    """The head, as the results say it."""
    if drafter.startswith("new"):
        return "a fresh random P-EAGLE head (--drafter new: no trained head was at hand; it accepts almost nothing)"
    return "the head make demo trained" if drafter == DEMO_HEAD else f"the head {Path(drafter).name}"


def server_line(flags: list[str], target: str) -> str:
    """The server's command line as a user types it: the prepared Gemma asset's folder as the command
    that prints it, not this machine's path."""
    shown = list(flags)
    if target == "gemma3-270m":
        shown[shown.index("--target") + 1] = '"$(python -m peagle_jax.assets gemma3-270m)"'
    return "python -m infer serve " + " ".join(shown)


def accelerator() -> str:
    """What accelerator the machine has, without starting JAX on it (the server needs its memory)."""
    if Path("/dev/nvidia0").exists():
        return "NVIDIA GPU"
    if Path("/dev/accel0").exists() or Path("/dev/vfio").is_dir() and any(Path("/dev/vfio").iterdir()):
        return "TPU"
    return "no accelerator"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def run_facts() -> dict:
    """The hardware, JAX version, commit and date a results file records."""
    from importlib.metadata import version

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    facts = {
        "hardware": f"{os.cpu_count()}-core {cpu_model()}, {accelerator()}; load average {load} at the start "
        "(1/5/15 min; the machine is shared)",
        "jax": version("jax"),
        "commit": commit.stdout.strip(),
        "date": datetime.date.today().isoformat(),
    }
    return facts | ({"uncommitted_changes": True} if dirty.stdout.strip() else {})


def map_in_threads(fn: Callable, items: Iterable, threads: int) -> list:
    """`fn` over `items` from `threads` client threads, each taking the next item as it finishes
    one; the results in the items' order. A failure or an interrupt ends the call once the
    requests in flight are done (`Executor.map` cancels the items not started)."""
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))
