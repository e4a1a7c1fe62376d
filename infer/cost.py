"""`python -m infer cost`: what one speculative round costs on this device for this target, and
the acceptance length a head must reach to pay off, before any head is trained.

Per batch size: one plain decode step (mode none) after `--prompt-len` prompt tokens, and its
HBM roofline (the bytes a step must read: the weights, less an untied embedding table of which
one row is gathered, plus the filled KV cache; over the bandwidth a matrix-vector product
reaches in the same run). On a mesh (--tensor, --data, --devices) the bytes are each device's:
the weights over `tensor`, the rows of its data group, their KV heads over `tensor`.
Per (mode, K, batch): the whole round, the drafter alone (half the drafts accepted), the
target's verification of K+1 tokens alone (median ms), and the break-even acceptance length
round / step (a head whose acceptance length is above it generates faster than plain decoding).
Compile seconds per program (its first call less a warm call) sit beside each figure, and each
phase (weights, heads, bandwidth, each program's compile and timing) is logged on stderr as it
ends; `--json` is rewritten after every row, so a killed run still says where its time went.

Prompts are synthetic token ids (no tokenizer needed), so `--load-format dummy` runs anywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp

from infer.load import mesh_record, synthetic_prompts
from peagle_jax.engine import SpeculativeDecoder
from peagle_jax.engine.costs import round_breakdown, round_timing
from peagle_jax.runtime.folders import atomic_write_text
from peagle_jax.runtime.timing import timed

COLUMNS = (
    "mode",
    "K",
    "batch",
    "prompt",
    "step ms",
    "round ms",
    "drafter ms",
    "verify ms",
    "break-even AL",
    "compile s",
)


def log(message: str) -> None:
    print(f"[cost] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Report:
    """The results so far; `save` rewrites --json (atomically) after every phase and row."""

    path: str | None
    data: dict

    def phase_done(self, name: str, seconds: float) -> None:
        self.data["phases"].append({"phase": name, "seconds": round(seconds, 3)})
        log(f"{name}: {seconds:.1f}s")
        self.save()

    def add(self, key: str, row: dict) -> None:
        self.data[key].append(row)
        self.save()

    def save(self) -> None:
        if self.path:
            atomic_write_text(self.path, json.dumps(self.data, indent=1))


@contextlib.contextmanager
def phase(report: Report, name: str):
    """Logs `name` with its seconds when it ends (a failure too, marked so)."""
    t = time.perf_counter()
    log(f"{name} ...")
    try:
        yield
    except BaseException:
        report.phase_done(f"{name} (failed)", time.perf_counter() - t)
        raise
    report.phase_done(name, time.perf_counter() - t)


def read_bandwidth(nbytes: int, dtype, reps: int = 5) -> float:
    """Bytes per second a matrix-vector product reads from a device matrix of about `nbytes`
    (a decode step's access pattern: every weight read once, for a few rows)."""
    dtype = jnp.dtype(dtype)
    cols = 4096
    rows = max(nbytes // (cols * dtype.itemsize), 1)
    w = jnp.ones((rows, cols), dtype)
    v = jnp.ones((cols,), dtype)
    matvec = jax.jit(lambda a, b: a @ b)
    return rows * cols * dtype.itemsize / (timed(lambda: matvec(w, v), reps).ms / 1000)


def step_bytes(target, batch: int, filled: int) -> int:
    """The bytes one plain decode step must read on each device: the weights (less an untied
    embedding table, of which it gathers one row per token) split over the mesh's `tensor`
    devices, and the KV cache of `filled` positions of each row of its data group (a sliding layer
    reads at most its window), split by KV heads over `tensor` where they divide."""
    c = target.config
    mesh = target.mesh
    tensor, data = (1, 1) if mesh is None else (mesh.shape["tensor"], mesh.shape["data"])
    weights = target.param_bytes
    if not c.tie_word_embeddings:
        weights -= c.vocab_size * c.hidden_size * target.dtype.itemsize
    per_token = 2 * c.num_kv_heads * c.head_dim * target.dtype.itemsize
    kv = sum(min(filled, c.window(i) or filled) for i in range(c.num_layers)) * per_token
    kv_split = tensor if c.num_kv_heads % tensor == 0 else 1
    return weights // tensor + -(-batch // data) * kv // kv_split


def plain_row(target, report: Report, batch: int, prompts, reps: int, bandwidth: float) -> dict:
    dec = SpeculativeDecoder(target, None, mode="none")
    with phase(report, f"plain decode step, batch {batch}, prompt {len(prompts[0])} (prefill, compile, {reps} timed)"):
        step = round_timing(dec, prompts, reps)
    nbytes = step_bytes(target, batch, len(prompts[0]))
    row = {
        "batch": batch,
        "prompt_len": len(prompts[0]),
        "step_ms": step.ms,
        "step_compile_s": step.compile_s,
        "step_bytes": nbytes,
        "roofline_ms": 1000 * nbytes / bandwidth,
        "measured_over_roofline": step.ms / (1000 * nbytes / bandwidth),
    }
    report.add("plain", row)
    return row


def round_row(target, report: Report, head, k: int, batch: int, prompts, reps: int, step_ms: float) -> dict:
    """One (mode, K, batch) row: the round, its parts, the break-even acceptance length."""
    mode, drafter = head
    dec = SpeculativeDecoder(target, drafter, k=k, mode=mode, deep_k="warn")
    where = f"{mode} K={k} batch {batch} prompt {len(prompts[0])}"
    with phase(report, f"{where}: drafter and verification alone"):
        parts = round_breakdown(dec, prompts, reps)
    with phase(report, f"{where}: whole round"):
        whole = round_timing(dec, prompts, reps)
    row = {
        "mode": mode,
        "k": k,
        "batch": batch,
        "prompt_len": len(prompts[0]),
        "step_ms": step_ms,
        "round_ms": whole.ms,
        "drafter_ms": parts["drafter_ms_per_round"],
        "verify_ms": parts["target_ms_per_round"],
        "break_even_acceptance_length": whole.ms / step_ms,
        "round_compile_s": whole.compile_s,
        "drafter_compile_s": parts["drafter_compile_s"],
        "verify_compile_s": parts["target_compile_s"],
    }
    report.add("rounds", row)
    return row


def measure(target, heads, ks, batches, prompt_lens, reps: int, report: Report) -> dict:
    """Every row of the command (see the module docstring); `heads` = [(mode, drafter)]. A
    (batch, prompt length) the device cannot run (its caches do not fit) is recorded in
    "refused" with the error's first line, and the next one is tried."""
    with phase(report, "read bandwidth (a matrix-vector product over the weights' bytes)"):
        bandwidth = read_bandwidth(min(max(target.param_bytes, 64 << 20), 4 << 30), target.dtype)
    report.data["bandwidth_bytes_per_s"] = bandwidth
    for prompt_len in prompt_lens:
        for batch in batches:
            try:
                _shape_rows(target, heads, ks, batch, prompt_len, reps, report, bandwidth)
            except Exception as err:  # noqa: BLE001 - out of memory, a cache past the context: that size's result
                why = " ".join(str(err).split())[:300]
                log(f"batch {batch} prompt {prompt_len}: refused: {type(err).__name__}: {why}")
                report.add(
                    "refused", {"batch": batch, "prompt_len": prompt_len, "error": f"{type(err).__name__}: {why}"}
                )
    return report.data


def _shape_rows(target, heads, ks, batch: int, prompt_len: int, reps: int, report: Report, bandwidth: float) -> None:
    prompts = synthetic_prompts(batch, prompt_len, target.config.vocab_size, target.config.eos_token_id)
    step = plain_row(target, report, batch, prompts, reps, bandwidth)
    for head in heads:
        for k in ks:
            round_row(target, report, head, k, batch, prompts, reps, step["step_ms"])


def table(data: dict) -> str:
    """The rows as a fixed-width table (plain step rows first, then the rounds)."""
    lines = [f"{'batch':>6}{'prompt':>8}{'step ms':>10}{'roofline ms':>13}{'measured/roofline':>19}{'compile s':>11}"]
    for p in data["plain"]:
        lines.append(
            f"{p['batch']:>6}{p['prompt_len']:>8}{p['step_ms']:>10.2f}{p['roofline_ms']:>13.3f}{p['measured_over_roofline']:>19.2f}"
            f"{p['step_compile_s']:>11.1f}"
        )
    lines.append("".join(f"{c:>14}" if i else f"{c:<10}" for i, c in enumerate(COLUMNS)))
    for r in data["rounds"]:
        values = (r["k"], r["batch"], r["prompt_len"], r["step_ms"], r["round_ms"], r["drafter_ms"], r["verify_ms"])
        values += (r["break_even_acceptance_length"], r["round_compile_s"])
        lines.append(f"{r['mode']:<10}" + "".join(f"{v:>14}" if isinstance(v, int) else f"{v:>14.2f}" for v in values))
    return "\n".join(lines)


def heads_for(args, target) -> list[tuple[str, object]]:
    """[(mode, drafter)]: a fresh head per mode for `new[:LAYERS]`, else the folder's head in each
    mode asked for (its own mode by default)."""
    from infer.load import load_head, new_head_layers

    if new_head_layers(args.drafter) is not None:
        return [(mode, load_head(args.drafter, target, mode)) for mode in args.modes or ("parallel", "chain")]
    drafter = load_head(args.drafter, target, "parallel")
    return [(mode, drafter) for mode in args.modes or (drafter.config.mode,)]


def run(args) -> dict:
    """The command: every row, a table on stdout, the JSON after every row."""
    from infer.load import load_target

    report = Report(
        args.json_out, {"command": " ".join(sys.argv), "phases": [], "plain": [], "rounds": [], "refused": []}
    )
    with phase(report, "target weights" + (" (dummy)" if args.load_format == "dummy" else "")):
        target = load_target(args)
    report.data.update(
        target=args.target,
        load_format=args.load_format,
        dtype=str(target.dtype),
        device=str(jax.devices()[0].device_kind),
        mesh=mesh_record(target.mesh),
        jax=jax.__version__,
        prompt_lens=args.prompt_len,
        compile_cache=None if getattr(args, "compile_cache", None) is None else str(args.compile_cache),
        reps=args.reps,
    )
    with phase(report, f"heads ({args.drafter})"):
        heads = heads_for(args, target)
    measure(target, heads, args.k, args.batch, args.prompt_len, args.reps, report)
    print(table(report.data))
    for r in report.data["refused"]:
        print(f"refused: batch {r['batch']} prompt {r['prompt_len']}: {r['error']}")
    if not report.data["plain"]:
        raise ValueError(f"no size could run; the first: {report.data['refused'][0]['error']}")
    return report.data
