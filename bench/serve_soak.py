"""A soak run of `python -m infer serve`: mixed traffic for --minutes, then the server's health.

It starts the server on 127.0.0.1 (Gemma-3-270M and a head, as `bench.guidellm_sweep`) and runs
--clients threads that each send one request after another until the time is up, drawn at
random (seeded): chat and completions, streamed and not, streams the client drops after their
first text, and requests with bad values (each must get a 4xx). Every --sample-seconds it reads
the server process's resident memory (VmRSS). At the end it waits for the slots to empty, reads
/metrics, stops the server with SIGTERM and reads its log. Reported: the requests by kind and
status, the resident memory's first-quarter and last-quarter medians and its slope (least squares,
MiB per hour), 5xx answers, answers of the wrong kind, tracebacks in the log, the slots left in use
(`vllm:num_requests_running` and `peagle_slots_in_use`) and the exit status; the run passes when
each of these is zero and the last-quarter median is within --rss-tolerance of the first.

    python -m bench.serve_soak [--minutes 30] [--clients 10] [--max-batch 8] [--max-len 512] \
        [--target gemma3-270m|tiny|DIR] [--drafter DIR|new] [--sample-seconds 10] \
        [--json bench/results/serve_soak.json]

--target tiny serves the hostile probe's tiny random target and head (`bench.serve_probe`): a
server of little memory that answers many more requests a minute on a CPU (a leak per request
shows sooner); the texts are then words its tokenizer does not know.

Loopback only; bounded by --minutes and --clients (fewer than the slots and the queue: no 503).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.command import command_line
from bench.serve_bench import free_port, start_server
from bench.serve_probe import build_assets
from bench.serve_setup import add_server_args, head_words, run_facts, save, server_flags, server_line, target_folder
from peagle_jax.engine import load_prompts

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
MODEL = "bench"

# (kind, weight): what a client sends next
KINDS = (
    ("chat stream", 30),
    ("chat", 15),
    ("completions stream", 15),
    ("completions", 15),
    ("cancelled stream", 10),
    ("bad value", 15),
)
# bodies a server must refuse with a 4xx (each a (route, body text))
BAD = (
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("/v1/completions", {"model": MODEL, "prompt": "   "}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": "two"}),
    ("/v1/completions", '{"model": "bench", "prompt": "hi", '),
)


# ---------------------------------------------------------------- the analysis


def rss_trend(samples: list[tuple[float, int]]) -> dict:
    """Resident memory over time, from (seconds, bytes) samples: the medians of the first and the
    last quarter of the samples (MiB), the last over the first, and the least-squares slope (MiB per
    hour)."""
    if len(samples) < 4:
        raise ValueError(f"a memory trend needs at least 4 samples, got {len(samples)}")
    t = np.array([s for s, _ in samples], dtype=float)
    mib = np.array([b for _, b in samples], dtype=float) / MIB
    quarter = len(samples) // 4
    first, last = float(np.median(mib[:quarter])), float(np.median(mib[-quarter:]))
    slope = float(np.polyfit(t / 3600.0, mib, 1)[0])
    return {
        "first_quarter_mib": first,
        "last_quarter_mib": last,
        "growth": last / first - 1.0,
        "slope_mib_per_h": slope,
    }


def checks(trend: dict, counts: dict, end: dict, tolerance: float) -> dict[str, bool]:
    """Each of the soak's conditions, true when it held."""
    return {
        "memory flat": trend["growth"] <= tolerance,
        "no 5xx": counts["5xx"] == 0,
        "every answer as expected": counts["unexpected"] == 0,
        "no traceback in the log": end["tracebacks"] == 0,
        "no slot left in use": end["num_requests_running"] == 0 and end["slots_in_use"] == 0,
        "clean exit": end["exit_status"] == 0,
    }


def gauge(metrics: str, name: str) -> float:
    """The sum of a Prometheus text's samples of `name` (over its labels)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.M)
    values = [float(v) for v in pattern.findall(metrics)]
    if not values:
        raise ValueError(f"/metrics has no {name}")
    return sum(values)


# ---------------------------------------------------------------- the traffic


def send(port: int, route: str, body, cancel: bool = False) -> int:
    """One request; its HTTP status. A stream is read to its end, or, with `cancel`, dropped after
    its first text (a chat stream's second event); one that ends in an error event counts as 500."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        text = body if isinstance(body, str) else json.dumps(body)
        conn.request("POST", route, text, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200 or not (isinstance(body, dict) and body.get("stream")):
            resp.read()
            return resp.status
        events = 0
        for line in resp:
            if line.startswith(b'data: {"error"'):
                return 500
            events += line.startswith(b"data: {")
            if cancel and events == 2:
                break  # the connection closes below, mid-stream
        return resp.status
    finally:
        conn.close()


def request_for(kind: str, rng: random.Random, prompts: list[str]) -> tuple[str, object, range]:
    """(route, body, the statuses it must get) of one request of `kind`."""
    prompt, max_tokens = rng.choice(prompts), rng.randint(4, 24)
    sampling = {"temperature": rng.choice([0, 0.7]), "seed": rng.randint(0, 1000), "max_tokens": max_tokens}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **sampling}
    completion = {"model": MODEL, "prompt": prompt, **sampling}
    if kind == "bad value":
        route, body = rng.choice(BAD)
        return route, body, range(400, 500)
    if kind == "cancelled stream":
        return "/v1/chat/completions", {**chat, "max_tokens": 64, "stream": True}, range(200, 201)
    route, body = ("/v1/chat/completions", chat) if kind.startswith("chat") else ("/v1/completions", completion)
    return route, {**body, "stream": kind.endswith("stream")}, range(200, 201)


def traffic(port: int, prompts: list[str], clients: int, seconds: float, seed: int) -> dict:
    """`clients` threads sending requests until `seconds` are up: counts by kind and status."""
    deadline, lock = time.monotonic() + seconds, threading.Lock()
    counts = {"requests": 0, "5xx": 0, "unexpected": 0, "by_kind": {}, "unexpected_examples": []}
    names, weights = zip(*KINDS, strict=True)

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            kind = rng.choices(names, weights)[0]
            route, body, expected = request_for(kind, rng, prompts)
            try:
                status = send(port, route, body, cancel=kind == "cancelled stream")
            except (OSError, http.client.HTTPException) as e:
                status, why = 0, f"{type(e).__name__}: {e}"
            else:
                why = f"HTTP {status}"
            with lock:
                counts["requests"] += 1
                by_status = counts["by_kind"].setdefault(kind, {})
                by_status[str(status)] = by_status.get(str(status), 0) + 1
                counts["5xx"] += status >= 500
                if status not in expected:
                    counts["unexpected"] += 1
                    if len(counts["unexpected_examples"]) < 10:
                        counts["unexpected_examples"].append(f"{kind} {route}: {why}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/{pid}/status has no VmRSS")


def sample_memory(pid: int, every: float, stop: threading.Event, samples: list) -> None:
    start = time.monotonic()
    while not stop.is_set():
        samples.append((time.monotonic() - start, rss_bytes(pid)))
        stop.wait(every)


def metrics_text(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    return conn.getresponse().read().decode()


def settle(port: int, wait: float = 30.0) -> dict:
    """The slots in use once they are empty, or after `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        text = metrics_text(port)
        end = {name: gauge(text, metric) for name, metric in GAUGES}
        if (end["num_requests_running"] == 0 and end["slots_in_use"] == 0) or time.monotonic() > deadline:
            return end
        time.sleep(0.5)


GAUGES = (("num_requests_running", "vllm:num_requests_running"), ("slots_in_use", "peagle_slots_in_use"))


# ---------------------------------------------------------------- the run


def soak(args, port: int, pid: int) -> tuple[dict, list]:
    """The traffic for --minutes while the memory sampler runs: the counts and the samples."""
    samples, stop = [], threading.Event()
    sampler = threading.Thread(target=sample_memory, args=(pid, args.sample_seconds, stop, samples))
    sampler.start()
    try:
        counts = traffic(port, mtbench_texts(), args.clients, 60 * args.minutes, args.seed)
    finally:
        stop.set()
        sampler.join()
    return counts, samples


def mtbench_texts() -> list[str]:
    """The MT-Bench first turns of at most 600 characters (a prompt and its tokens fit --max-len 512)."""
    return [c[-1]["content"] for c in load_prompts("mtbench") if len(c[-1]["content"]) <= 600]


def main(argv=None) -> int:
    args = parse(argv)
    facts, folder, port = run_facts(), tempfile.TemporaryDirectory(prefix="serve-soak-"), free_port()
    if args.target == "tiny":  # the probe's tiny random target and head: little memory, many requests a minute
        build_assets(Path(folder.name))
        args.drafter = str(Path(folder.name) / "drafter")
    target = str(Path(folder.name) / "target") if args.target == "tiny" else target_folder(args.target)
    flags = server_flags(args, target)
    log_path = Path(folder.name) / "server.log"
    with open(log_path, "wb") as log:
        server = start_server(flags, port, log)
        try:
            counts, samples = soak(args, port, server.pid)
            end = settle(port)
        finally:
            server.send_signal(signal.SIGTERM)
            end_status = server.wait(120)
    text = log_path.read_text(errors="replace")
    end |= {"exit_status": end_status, "tracebacks": text.count("Traceback (most recent call last)")}
    end["error_lines"] = [line for line in text.splitlines() if "ERROR" in line][:10]
    trend = rss_trend(samples)
    verdicts = checks(trend, counts, end, args.rss_tolerance)
    write(args, facts, flags, counts, samples, trend, end, verdicts)
    return 0 if all(verdicts.values()) else 1


def write(args, facts, flags, counts, samples, trend, end, verdicts) -> None:
    mark = {True: "yes", False: "NO"}
    rows = [
        [
            "requests",
            f"{counts['requests']} ({', '.join(f'{k}: {sum(v.values())}' for k, v in counts['by_kind'].items())})",
            "-",
        ],
        [
            "resident memory, first / last quarter median (MiB)",
            f"{trend['first_quarter_mib']:.0f} / {trend['last_quarter_mib']:.0f} ({100 * trend['growth']:+.1f}%)",
            mark[verdicts["memory flat"]],
        ],
        ["resident memory slope (MiB per hour)", f"{trend['slope_mib_per_h']:+.1f}", "-"],
        ["5xx answers", counts["5xx"], mark[verdicts["no 5xx"]]],
        ["answers of the wrong kind", counts["unexpected"], mark[verdicts["every answer as expected"]]],
        ["tracebacks in the server log", end["tracebacks"], mark[verdicts["no traceback in the log"]]],
        [
            "slots in use at the end (vllm:num_requests_running / peagle_slots_in_use)",
            f"{end['num_requests_running']:.0f} / {end['slots_in_use']:.0f}",
            mark[verdicts["no slot left in use"]],
        ],
        ["server exit status after SIGTERM", end["exit_status"], mark[verdicts["clean exit"]]],
    ]
    for r in rows:
        print(" | ".join(map(str, r)))
    data = {
        "title": "Serving: a soak run (mixed traffic, resident memory, errors, slots)",
        "order": 60.2,
        "setup": f"{served(args)}, K={args.k}; --max-batch {args.max_batch} x --max-len "
        f"{args.max_len}; {args.clients} client threads for {args.minutes} minutes on 127.0.0.1, each sending one "
        "request after another, drawn at random (seeded): "
        + ", ".join(f"{k} {w}%" for k, w in KINDS)
        + f"; resident memory (VmRSS) every {args.sample_seconds} s. The memory is flat when the last quarter's "
        f"median is within {100 * args.rss_tolerance:.0f}% of the first quarter's.",
        "command": command_line("bench.serve_soak"),
        **facts,
        "columns": ["measure", "value", "goal met"],
        "rows": rows,
        "notes": [],
        "server": server_line(flags, args.target) if args.target != "tiny" else "tiny (built by the command)",
        "counts": counts,
        "end": end,
        "trend": trend,
        "rss_samples": [[round(t, 1), b // 1024] for t, b in samples],
    }
    save(args.json, data)


def served(args) -> str:
    if args.target == "tiny":
        return "the tiny random target of bench.serve_probe (a tiny Llama, a word tokenizer) and a random P-EAGLE head"
    return f"{args.target}, {head_words(args.drafter)}"


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m bench.serve_soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=10, help="client threads (fewer than slots + queue)")
    add_server_args(p, max_batch=8, results="serve_soak.json")
    p.add_argument("--sample-seconds", type=float, default=10.0, help="how often the resident memory is read")
    p.add_argument(
        "--rss-tolerance", type=float, default=0.05, help="the last quarter's memory over the first's, at most"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.minutes <= 0 or not 1 <= args.clients <= 64:
        p.error("--minutes must be positive and --clients between 1 and 64 (the queue)")
    return args


if __name__ == "__main__":
    sys.exit(main())
