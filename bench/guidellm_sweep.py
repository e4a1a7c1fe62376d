"""GuideLLM (vllm-project's load generator) against `python -m infer serve`, beside our own client.

It starts the server on 127.0.0.1 (Gemma-3-270M, the `make demo` head when it is there, else a
fresh random head) and, for each load and each number of concurrent streams, runs GuideLLM's
concurrent profile (`guidellm run`, a scenario file of its own: the OpenAI HTTP backend, chat
completions, streamed) with --requests-per-stream x streams requests (at least --min-requests),
then sends the very requests GuideLLM sent (their bodies, read back from its report) from our own
client (`bench.serve_bench`'s, with as many threads as streams) to the same server; --repeats
passes of each, in the order A B B A (the machine's load comes and goes). Loads:

- synthetic: GuideLLM's synthetic text, --prompt-tokens per prompt, --output-tokens each (it
  sends `ignore_eos`, so every request decodes exactly that many);
- mtbench: the MT-Bench first turns vendored in peagle_jax/engine/data (those that fit
  --max-len), --output-tokens each, from a JSONL file GuideLLM reads.

Reported per load and streams: GuideLLM's requests/s, output tokens/s, TTFT and inter-token
latency medians / p95 and its errored and incomplete requests; ours at the same concurrency; the
ratio of the two throughputs (the goal: within 5%).

    python -m bench.guidellm_sweep [--guidellm .venv-guidellm/bin/guidellm] [--streams 1,2,4,8,16,32] \
        [--loads synthetic,mtbench] [--requests-per-stream 2] [--min-requests 6] [--repeats 2] [--prompt-tokens 64] \
        [--output-tokens 32] [--drafter DIR|new] [--k 3] [--max-batch 32] [--max-len 512] \
        [--json bench/results/guidellm_sweep.json]

GuideLLM is a measurement tool, not a dependency: `make guidellm-venv` installs it in a venv of
its own. Nothing reaches the network: its tokenizer is the target folder's, its data synthetic
or the local file, and it runs with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.command import command_line
from bench.proc_cpu import CpuSampler
from bench.serve_bench import free_port, run_clients, start_server, stream_one, summary
from bench.serve_setup import add_server_args, head_words, run_facts, save, server_flags, server_line, target_folder

ROOT = Path(__file__).resolve().parent.parent
GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
GOAL = 0.05  # GuideLLM's throughput within 5% of ours
MEDIAN_KEYS = ("requests_per_s", "tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms")
MEDIAN_KEYS += ("server_cores", "client_cores")
COLUMNS = [
    "load",
    "streams",
    "requests",
    "GuideLLM req/s",
    "GuideLLM out tok/s",
    "ours out tok/s",
    "GuideLLM / ours",
    "GuideLLM TTFT p50 / p95 (ms)",
    "ours TTFT p50 / p95 (ms)",
    "GuideLLM ITL p50 / p95 (ms)",
    "ours ITL p50 / p95 (ms)",
    "errors GuideLLM / ours",
    "client cores GuideLLM / ours",
]


# ---------------------------------------------------------------- GuideLLM


def scenario(args, port: int, data: dict, streams: int, requests: int, report: Path) -> dict:
    """A GuideLLM scenario: `requests` chat requests from `streams` concurrent streams, greedy."""
    backend = {"kind": "openai_http", "target": f"http://127.0.0.1:{port}", "model": "bench"}
    backend |= {"request_format": "/v1/chat/completions", "extras": {"body": {"temperature": 0}}}
    return {
        "metadata": {"labels": {"load": data["kind"], "streams": str(streams)}},
        "spec": {
            "backend": backend,
            "profile": {"kind": "concurrent", "streams": [streams]},
            "tokenizer": {"kind": "huggingface_auto", "model": args.target_folder},
            "data": [data],
            "constraints": [{"kind": "max_requests", "count": requests}],
            "outputs": [{"kind": "json", "path": str(report)}],
        },
    }


def load_data(load: str, args, folder: Path) -> dict:
    """GuideLLM's data source for `load` (the MT-Bench file written into `folder`)."""
    if load == "synthetic":
        return {"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    path = folder / "mtbench.jsonl"
    if not path.exists():
        rows = [{"prompt": p, "output_tokens_count": args.output_tokens} for p in mtbench_prompts(args)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"kind": "json_file", "path": str(path)}


def mtbench_prompts(args) -> list[str]:
    """The MT-Bench first turns whose prompt, its output and a round's overshoot fit --max-len."""
    from peagle_jax.conversations.chat import encode_prompt
    from peagle_jax.engine import load_prompts
    from peagle_jax.handles.target import load_tokenizer

    tokenizer = load_tokenizer(args.target_folder)
    longest = args.max_len - args.output_tokens - 2 * args.k - 2
    return [c[-1]["content"] for c in load_prompts("mtbench") if len(encode_prompt(tokenizer, c)) <= longest]


def run_guidellm(args, spec: dict, folder: Path) -> dict:
    """Runs one GuideLLM scenario; its report's single benchmark."""
    path, report, log = folder / "scenario.json", Path(spec["spec"]["outputs"][0]["path"]), folder / "guidellm.log"
    path.write_text(json.dumps(spec, indent=2))
    report.unlink(missing_ok=True)
    with open(log, "ab") as out:
        cmd = [str(args.guidellm), "run", "--scenario", str(path), "--disable-progress"]
        done = subprocess.run(cmd, cwd=folder, env={**os.environ, **OFFLINE}, stdout=out, stderr=out)
    if done.returncode != 0 or not report.exists():
        tail = log.read_text(errors="replace").splitlines()[-5:]
        raise SystemExit(f"guidellm exited with {done.returncode} (its log ends: {' | '.join(tail)})")
    return json.loads(report.read_text())["benchmarks"][0]


def guidellm_figures(bench: dict) -> dict:
    """Throughput, latencies and failures from one benchmark of a GuideLLM report."""
    m = bench["metrics"]

    def stat(name: str, key: str = "mean") -> float:
        s = m[name]["successful"]
        return float(s["percentiles"][key] if key.startswith("p") else s[key])

    totals = m["request_totals"]
    return {
        "requests": int(totals["total"]),
        "requests_per_s": stat("requests_per_second"),
        "tokens_per_s": stat("output_tokens_per_second"),
        "ttft_p50_ms": stat("time_to_first_token_ms", "p50"),
        "ttft_p95_ms": stat("time_to_first_token_ms", "p95"),
        "itl_p50_ms": stat("inter_token_latency_ms", "p50"),
        "itl_p95_ms": stat("inter_token_latency_ms", "p95"),
        "errors": int(totals["errored"]) + int(totals["incomplete"]),
        "duration_s": float(bench["duration"]),
    }


def sent_requests(bench: dict) -> tuple[list, int, dict]:
    """The chat requests GuideLLM sent (its answered ones): their messages, their token budget and
    the other fields of their bodies (the same for every request of a load)."""
    bodies = [json.loads(r["request_args"])["body"] for r in bench["requests"]["successful"]]
    if not bodies:
        raise SystemExit("GuideLLM had no answered request to replay")
    first = dict(bodies[0])
    first.pop("messages"), first.pop("model"), first.pop("stream", None)
    budget = first.pop("max_completion_tokens")
    return [b["messages"] for b in bodies], budget, first


# ---------------------------------------------------------------- ours and the comparison


def ours(port: int, bench: dict, streams: int) -> dict:
    """GuideLLM's requests again, from our client with `streams` threads."""
    conversations, budget, fields = sent_requests(bench)
    results, seconds = run_clients(port, conversations, streams, budget, fields)
    answered = [r for r in results if "error" not in r]
    figures = summary([(answered, seconds)]) if answered else {}
    return {
        "requests": len(conversations),
        "requests_per_s": len(answered) / seconds,
        "tokens_per_s": figures.get("tokens_per_s", 0.0),
        "ttft_p50_ms": figures.get("ttft_p50_ms"),
        "ttft_p95_ms": figures.get("ttft_p95_ms"),
        "itl_p50_ms": figures.get("per_token_p50_ms"),
        "itl_p95_ms": figures.get("per_token_p95_ms"),
        "errors": len(conversations) - len(answered),
        "error_examples": [r["error"] for r in results if "error" in r][:3],
        "duration_s": seconds,
    }


def row(load: str, streams: int, theirs: dict, mine: dict) -> list:
    def pair(figures: dict, key: str) -> str:
        a, b = figures.get(f"{key}_p50_ms"), figures.get(f"{key}_p95_ms")
        return "-" if a is None else f"{a:.0f} / {b:.0f}"

    ratio = theirs["tokens_per_s"] / mine["tokens_per_s"] if mine["tokens_per_s"] else float("nan")
    return [
        load,
        streams,
        theirs["requests"],
        f"{theirs['requests_per_s']:.2f}",
        f"{theirs['tokens_per_s']:.1f}",
        f"{mine['tokens_per_s']:.1f}",
        f"{ratio:.3f}",
        pair(theirs, "ttft"),
        pair(mine, "ttft"),
        pair(theirs, "itl"),
        pair(mine, "itl"),
        f"{theirs['errors']} / {mine['errors']}",
        f"{cores(theirs, 'client')} / {cores(mine, 'client')}",
    ]


def partial(args, rows: list) -> list[str]:
    planned = len(args.loads) * len(args.streams)
    return [] if len(rows) == planned else [f"Partial: {len(rows)} of the {planned} points were measured."]


def cores(figures: dict, who: str) -> str:
    value = figures.get(f"{who}_cores")
    return "-" if value is None else f"{value:.2f}"


def point(args, port: int, spec: dict, folder: Path, streams: int, cpu: CpuSampler) -> dict:
    """One load and stream count: --repeats passes of each side, in the order A B B A A B ... (the
    machine's load comes and goes); a pass of ours that comes first replays GuideLLM's last requests
    (its synthetic data is seeded: every pass of it sends the same ones)."""
    passes, bench, before = {"guidellm": [], "ours": []}, None, os.getloadavg()[0]
    for r in range(args.repeats):
        for side in ("guidellm", "ours") if r % 2 == 0 else ("ours", "guidellm"):
            if side == "guidellm":
                bench = run_guidellm(args, spec, folder)
                passes["guidellm"].append(guidellm_figures(bench) | cpu.share(bench["start_time"], bench["end_time"]))
            else:
                start = time.time()
                mine = ours(port, bench, streams)
                passes["ours"].append(mine | cpu.share(start, time.time()))
    return {"passes": passes, "load_average_before_after": [before, os.getloadavg()[0]]}


def combined(passes: list[dict]) -> dict:
    """The passes of one side: each figure's median over them; errors added up."""
    values = {key: [p[key] for p in passes if p[key] is not None] for key in MEDIAN_KEYS}
    out = {key: float(np.median(v)) for key, v in values.items() if v}
    return out | {"requests": passes[0]["requests"], "errors": sum(p["errors"] for p in passes)}


def sweep(args, port: int, folder: Path, cpu: CpuSampler, after_each) -> None:
    """Every load and stream count; `after_each(rows, raw)` once each point is measured (the
    results so far are written: a run stopped midway keeps its points)."""
    rows, raw = [], []
    for load in args.loads:
        data = load_data(load, args, folder)
        for streams in args.streams:
            requests = max(args.min_requests, args.requests_per_stream * streams)
            spec = scenario(args, port, data, streams, requests, folder / "report.json")
            measured = point(args, port, spec, folder, streams, cpu)
            theirs, mine = (combined(measured["passes"][side]) for side in ("guidellm", "ours"))
            raw.append({"load": load, "streams": streams, "guidellm": theirs, "ours": mine, **measured})
            rows.append(row(load, streams, theirs, mine))
            print(" | ".join(map(str, rows[-1])), flush=True)
            after_each(rows, raw)


def notes(raw: list) -> list[str]:
    ratios = [r["guidellm"]["tokens_per_s"] / r["ours"]["tokens_per_s"] for r in raw if r["ours"]["tokens_per_s"]]
    errors = sum(r["guidellm"]["errors"] for r in raw)
    within = sum(abs(x - 1) <= GOAL for x in ratios)
    if not ratios:
        return [f"GuideLLM: {errors} errored or incomplete requests; no point with a throughput of ours."]
    return [
        f"GuideLLM: {errors} errored or incomplete requests over the sweep (goal: 0).",
        f"GuideLLM's throughput / ours: {min(ratios):.3f} to {max(ratios):.3f}; within 5% (the goal) at "
        f"{within} of {len(ratios)} points.",
        "Ours sends the very requests GuideLLM sent (the bodies in its report: the same messages, "
        "max_completion_tokens, ignore_eos, stream_options with continuous_usage_stats, temperature 0), "
        "in turn with it, with as many threads as GuideLLM's streams. Throughput: output tokens over the "
        "wall time from the first request to the last answer, on both sides; ITL: a request's decode time "
        "after its first token over its tokens after the first (GuideLLM's inter_token_latency_ms).",
        "Client cores: the CPU time the load generator's processes took over its measured window, in cores "
        "(from /proc); the server's: " + ", ".join(server_cores(r) for r in raw) + " (GuideLLM / ours, per point).",
    ]


def server_cores(r: dict) -> str:
    return f"{r['load'][:3]}@{r['streams']} {cores(r['guidellm'], 'server')} / {cores(r['ours'], 'server')}"


def main(argv=None) -> int:
    args = parse(argv)
    if not Path(args.guidellm).is_file():
        raise SystemExit(f"error: no GuideLLM at {args.guidellm}: run make guidellm-venv, or pass --guidellm PATH")
    args.target_folder = target_folder(args.target)
    facts = run_facts()
    version = subprocess.run(
        [args.guidellm, "--version"], capture_output=True, text=True, env={**os.environ, **OFFLINE}
    )
    facts["guidellm"] = version.stdout.strip().rsplit(" ", 1)[-1]
    tmp = tempfile.TemporaryDirectory(prefix="guidellm-sweep-")
    folder, port = Path(tmp.name), free_port()
    flags = server_flags(args, args.target_folder) + ["--max-queue", str(max(64, 2 * max(args.streams)))]
    with open(folder / "server.log", "wb") as log:
        server = start_server(flags, port, log)
        try:
            stream_one(port, [{"role": "user", "content": "Hello"}], 4)  # compiled at start; this warms it
            with CpuSampler(server.pid) as cpu:
                sweep(args, port, folder, cpu, lambda rows, raw: write(args, facts, flags, rows, raw))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    return 0


def write(args, facts: dict, flags: list[str], rows: list, raw: list) -> None:
    setup = (
        f"{args.target}, {head_words(args.drafter)}, K={args.k}; one server of --max-batch {args.max_batch} x "
        f"--max-len {args.max_len} for every point. GuideLLM {facts['guidellm']}'s concurrent profile at each stream count "
        f"(a scenario per point: chat completions, streamed, greedy), then our own client with the same requests "
        f"at the same concurrency. Loads: synthetic ({args.prompt_tokens} prompt tokens) and the MT-Bench first "
        f"turns, {args.output_tokens} output tokens each (ignore_eos). Requests per point: "
        f"max({args.min_requests}, {args.requests_per_stream} x streams); {args.repeats} passes a side per point "
        "in the order A B B A (each figure the median over the passes; errors: all passes')."
    )
    data = {
        "title": "Serving under GuideLLM: its concurrency sweep against our own client",
        "order": 60.1,
        "setup": setup,
        "command": command_line("bench.guidellm_sweep"),
        **facts,
        "columns": COLUMNS,
        "rows": rows,
        "notes": notes(raw) + partial(args, rows),
        "server": server_line(flags, args.target),
        "raw": raw,
    }
    save(args.json, data)


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m bench.guidellm_sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--guidellm", default=str(GUIDELLM), help="the guidellm executable (make guidellm-venv)")
    p.add_argument("--streams", type=counts, default=[1, 2, 4, 8, 16, 32], help="concurrent streams (default 1..32)")
    p.add_argument("--loads", type=loads, default=["synthetic", "mtbench"])
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2, help="passes of each side per point (figures: the median)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="synthetic prompts' length")
    p.add_argument("--output-tokens", type=int, default=32)
    add_server_args(p, max_batch=32, results="guidellm_sweep.json")
    return p.parse_args(argv)


def counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"stream counts must be positive: {text!r}")
    return values


def loads(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in ("synthetic", "mtbench")]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown load {unknown[0]!r} (synthetic, mtbench)")
    return names


if __name__ == "__main__":
    sys.exit(main())
