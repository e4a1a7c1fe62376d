"""The evaluation stages (plain decoding and every head at every K, `infer.compare.compare`) and
the results dict that the report and its plots are written from."""

from __future__ import annotations

import os
import platform
import shlex
import time
from pathlib import Path

from report.common import HEADS, PROMPT_SETS, dflash_block_size, log
from report.stages import Stages, eval_settings, shown

# what each row of results.json keeps of a run of `infer.compare.compare`
ROW_KEYS = (
    "acceptance_length",
    "per_position_acceptance",
    "tokens_per_second",
    "baseline_tokens_per_second",
    "speedup",
    "drafter_ms",
    "verify_ms",
    "prompts",
    "new_tokens",
    "ms_per_round",
    "greedy_mismatches",
)


def eval_derived() -> dict:
    """What an evaluation compares beyond the flags: a record of other heads (a two-head run's,
    before DFlash) is stale and redone, never shown as if it measured these."""
    return {"heads": list(HEADS.values())}


def stage_eval(args, stages: Stages, data: dict, trained: dict) -> list[dict]:
    """One stage per (prompt set, batch size); the target and heads load once, when needed,
    and every set is padded to one shape (each decoder compiles once per batch size)."""
    loaded = None
    records = []
    for batch in args.batches:
        for prompt_set in PROMPT_SETS:
            name = f"eval-{prompt_set}-b{batch}"
            record = stages.reuse(name, eval_settings(args), eval_derived())
            if record is None:
                loaded = loaded or load_models(args, data, trained)
                record = evaluate(args, stages, name, prompt_set, batch, data["target"], *loaded)
            records.append({**record, "dataset": prompt_set, "batch": batch})
    return records


def load_models(args, data: dict, trained: dict):
    """(target, heads, {prompt set: prompt ids}, the shape every decoder shares)."""
    import peagle_jax as pj
    from infer.compare import Head, shape_for
    from infer.load import source_prompt_ids

    target = pj.load_target(data["target"])
    # the engine's mode is the trainer's: parallel, chain or dflash
    heads = [Head(HEADS[mode], pj.load_drafter(trained[mode]["summary"]["head_dir"]), mode) for mode in HEADS]
    prompts = {s: source_prompt_ids(target, s, args.prompts_per_set, args.max_prompt_tokens) for s in PROMPT_SETS}
    shape = shape_for([p for ids in prompts.values() for p in ids], args.max_new_tokens, max(args.ks))
    return target, heads, prompts, shape


def bench_command(args, target_dir: str, heads, prompt_set: str, batch: int) -> str:
    """The `python -m infer bench` line of the same measurement (except that the report pads
    both prompt sets to one shape); bench takes each head's mode from its config."""
    drafters = " ".join(f"--drafter {h.drafter.path}" for h in heads)
    return (
        f"python -m infer bench --target {target_dir} {drafters} --k {','.join(map(str, args.ks))} "
        f"--prompts {prompt_set} --limit {args.prompts_per_set} --max-prompt-tokens {args.max_prompt_tokens} "
        f"--batch-size {batch} --max-new-tokens {args.max_new_tokens}"
    )


def evaluate(
    args, stages: Stages, name: str, prompt_set: str, batch: int, target_dir: str, target, heads, prompts, shape
) -> dict:
    from infer.compare import compare

    t0 = time.perf_counter()
    log(f"stage {name}: plain decoding and {', '.join(h.label for h in heads)} at K = {args.ks}")
    load = os.getloadavg()[0]
    result = compare(
        target, heads, args.ks, prompts[prompt_set], batch_size=batch, max_new_tokens=args.max_new_tokens, shape=shape
    )
    result.pop("per_batch")
    return stages.finish(
        name,
        {**eval_settings(args), **eval_derived()},
        time.perf_counter() - t0,
        commands=[bench_command(args, target_dir, heads, prompt_set, batch)],
        result=result,
        load_average=[load, os.getloadavg()[0]],
    )


def hardware() -> dict:
    import jax

    cpu = platform.processor()
    try:
        cpu = next(
            ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln
        )
    except (OSError, StopIteration):
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def baseline_row(ev: dict) -> dict:
    """Plain decoding on one (prompt set, batch size)."""
    res, base = ev["result"], ev["result"]["baseline"]
    return {
        "dataset": ev["dataset"],
        "batch": ev["batch"],
        "tokens_per_second": base["tokens_per_second"],
        "new_tokens": base["new_tokens"],
        "prompts": res["prompts"],
        "step_ms": 1000 * ev["batch"] / base["tokens_per_second"],
    }


def head_rows(ev: dict, step_ms: float) -> list[dict]:
    """One row per (head, K) of one evaluation stage, with the cost model: where verifying K+1
    tokens costs one decode step (`step_ms`), a round takes step + drafter."""
    rows = []
    for r in ev["result"]["runs"]:
        row = {"head": r["head"], "mode": r["mode"], "dataset": ev["dataset"], "k": r["k"], "batch": ev["batch"]}
        row.update({key: r[key] for key in ROW_KEYS})
        row["model_speedup"] = row["acceptance_length"] * step_ms / (step_ms + row["drafter_ms"])
        row["verify_steps"] = row["verify_ms"] / step_ms
        rows.append(row)
    return rows


def settings_of(args) -> dict:
    return {
        "target": args.target,
        "smoke": args.smoke,
        "budget": args.budget,
        "steps": args.steps,
        "regenerate": args.regenerate,
        "prompts_per_set": args.prompts_per_set,
        "max_new_tokens": args.max_new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "ks": args.ks,
        "batches": args.batches,
        "temperature": 0.0,
        "heads": list(HEADS.values()),
        "dflash_block_size": dflash_block_size(args.ks),
    }


def stage_times(data: dict, trained: dict, evals: list[dict]) -> dict:
    """Each stage's wall time, commands (as `shown`: no machine's folders, also in records made
    before the evaluations' commands went through it) and load average, in the order they ran."""
    stages = {
        "data": data,
        **{f"train-{m}": record for m, record in trained.items()},
        **{f"eval-{e['dataset']}-b{e['batch']}": e for e in evals},
    }
    return {
        name: {"seconds": s["seconds"], "commands": [shown(shlex.split(c)) for c in s["commands"]],
               "load_average": s.get("load_average")}
        for name, s in stages.items()
    }  # fmt: skip


def collect(args, data: dict, trained: dict, evals: list[dict], wall: float) -> dict:
    """The results dict (OUT/results.json) from the stage records."""
    baseline = [baseline_row(ev) for ev in evals]
    rows = [r for ev, b in zip(evals, baseline) for r in head_rows(ev, b["step_ms"])]
    return {
        "settings": settings_of(args),
        "hardware": hardware(),
        "command": shlex.join(["python", "-m", "report", *args.argv]),
        "stages": stage_times(data, trained, evals),
        "wall_seconds_this_run": wall,
        "data": data["data"],
        "training": {HEADS[m]: record["summary"] for m, record in trained.items()},
        "baseline": baseline,
        "results": rows,
        "greedy": {
            "equal": sum(r["prompts"] - r["greedy_mismatches"] for r in rows),
            "total": sum(r["prompts"] for r in rows),
        },
    }
