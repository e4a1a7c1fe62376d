"""Peak memory and time of one training step against sequence length: flat vs partitioned.

The default head of Gemma-3-270M's width (1 layer, H 640, K_train 8, draft vocabulary 16384,
embed_tokens and lm_head frozen, f32, model.attention auto) trained on one sequence of L tokens
(a 10% prompt, the rest supervised; COD rows sampled as the trainer does, padded to
row_factor 3.5 x L). The target's features are random arrays of the cached features' shapes
(aux [1, L, 3 x 640], final-norm states [1, L, 640]): the step is the trainer's cached-features
step (`TrainStep` with `--data.cache_features`); the target itself is loaded only to build the
head and is resident in every configuration (its ~1.1 GB is part of "setup").

Every configuration runs in its own subprocess, so its peak RSS (VmHWM) is its own. A watchdog
kills a child whose RSS passes --limit-gb, or when the machine's MemAvailable falls under
--reserve-gb, and records "out of memory" instead of letting the machine swap or OOM-kill.

    python -m bench.train_memory [--lengths 2048,8192,16384,32768] [--variants flat,partitioned]
        [--rows-per-segment 8192] [--limit-gb 20] [--json runs/bench/train_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.command import command_line

ROOT = Path(__file__).resolve().parents[1]
ROW_FACTOR, K, DRAFT_VOCAB = 3.5, 8, 16384


def _status(pid: int | str, key: str) -> float:
    """A /proc/<pid>/status field in GB (0 when gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0.0


def _available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def child(length: int, segments: int, steps: int, out: str) -> None:
    """One configuration: build, one (or two) steps, write the numbers to `out`."""
    from peagle_jax.runtime.host import reuse_freed_memory

    reuse_freed_memory()  # as `python -m train` does
    import jax
    import numpy as np

    import peagle_jax as pj
    from peagle_jax.runtime.timing import side_by_side
    from peagle_jax.sources.assets import prepare
    from train import cod
    from train.data import Example
    from train.flags import from_dict
    from train.spec import BatchSpec
    from train.step import batch_arrays
    from train.trainer import Trainer

    target = pj.load_target(prepare("gemma3-270m"), dtype="float32")
    v, h = target.config.vocab_size, target.config.hidden_size
    rng = np.random.default_rng(0)
    counts = rng.zipf(1.3, v).astype(np.int64)  # some frequency order for the draft vocabulary
    cfg = from_dict({"model": {"draft_vocab": DRAFT_VOCAB, "k_train": K}, "loop": {"segments": segments}})
    trainer = Trainer(cfg, target, 100, token_counts=counts)  # the default recipe
    stepper, params, opt_state, frozen = trainer.stepper, trainer.params, trainer.opt_state, trainer.frozen
    ids = rng.integers(10, v, length).astype(np.int32)
    mask = np.arange(length) >= length // 10
    rows = BatchSpec(k=K, max_len=length, length_buckets=1, row_factor=ROW_FACTOR, row_granularity=512)
    b = cod.make_batch([Example(ids, mask, 0)], rows, step=0)
    real_rows = int((b.doc >= 0).sum())
    aux = jax.numpy.asarray(rng.normal(size=(1, length, 3 * h)).astype(np.float32) * 30)
    y = jax.numpy.asarray(rng.normal(size=(1, length, h)).astype(np.float32) * 20)
    batch = stepper.partition(batch_arrays(b))
    seg_shape = list(np.shape(batch["seg_rows"])) if "seg_rows" in batch else None
    setup_gb = _status("self", "VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here on: not the weights' loading transient
    t0 = time.perf_counter()
    # the trainer's cached-features step, compiled ahead so XLA's own plan can be read too
    compiled = stepper.trace_cached(params, opt_state, frozen, aux, y, batch).lower().compile()
    compile_s = time.perf_counter() - t0
    plan = compiled.memory_analysis()
    rec = {
        "length": length,
        "rows": int(b.anchor.shape[1]),
        "real_rows": real_rows,
        "segments": segments,
        "seg_rows_shape": seg_shape,
        "setup_rss_gb": setup_gb,
        "compile_s": compile_s,
        "xla_temp_gb": None if plan is None else plan.temp_size_in_bytes / 2**30,
    }
    state, losses = [params, opt_state], []

    def step():  # the compiled step donates its state: each call takes the last one
        state[0], state[1], m = compiled(*state, frozen, stepper.head_w, aux, y, batch)
        losses.append(float(m["loss"]))

    timing = side_by_side({"step": step}, steps, first=False)["step"]  # compiled ahead: every step timed
    rec.update(
        peak_rss_gb=_status("self", "VmHWM"),
        step_s=timing.min_ms / 1000 if steps else None,
        loss=losses[0] if losses else None,
    )
    Path(out).write_text(json.dumps(rec))


def run_one(length: int, segments: int, steps: int, limit_gb: float, reserve_gb: float, timeout: float) -> dict:
    out = Path(tempfile.gettempdir()) / f"train_memory_{os.getpid()}_{length}_{segments}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.train_memory", "--child", str(length), str(segments), str(steps), str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    peak, why, t0 = 0.0, None, time.perf_counter()
    while proc.poll() is None:
        rss = _status(proc.pid, "VmRSS")
        peak = max(peak, rss)
        if rss > limit_gb:
            why = f"out of memory (RSS passed the {limit_gb:g} GB limit)"
        elif _available_gb() < reserve_gb:
            why = f"out of memory (machine under {reserve_gb:g} GB available at RSS {rss:.1f} GB)"
        elif time.perf_counter() - t0 > timeout:
            why = f"timed out after {timeout:.0f} s"
        if why:
            proc.kill()
            break
        time.sleep(0.1)
    err = proc.communicate()[1]
    if why is None and proc.returncode != 0:
        why = f"failed (exit {proc.returncode}): {err.strip().splitlines()[-1] if err.strip() else ''}"
    if why is not None:
        return {"length": length, "segments": segments, "error": why, "peak_rss_gb": peak}
    rec = json.loads(out.read_text())
    out.unlink()
    return rec


def rows_of(length: int) -> int:
    return int(-(-ROW_FACTOR * length // 8) * 8)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.train_memory", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,8192,16384,32768")
    ap.add_argument("--variants", default="flat,partitioned")
    ap.add_argument("--rows-per-segment", type=int, default=8192, help="partitioned: S = ceil(rows / this), >= 2")
    ap.add_argument(
        "--steps", type=int, default=1, help="steps timed per configuration (compiled ahead; 0 = compile only)"
    )
    ap.add_argument("--limit-gb", type=float, default=20.0)
    ap.add_argument("--reserve-gb", type=float, default=1.0, help="kill a child when the machine has less available")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    ap.add_argument("--json", default="runs/bench/train_memory.json")
    a = ap.parse_args()
    results = []
    print(f"{'tokens':>7} {'rows':>7} {'variant':>12} {'S':>3} {'setup GB':>9} {'peak GB':>8} {'XLA temp GB':>11} "
          f"{'compile s':>9} {'step s':>7}  note", flush=True)  # fmt: skip
    for length in (int(x) for x in a.lengths.split(",")):
        for variant in a.variants.split(","):
            s = 1 if variant == "flat" else max(2, -(-rows_of(length) // a.rows_per_segment))
            r = run_one(length, s, a.steps, a.limit_gb, a.reserve_gb, a.timeout)
            r["variant"] = variant
            results.append(r)

            def f(key, fmt, r=r):
                return format(r[key], fmt) if r.get(key) is not None else "-"

            print(
                f"{length:>7} {r.get('rows', rows_of(length)):>7} {variant:>12} {s:>3} {f('setup_rss_gb', '9.2f')} "
                f"{f('peak_rss_gb', '8.2f')} {f('xla_temp_gb', '11.2f')} {f('compile_s', '9.1f')} {f('step_s', '7.1f')}  "
                f"{r.get('error', '')}",
                flush=True,
            )
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": command_line("bench.train_memory"), "cpus": os.cpu_count(), "k": K}
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
