"""Memory plans from the devices' own compilers: the released heads' targets on H100 / TPU slices.

Each case is one `python -m peagle_jax.plan` run (no device: the compile venv's deviceless GPU
and TPU compilers, abstract weights, the target's real layer count) whose JSON lands in --out,
one file per case; a case whose file exists is not run again, so an interrupted sweep resumes.
`--publish` turns every case file there into bench/results/memory_plan.json (with
roofline_estimate.json, the programs' estimates, and memory_fits.json, what fits per target and
device read off the plan's rows), which `python -m bench.render_results` renders into
docs/benchmarks.md; `--publish --merge` replaces only the rows of the programs those files hold
(a few cases planned again on a machine without the rest).

    .venv-compile/bin/python -m bench.memory_plan [--only SUBSTRING] [--jobs N] [--out DIR] [--publish [--merge]]

Train cases search the longest sequence (4k, 8k, 16k, ... tokens or from --tokens, one sequence per device,
sequence partitioning auto as `python -m train` runs it) until the compiler refuses the step or
its plan passes 90% of a device's memory; serve cases compile the P-EAGLE round (K = 7) and the
plain decode step at the batch and cache length named.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Case:
    target: str
    device: str
    job: str
    flags: tuple[str, ...] = ()
    tag: str = ""

    @property
    def name(self) -> str:
        return "_".join(x for x in (self.target, self.device, self.job, self.tag) if x)

    def command(self, out: Path) -> list[str]:
        head = ["-m", "peagle_jax.plan", "--target", self.target, "--device", self.device, "--job", self.job]
        return [*head, *self.flags, "--json", str(out)]


def train(device: str, *flags: str, tag: str = "", target: str = "Llama-3.1-8B") -> Case:
    return Case(target, device, "train", ("--modes", "parallel", *flags), tag)


def serve(target: str, device: str, batch: int, cache: int) -> Case:
    flags = ("--modes", "parallel,none", "--batch", str(batch), "--cache-len", str(cache))
    return Case(target, device, "serve", flags, f"batch{batch}_cache{cache // 1024}k")


TARGETS = ("Llama-3.1-8B", "Qwen3-8B", "Qwen3-30B-A3B", "Gemma-3-270M", "Gemma-3-1B", "Gemma-3-27B",
           "GPT-OSS-20B", "GPT-OSS-120B")  # fmt: skip
# serving on GPU: one H100 where the bf16 target leaves room for a cache, else a host of 8
SERVE_GPU = {"Qwen3-30B-A3B": "h100x8", "Gemma-3-27B": "h100x8", "GPT-OSS-120B": "h100x8"}


# where v5p-8 searches start: sizes a v5p chip surely fits (6x a v5e chip's memory, the weights split
# 4 ways instead of 8: at least the v5e-8 search's longest; GPT-OSS-120B, none on v5e-8, from 4k;
# Qwen3-30B-A3B, whose MoE step compiles slowest, from 131,072: 40 GiB a chip), so the minutes-long
# TPU compiles go to the sizes in question
V5P_START = {"Llama-3.1-8B": 65536, "Qwen3-8B": 65536, "Qwen3-30B-A3B": 131072, "Gemma-3-270M": 131072,
             "Gemma-3-1B": 65536, "Gemma-3-27B": 16384, "GPT-OSS-20B": 16384, "GPT-OSS-120B": 4096}  # fmt: skip


def train_start(target: str, device: str) -> tuple[str, ...]:
    return ("--tokens", str(V5P_START[target])) if device == "v5p-8" else ()


# in the order worth waiting for: train searches, then GPU serving (8k caches first), one-segment
# searches, TPU serving
CASES = [
    *(
        train(d, "--search", *train_start(t, d), target=t)
        for t in TARGETS
        for d in ("h100", "h100x8", "v5e-8", "v5p-8")
    ),
    *(serve(t, SERVE_GPU.get(t, "h100"), b, c) for c in (8192, 32768) for t in TARGETS for b in (1, 16, 64)),
    *(train("h100", "--search", "--train-flag=--loop.segments=1", tag="flat", target=t) for t in TARGETS),
    *(serve(t, "v5p-8", b, c) for c in (8192, 32768) for t in TARGETS for b in (1, 16, 64)),
]


def run_case(case: Case, out: Path, python: str) -> None:
    """One plan run into `out`/<name>.json (written whole, after the run) and its log beside it."""
    dest, log = out / f"{case.name}.json", out / f"{case.name}.log"
    if dest.exists():  # planned meanwhile (by another sweep over the same folder)
        return
    tmp = dest.with_suffix(".part")
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run([python, *case.command(tmp)], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
    if not tmp.exists():
        print(f"{case.name}: no result (exit {proc.returncode}); see {log}", flush=True)
        return
    result = json.loads(tmp.read_text()) | {"case": dataclasses.asdict(case), "wall_s": time.perf_counter() - t0}
    dest.write_text(json.dumps(result, indent=1) + "\n")
    tmp.unlink()
    print(f"{case.name}: {len(result['programs'])} programs, {result['wall_s']:.0f} s", flush=True)


def program_label(result: dict, p: dict) -> str:
    """The program's name, and "one segment" for a train case that turns sequence partitioning off."""
    flat = "--train-flag=--loop.segments=1" in result.get("case", {}).get("flags", [])
    return p["name"].split(" ")[0] + (", one segment" if flat else "")


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def rows_of(result: dict) -> list[list]:
    """One table row per compiled (or refused) program of a case."""
    dev = result["device"]
    rows = []
    for p in result["programs"]:
        size = f"{p['tokens']:,} tokens" if result["job"] == "train" else f"batch {p['batch']}"
        cache = "-" if result["job"] == "train" else f"{p['cache_len']:,}"
        verdict = "fits" if p["fits"] else ("does not fit" if p["compiled"] else "refused")
        size_of = gib if p["compiled"] else (lambda _: "-")  # the compiler refused it: no plan to size
        rows.append([
            f"{result['name']} x{result['layers']}", dev["name"], program_label(result, p), size, cache,
            size_of(p["argument_bytes"]), size_of(p["temp_bytes"]), size_of(p["peak_bytes"]),
            f"{dev['memory_bytes'] / GiB:.1f}", gib(p["headroom_bytes"]), verdict, f"{p['compile_seconds']:.0f}",
        ])  # fmt: skip
    return rows


def longest(results: list[dict]) -> list[str]:
    """A note per train case: the longest sequence whose step compiled and fit."""
    cases: dict[str, list[dict]] = {}
    for r in results:
        if r["job"] == "train":
            label = program_label(r, r["programs"][0]).split("/")[1]
            cases.setdefault(f"{r['name']} x{r['layers']} {label} on {r['device']['name']}", []).append(r)
    notes = []
    for where, rs in cases.items():
        ok = [p["tokens"] for r in rs for p in r["programs"] if p["fits"]]
        best = f"{max(ok):,} tokens" if ok else "none of the sizes compiled"
        if ok and not any(r.get("largest") for r in rs):  # single sizes compiled, no search past them
            best = f"at least {best} (the sizes in the table compiled, no search past them)"
        notes.append(f"Longest training sequence (powers of two), {where}: {best}.")
    return notes


def first_sizes(result: dict) -> tuple[int, int]:
    """(cache length, batch) of a case's first program: the serve rows' order."""
    p = result["programs"][0]
    return p.get("cache_len", 0), p["batch"]


def estimate_rows(result: dict) -> list[list]:
    """One row per program of a case that carries the roofline estimate (`peagle_jax.hardware.roofline`)."""
    dev, rows = result["device"], []
    costs = result.get("round_cost_in_decode_steps", {})
    for p in result["programs"]:
        e = p.get("estimate")
        if not e:
            continue
        if result["job"] == "train":
            size, rate = f"{p['tokens']:,} tokens", f"{e['tokens_per_second_per_device']:,.0f} tokens/s"
        else:
            size, cost = f"batch {p['batch']}, cache {p['cache_len']:,}", costs.get(p["name"])
            rate = f"{cost:.2f} decode steps" if cost else "1 decode step"
        rows.append([
            f"{result['name']} x{result['layers']}", dev["name"], program_label(result, p), size,
            f"{e['flops'] / 1e12:.3g}", f"{e['bytes'] / GiB:.3g}", f"{1e3 * e['compute_seconds']:.3g}",
            f"{1e3 * e['memory_seconds']:.3g}", f"{1e3 * e['estimate_seconds']:.3g}", e["bound"], rate,
        ])  # fmt: skip
    return rows


def header(title: str, order: int, setup: str) -> dict:
    """The fields every published result of this sweep shares (commands, hardware, commit)."""
    import jax

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {
        "title": title,
        "order": order,
        "setup": setup,
        "command": [
            "make compile-venv",
            ".venv-compile/bin/python -m bench.memory_plan           # every case (resumable)",
            ".venv-compile/bin/python -m bench.memory_plan --publish",
        ],
        "hardware": "compiled on 2 CPU cores (no accelerator); planned for the devices named in the table",
        "jax": jax.__version__,
        "commit": commit.stdout.strip(),
        "date": datetime.date.today().isoformat(),
        "design": "docs/device.md",
    }


LONGEST = "Longest training sequence"


def merged(old: list, new: list, key) -> list:
    """`old` with every item whose key a `new` item has replaced, in place, by the new items of
    that key; the new items of other keys after."""
    groups: dict = {}
    for item in new:
        groups.setdefault(key(item), []).append(item)
    out, done = [], set()
    for item in old:
        k = key(item)
        if k not in groups:
            out.append(item)
        elif k not in done:
            out.extend(groups[k])
            done.add(k)
    return out + [item for k, items in groups.items() if k not in done for item in items]


def plan_case(row: list) -> str:
    """A memory-plan serving row's case: its batch and cache columns."""
    return f"{row[3]}, cache {row[4]}"


def program_of(row: list, case=plan_case) -> str:
    """What a published row plans, the unit a merge replaces and `planned_at` dates: a train
    search (target, program, device; its rows go together), or one serving case (`case(row)`:
    batch and cache)."""
    name = f"{row[0]} {row[2]} on {row[1]}"
    return f"{name} ({case(row)})" if row[2].startswith("serve/") else name


def write_published(data: dict, name: str, merge: bool, case=plan_case) -> Path:
    """bench/results/<name>.json. With `merge`, the published rows of the programs the new cases
    did not plan are kept (rows keyed by `program_of`; "Longest ..." notes by what they name), and
    `planned_at` records the commit each program was planned at, across merges (a note names
    them; the commit of most programs as "the other rows")."""
    dest, data = ROOT / "bench" / "results" / f"{name}.json", dict(data)
    if merge and dest.exists():
        old = json.loads(dest.read_text())
        key = functools.partial(program_of, case=case)
        when = old.get("planned_at") or {key(r): f"{old['commit']} ({old['date']})" for r in old["rows"]}
        when |= {key(r): f"{data['commit']} ({data['date']})" for r in data["rows"]}
        data["rows"] = merged(old["rows"], data["rows"], key)
        longest_notes = [n for n in old["notes"] if n.startswith(LONGEST)]
        notes = merged(longest_notes, data["notes"], lambda note: note.split(":")[0])
        data["planned_at"] = {p: when[p] for p in dict.fromkeys(map(key, data["rows"]))}
        data["notes"] = [*notes, planned_note(data["planned_at"])]
    dest.write_text(json.dumps(data, indent=1) + "\n")
    return dest


def planned_note(planned_at: dict) -> str:
    """Which rows were planned at which commit: each commit but the most common one with its
    programs (a program's serving cases named together when they were all planned at that commit)."""
    by: dict[str, list] = {}
    for program, when in planned_at.items():
        by.setdefault(when, []).append(program)
    most = max(by, key=lambda w: len(by[w]))
    named = [f"Planned at {w}: {'; '.join(program_names(ps, planned_at))}." for w, ps in by.items() if w != most]
    return " ".join([*named, f"The other rows: at {most}." if named else f"Planned at {most}."])


def program_names(programs: list[str], planned_at: dict) -> list[str]:
    """`programs` (keys of `planned_at`), each serving program whose cases are all among them once,
    by its name without the case."""
    out = []
    for p in programs:
        whole = p.split(" (")[0]
        cases = [q for q in planned_at if q.split(" (")[0] == whole]
        out.append(whole if set(cases) <= set(programs) else p)
    return list(dict.fromkeys(out))


def publish_estimates(results: list[dict], merge: bool = False) -> Path:
    data = header(
        "Roofline estimates on H100 and TPU slices (estimates, not measurements)",
        76,
        "The roofline estimate `python -m peagle_jax.plan` prints for each compiled program, per device: "
        "max(FLOPs / peak bf16 FLOP rate, bytes / HBM bandwidth). FLOPs: the program's jaxpr (every matrix "
        "product, the Pallas kernels' analytic counts, scans times their length) over the devices. Bytes: XLA's "
        "plan, every argument read once but the tables only gathered from (embeddings), every output not "
        "aliased written once. Peak rates: H100 / H200 SXM 989 TFLOP/s, 3.35 / 4.8 TB/s; v5e 197 TFLOP/s, "
        "819 GB/s; v5p 459 TFLOP/s, 2.77 TB/s; v6e 918 TFLOP/s, 1.64 TB/s. A lower bound on the time, but "
        "for the head's attention, counted as causal over its rows (a train step's FLOPs 1.5% high at 4,096 "
        "tokens, 10% at 65,536: docs/device.md); the device playbook records measured / "
        "estimated. Rate: train tokens/s per device at the estimate; serve: the round's time in plain decode "
        "steps at the same batch and cache, so the speedup at acceptance length tau is about tau / that.",
    )
    data["columns"] = [
        "target x layers", "device", "program", "size", "TFLOP / device", "GiB moved / device",
        "compute ms", "memory ms", "estimate ms", "bound", "rate",
    ]  # fmt: skip
    data["rows"] = [row for r in results for row in estimate_rows(r)]
    data["notes"] = ["Cases compiled without the estimate (the other rows of the memory plans) are not listed."]
    return write_published(data, "roofline_estimate", merge, case=lambda row: row[3])  # "batch B, cache C"


# what fits, per target: (column, devices, program, cache) over the memory plans' rows
FITS_COLUMNS = [
    *((f"train {d}", (d,), "train/parallel", "-") for d in ("h100", "h100x8", "v5e-8", "v5p-8")),
    ("train h100, one segment", ("h100",), "train/parallel, one segment", "-"),
    *(
        (f"serve {where}, cache {c}", devices, "serve/round/parallel", c)
        for where, devices in (("GPU", ("h100", "h100x8")), ("v5p-8", ("v5p-8",)))
        for c in ("8,192", "32,768")
    ),
]


def size_of(row: list) -> int:
    """A published row's tokens (train) or batch (serve)."""
    return int("".join(ch for ch in row[3] if ch.isdigit()))


def fits_cell(rows: list[list], devices: tuple, program: str, cache: str) -> str:
    """The largest size of one target's program that fits on `devices` ("≥" when the largest train
    size planned fit; the device when several are allowed); "none" with the smallest size's peak."""
    mine = sorted((r for r in rows if r[1] in devices and r[2] == program and r[4] == cache), key=size_of)
    ok = [r for r in mine if r[10] == "fits"]
    if not mine:
        return "-"
    if not ok:
        first = mine[0]
        why = "refused" if first[10] == "refused" else f"{first[7]} GiB"
        return f"none ({size_of(first):,}: {why})"
    best = ok[-1]
    cell = ("≥ " if best is mine[-1] and program.startswith("train") else "") + f"{size_of(best):,}"
    return cell + (f" on {best[1]}" if len(devices) > 1 else "")


def publish_fits(plan: dict) -> Path:
    """The memory plans' table read as what fits: one row per target, a column per device and job."""
    data = header(
        "What fits: the longest training sequence and the largest serving batch, per target and device",
        74,
        "Read off the memory plans below (the devices' own compilers, no device; a plan fits within 90% of "
        "a device's memory). Train: the longest sequence, in tokens per device and powers of two from 4,096, "
        "whose step (the default 1-layer P-EAGLE head, AdamW) fits; '≥' where the search stopped at its last "
        "size still fitting. Serve: the largest batch of 1, 16 and 64 whose P-EAGLE round (K = 7) fits at that "
        "KV-cache length, on one H100 or, where the bf16 target leaves no room for a cache there, 8 H100. "
        "'none': the smallest size planned and its peak per device; '-': not planned yet.",
    )
    order = {t: i for i, t in enumerate(TARGETS)}  # the presets' order; others after, as they come
    targets = sorted(dict.fromkeys(r[0] for r in plan["rows"]), key=lambda t: order.get(t.split(" x")[0], len(order)))
    data["columns"] = ["target x layers", *(c[0] for c in FITS_COLUMNS)]
    data["rows"] = [
        [t, *(fits_cell([r for r in plan["rows"] if r[0] == t], *c[1:]) for c in FITS_COLUMNS)] for t in targets
    ]
    data["notes"] = [
        "Derived from bench/results/memory_plan.json, whose notes name the commit each row was planned at."
    ]
    return write_published(data, "memory_fits", merge=False)


def publish(out: Path, merge: bool = False) -> Path:
    results = [json.loads(p.read_text()) | {"name": p.stem.split("_")[0]} for p in sorted(out.glob("*.json"))]
    results.sort(key=lambda r: (r["job"] != "train", r["name"], r["device"]["name"], first_sizes(r)))
    publish_estimates(results, merge)
    data = header(
        "Memory plans on H100 and TPU slices, from the devices' compilers",
        75,
        (
            "XLA's plan of each program's buffers per device (arguments: weights, optimizer state, batch or KV "
            "cache; temporaries; peak = arguments + temporaries + outputs not aliased to a donated argument), "
            "from the GPU compiler (XLA + Triton + ptxas for sm_90) and the TPU compiler (XLA + Mosaic) run "
            "without a device on abstract weights at the targets' full layer counts. Train: the default "
            "P-EAGLE head (1 layer, K 8, draft vocabulary 16384, f32 master weights, bf16 compute, AdamW), one "
            "sequence per device, sequence partitioning auto; weights and sequences sharded over fsdp (every "
            "device). Serve: the P-EAGLE round at K = 7 and the plain decode step, bf16, heads split over "
            "tensor within a host. 'fits' = peak within 90% of the device's memory."
        ),
    )
    data |= {
        "columns": [
            "target x layers",
            "device",
            "program",
            "size",
            "cache",
            "args GiB",
            "temp GiB",
            "peak GiB",
            "device GiB",
            "headroom GiB",
            "verdict",
            "compile s",
        ],  # fmt: skip
        "rows": [row for r in results for row in rows_of(r)],
        "notes": [
            *longest(results),
            "The train rows are planned with the trainer's shardings and each device's target kept to its own "
            "rows (`peagle_jax.models.rows.rows_sharded`); CHANGELOG.md has the figures planned before.",
            "What only a device can tell: speed, the compiled kernels' numerics, and memory outside XLA's plan "
            "(the runtime's reservations, fragmentation); see docs/device.md.",
        ],
    }
    dest = write_published(data, "memory_plan", merge)
    publish_fits(json.loads(dest.read_text()))
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory_plan", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "memory_plan")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--publish", action="store_true", help="write bench/results/memory_plan.json from --out")
    ap.add_argument(
        "--merge", action="store_true", help="with --publish: keep the published rows of the programs --out lacks"
    )
    ap.add_argument("--jobs", type=int, default=1, help="cases compiled at once (a compile uses about one core)")
    ap.add_argument("--list", action="store_true", help="print the cases' names and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(c.name for c in CASES))
        return 0
    if args.publish:
        print(f"wrote {publish(args.out, args.merge)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [c for c in CASES if args.only in c.name and not (args.out / f"{c.name}.json").exists()]
    with ThreadPoolExecutor(args.jobs) as pool:  # each case is its own compiler process
        list(pool.map(lambda case: run_case(case, args.out, sys.executable), todo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
