"""The plan of one job on one device: the programs built, compiled, printed and summarised."""

from __future__ import annotations

import dataclasses

import jax

from peagle_jax.hardware.devices import Device, topology_devices
from peagle_jax.hardware.launches import Launches
from peagle_jax.hardware.roofline import Estimate, estimate
from plan.execute import run_compiled
from plan.programs import (
    Program,
    abstract_head,
    abstract_target,
    compile_traced,
    mesh_of,
    serve_round,
    server_programs,
    train_step,
)

__all__ = ["plan", "planned_ok", "job_programs", "line", "fits", "program_estimate", "round_costs"]

GiB = 1 << 30
MODES = {
    "train": ("parallel", "chain", "dflash"),
    "serve": ("parallel", "chain", "dflash", "none"),
    "server": ("parallel", "chain", "dflash", "none"),  # python -m infer serve: prefill, insert, step
}


def fits(p: Program, device: Device, headroom: float) -> bool:
    return p.compiled and p.peak_bytes <= headroom * device.memory_bytes


def program_estimate(p: Program, device: Device) -> Estimate | None:
    """The roofline estimate of a compiled program on `device` (None when refused)."""
    if not p.compiled or p.flops is None:
        return None
    sizes = dict(
        argument_bytes=p.argument_bytes, output_bytes=p.output_bytes, alias_bytes=p.alias_bytes,
        gathered_bytes=p.gathered_bytes,
    )  # fmt: skip
    return estimate(p.flops, device.count, device=device, **sizes)


def line(p: Program, device: Device, headroom: float) -> str:
    """One line: the verdict, bytes per device against its memory, kernels, the roofline
    estimate, compile time."""
    if not p.compiled:
        return f"REFUSED  {p.name}: {p.error}  ({p.compile_seconds:.1f} s)"
    mem = device.memory_bytes
    verdict = "fits" if fits(p, device, headroom) else "DOES NOT FIT"
    return (
        f"compiled {p.name}: {verdict}; per device args {p.argument_bytes / GiB:.2f} + temp {p.temp_bytes / GiB:.2f}"
        f" + out {p.output_bytes / GiB:.2f} - aliased {p.alias_bytes / GiB:.2f} = {p.peak_bytes / GiB:.2f} GiB"
        f" of {mem / GiB:.1f} GiB (headroom {(mem - p.peak_bytes) / GiB:.2f} GiB);"
        f" kernels: {', '.join(p.kernels) or 'none'}; {_launches_text(p.launches)};"
        f" {_estimate_text(program_estimate(p, device))};"
        f" {p.compile_seconds:.1f} s"
    )


def _launches_text(n: Launches | None) -> str:
    if n is None:
        return "launches unknown"
    return f"{n.total} kernel launches ({n.fusions} fusions, {n.custom_calls} custom calls, {n.other} other)"


def _estimate_text(e: Estimate) -> str:
    return (
        f"estimate (roofline) >= {1e3 * e.seconds:.3g} ms, {e.bound}-bound"
        f" ({e.flops / 1e12:.3g} TFLOP, {e.bytes / GiB:.3g} GiB moved per device)"
    )


def job_programs(job: str, modes, target, *, tokens: int, batch: int, k: int, cache_len: int, flags=()):
    """(name, trace) of each program of the job: train steps, or serving rounds and the decode step."""
    out = []
    for mode in modes:
        if job == "train":
            trace = _train_trace(target, mode, tokens, batch, flags)
            out.append((f"train/{mode} tokens={tokens} batch={batch}", trace))
        elif job == "server":
            head = None if mode == "none" else abstract_head(target, mode, k=8, dtype=target.dtype.name)
            out += server_programs(target, head, mode, batch=batch, k=k, cache_len=cache_len, prompt=tokens)
        else:
            trace = _serve_trace(target, mode, batch, k, cache_len)
            name = "decode step" if mode == "none" else f"round/{mode} k={k}"
            out.append((f"serve/{name} batch={batch} cache={cache_len}", trace))
    return out


def _train_trace(target, mode, tokens, batch, flags):
    return lambda: train_step(target, mode, tokens=tokens, batch=batch, flags=flags)


def _serve_trace(target, mode, batch, k, cache_len):
    def trace():
        head = None if mode == "none" else abstract_head(target, mode, k=8, dtype=target.dtype.name)
        return serve_round(target, head, mode, batch=batch, k=k, cache_len=cache_len)

    return trace


def local_devices(device: Device) -> list:
    """This machine's devices when they are `device` (for --run), else a UsageError naming both."""
    from kernels.limits import device_name
    from peagle_jax.runtime.command_line import UsageError

    devs = jax.devices()
    if device_name(devs[0]) != device.kind or len(devs) < device.count or device.hosts > 1:
        have = f"{len(devs)} x {devs[0].device_kind} ({devs[0].platform})"
        raise UsageError(f"--run: this machine has {have}, the plan is for {device.describe()}: run it there")
    return devs[: device.count]


def run_line(name: str, measured: dict, rec: dict) -> str:
    """What running a program measured, beside its plan: step time against the roofline estimate,
    the process's peak device memory against the planned peak."""
    text = f"ran {name}: {measured['step_ms']:.3g} ms a step (median of {measured['steps']})"
    est = rec.get("estimate")
    if est:
        ms = 1e3 * est["estimate_seconds"]
        text += f", estimate (roofline) {ms:.3g} ms: measured / estimate {measured['step_ms'] / ms:.2f}"
    peak = measured["peak_bytes_in_use"]
    if peak:
        text += f"; peak {peak / GiB:.2f} GiB in use, planned {rec['peak_bytes'] / GiB:.2f} ({peak / rec['peak_bytes']:.2f}x)"
    return text


def plan(args, device: Device, tcfg) -> dict:
    """Compiles the job's programs for `device` (printing one line each) -> the JSON summary; with
    `args.run`, for this machine's devices, and runs each (`execute.run_compiled`)."""
    from kernels.limits import on_device

    devices = local_devices(device) if getattr(args, "run", False) else topology_devices(device)
    mesh = mesh_of(devices, args.job, args.tensor, args.data)
    used = list(mesh.devices.flat)  # --tensor x --data: maybe fewer than the machine's
    device = dataclasses.replace(device, count=len(used), hosts=len({d.process_index for d in used}))
    print(f"{device.name}: {device.describe()}; target {tcfg.model_type} x {tcfg.num_layers} layers")
    target = abstract_target(tcfg, "bfloat16", mesh)
    modes = args.modes.split(",") if args.modes else MODES[args.job]
    batch = args.batch or (mesh.shape["fsdp"] if args.job == "train" else args.data)
    results, largest = [], {}
    with on_device(device.kind):
        for mode in modes:
            sizes = _search_sizes(args) if args.search else [None]
            best = None
            for size in sizes:
                tokens, b = (size or args.tokens, batch) if args.job == "train" else (args.tokens, size or batch)
                programs = job_programs(
                    args.job, [mode], target, tokens=tokens, batch=b, k=args.k, cache_len=args.cache_len,
                    flags=args.train_flag,
                )  # fmt: skip
                if not all(
                    _one(args, device, name, trace, results, tokens=tokens, batch=b) for name, trace in programs
                ):
                    break
                best = size
            if args.search:
                largest[mode] = best
                print(f"largest that fits, {mode}: {best or 'none'} {'tokens' if args.job == 'train' else 'rows'}")
    costs = round_costs(results)
    for name, cost in costs.items():
        print(f"estimate (roofline): {name} costs {cost:.2f} decode steps: speedup ~ acceptance length / {cost:.2f}")
    return {"device": dataclasses.asdict(device), "target": tcfg.model_type, "layers": tcfg.num_layers,
            "job": args.job, "programs": results, "largest": largest,
            "round_cost_in_decode_steps": costs}  # fmt: skip


def _one(args, device: Device, name: str, trace, results: list, **sizes) -> bool:
    """Compiles one program (and with --run, runs it), prints its lines, adds its record to
    `results`: whether it fits."""
    print(f"compiling {name} ...", flush=True)  # minutes, for a TPU step on a few cores
    p, compiled = compile_traced(name, trace)
    print(line(p, device, args.headroom), flush=True)
    results.append(_record(p, device, args.headroom, cache_len=args.cache_len, **sizes))
    if getattr(args, "run", False) and compiled is not None:
        results[-1]["run"] = run_compiled(compiled)
        print(run_line(name, results[-1]["run"], results[-1]), flush=True)
    return fits(p, device, args.headroom)


def planned_ok(result: dict) -> bool:
    """Exit status 0: every program fits (a search: some size fits in every mode)."""
    if result["largest"]:
        return all(size is not None for size in result["largest"].values())
    return all(p["fits"] for p in result["programs"])


def _search_sizes(args) -> list[int]:
    start = args.tokens if args.job == "train" else (args.batch or 1)
    return [start * 2**i for i in range(12)]


def _record(p: Program, device: Device, headroom: float, **sizes) -> dict:
    rec = dataclasses.asdict(p) | sizes
    rec["launches"] = None if p.launches is None else {**rec["launches"], "total": p.launches.total}
    rec.update(peak_bytes=p.peak_bytes, device_memory_bytes=device.memory_bytes, fits=fits(p, device, headroom))
    rec["headroom_bytes"] = device.memory_bytes - p.peak_bytes if p.compiled else None
    est = program_estimate(p, device)
    rec["estimate"] = None if est is None else est.as_dict()
    if est is not None and p.name.startswith("train/"):
        rec["estimate"]["tokens_per_second_per_device"] = sizes["tokens"] * sizes["batch"] / est.seconds / device.count
    return rec


def round_costs(records: list[dict]) -> dict[str, float]:
    """Each speculative round's estimated time in plain decode steps (the decode step compiled at
    the same batch and cache): a round that emits tau tokens on average is about tau / cost times
    as fast as plain decoding."""
    step = {(r["batch"], r["cache_len"]): r["estimate"] for r in records if "decode step" in r["name"]}
    costs = {}
    for r in records:
        base = step.get((r["batch"], r["cache_len"]))
        if "/round/" in r["name"] and r["estimate"] and base:
            costs[r["name"]] = r["estimate"]["estimate_seconds"] / base["estimate_seconds"]
    return costs
