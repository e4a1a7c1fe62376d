"""The server (`python -m infer serve`, continuous batching) against static batched `generate`.

The same prompts (MT-Bench questions, greedy, the same K and head) go through both, side by side
in one run on this machine: for C concurrent clients (1, 4, 16 by default) the server receives
every prompt from C client threads (streaming, so the time to the first token is seen), and
`SpeculativeDecoder.generate` decodes them in static batches of C (a batch's tokens all arrive
when its slowest row ends: its first token comes with the last). One server of --max-batch slots
serves every C. Each side runs --repeats passes, interleaved with the other's (the machine's load
comes and goes). Reported: tokens/s over the whole set (the median pass), p50 / p95 of the time
to first token and of the per-token latency (a request's decode time after its first token over
its tokens after the first). Prompts are MT-Bench questions of at most --max-prompt-tokens tokens (one prompt bucket,
which the server compiles at start; static generate is compiled, untimed, on batches of the
shortest and of the longest prompt first).

    python -m bench.serve_bench [--target gemma3-270m] [--drafter DIR] [--clients 1,4,16] \
        [--prompts 16] [--max-new-tokens 32] [--max-batch 16] [--max-len 256] [--k 3] \
        [--repeats 3] [--rounds-per-step 1] [--json bench/results/serve_bench.json]

Without --drafter a random P-EAGLE head is built (it accepts almost nothing: the numbers are the
serving machinery's cost, not a head's speedup).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import peagle_jax as pj
from bench.command import command_line
from bench.serve_setup import map_in_threads, run_facts
from infer import SpeculativeDecoder
from peagle_jax.conversations.chat import encode_prompt
from peagle_jax.engine import load_prompts
from peagle_jax.sources.assets import prepare

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_flags(args, target: str, drafter: str) -> list[str]:
    """This benchmark's server: --max-batch slots of --max-len, served as model "bench"."""
    flags = ["--target", target, "--drafter", drafter, "--k", str(args.k), "--served-model-name", "bench"]
    flags += ["--max-batch", str(args.max_batch), "--max-len", str(args.max_len), "--max-queue", str(4 * args.prompts)]
    return flags + ["--rounds-per-step", str(args.rounds_per_step), "--prefill-chunk", str(args.prefill_chunk)]


def start_server(flags: list[str], port: int, log) -> subprocess.Popen:
    """`python -m infer serve FLAGS` on 127.0.0.1:PORT (its stderr to `log`), once /health answers 200."""
    cmd = [sys.executable, "-m", "infer", "serve", *flags, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.5)


class RequestFailed(RuntimeError):
    """A request answered with an error status, an error event or no tokens."""


def stream_one(port: int, prompt, max_tokens: int, fields: dict | None = None) -> dict:
    """One streaming request, greedy: a chat (`prompt` a conversation) or a completion of token ids
    (`prompt` a list of ints); `fields`: more of its body. Its arrival-relative first and last
    token times, its tokens, and each event's (time, tokens) for inter-token latencies;
    RequestFailed when it fails."""
    ids = bool(prompt) and isinstance(prompt[0], int)
    body = {"model": "bench", ("prompt" if ids else "messages"): prompt, "max_tokens": max_tokens}
    body |= {
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    body |= fields or {}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    sent = time.perf_counter()
    path = "/v1/completions" if ids else "/v1/chat/completions"
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RequestFailed(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    events, done = [], 0
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RequestFailed(f"error event: {event['error']}")
        usage = event.get("usage") or {}
        if usage.get("completion_tokens", 0) > done:
            events.append((time.perf_counter(), usage["completion_tokens"] - done))
            done = usage["completion_tokens"]
    conn.close()
    if not events:
        raise RequestFailed("a stream without tokens")
    first, last = events[0][0], events[-1][0]
    return {"sent": sent, "ttft": first - sent, "decode": last - first, "tokens": done, "events": events}


def run_clients(port: int, prompts, clients: int, max_tokens, fields: dict | None = None) -> tuple[list[dict], float]:
    """Every prompt once (results in prompt order), from `clients` threads taking the next prompt as
    they finish one; `max_tokens`: one for all, or one per prompt (then with `ignore_eos`: exactly
    that many); a request that fails is a result {"error": why}."""

    def one(i: int) -> dict:
        n = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
        try:
            return stream_one(port, prompts[i], n, fields)
        except (OSError, http.client.HTTPException, RequestFailed) as e:
            return {"error": f"{type(e).__name__}: {e}"}

    start = time.perf_counter()
    results = map_in_threads(one, range(len(prompts)), clients)
    return results, time.perf_counter() - start


def run_static(decoder, prompts, batch: int, max_tokens: int) -> tuple[list[dict], float]:
    results, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        res = decoder.generate(prompts[i : i + batch], max_new_tokens=max_tokens)
        took = time.perf_counter() - t0
        for row in res.tokens:  # every token of a static batch arrives when the batch ends
            results.append({"ttft": took, "decode": took, "tokens": len(row), "whole": True})
    return results, time.perf_counter() - start


def summary(passes: list[tuple[list[dict], float]]) -> dict:
    """Tokens/s: the median over the passes; latencies: percentiles over every answered request of them."""
    results = [r for rs, _ in passes for r in rs if "error" not in r]
    ttft = [r["ttft"] for r in results]
    per_token = [r["decode"] / max(r["tokens"] - (0 if r.get("whole") else 1), 1) for r in results]
    return {
        "tokens_per_s": float(np.median([sum(r.get("tokens", 0) for r in rs) / seconds for rs, seconds in passes])),
        "passes_tokens_per_s": [sum(r.get("tokens", 0) for r in rs) / seconds for rs, seconds in passes],
        "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
        "ttft_p95_ms": 1e3 * float(np.percentile(ttft, 95)),
        "per_token_p50_ms": 1e3 * float(np.percentile(per_token, 50)),
        "per_token_p95_ms": 1e3 * float(np.percentile(per_token, 95)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="gemma3-270m", help="a HF folder, or gemma3-270m (the prepared asset)")
    p.add_argument("--drafter", help="a head folder (default: a random P-EAGLE head)")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--rounds-per-step", type=int, default=1)
    p.add_argument("--prefill-chunk", type=int, default=512, help="the server's --prefill-chunk")
    p.add_argument("--repeats", type=int, default=3, help="passes of each side, interleaved (tokens/s: the median)")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=64, help="longer prompts are left out (one prompt bucket: one compile)"
    )
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "serve_bench.json"))
    args = p.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    folder = str(prepare(args.target)) if args.target == "gemma3-270m" else args.target
    target = pj.load_target(folder, dtype="float32")
    tmp = tempfile.TemporaryDirectory()
    drafter_dir = args.drafter
    if drafter_dir is None:
        drafter_dir = os.path.join(tmp.name, "head")
        small_vocab = np.arange(min(32768, target.config.vocab_size))
        pj.new_drafter(target, num_layers=1, mode="parallel", seed=0, draft_vocab=small_vocab).save(drafter_dir)
    decoder = SpeculativeDecoder(target, pj.load_drafter(drafter_dir), k=args.k, mode="parallel")
    longest = min(args.max_prompt_tokens, args.max_len - args.max_new_tokens - 2 * args.k - 2)
    prompts = [c for c in load_prompts("mtbench") if len(encode_prompt(target.tokenizer, c)) <= longest]
    prompts = prompts[: args.prompts]
    lengths = {id(c): len(encode_prompt(target.tokenizer, c)) for c in prompts}

    rows, raw = [], {}
    port = free_port()
    log = open(os.path.join(tmp.name, "server.log"), "wb")
    server = start_server(server_flags(args, folder, drafter_dir), port, log)
    try:
        run_clients(port, prompts[:1], 1, args.max_new_tokens)  # the server compiled at start; this warms it
        for c in clients:
            for extreme in (min, max):  # compiles (untimed) the cache buckets of the shortest and longest prompts
                run_static(decoder, [extreme(prompts, key=lambda c: lengths[id(c)])] * c, c, args.max_new_tokens)
            served, static = [], []
            for _ in range(args.repeats):  # interleaved: a load that comes and goes hits both sides
                served.append(run_clients(port, prompts, c, args.max_new_tokens))
                static.append(run_static(decoder, prompts, c, args.max_new_tokens))
            served, static = summary(served), summary(static)
            raw[c] = {"server": served, "static": static}
            print(f"C={c}: server {served}\n      static {static}", flush=True)
            rows.append(row(c, served, static))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    write(args, rows, raw)
    return 0


def row(c: int, served: dict, static: dict) -> list:
    f = "{:.1f}".format
    return [
        c,
        f(served["tokens_per_s"]),
        f(static["tokens_per_s"]),
        f"{served['tokens_per_s'] / static['tokens_per_s']:.2f}x",
        f"{f(served['ttft_p50_ms'])} / {f(served['ttft_p95_ms'])}",
        f"{f(static['ttft_p50_ms'])} / {f(static['ttft_p95_ms'])}",
        f"{f(served['per_token_p50_ms'])} / {f(served['per_token_p95_ms'])}",
        f"{f(static['per_token_p50_ms'])} / {f(static['per_token_p95_ms'])}",
    ]


def write(args, rows, raw) -> None:
    columns = [
        "clients",
        "server tok/s",
        "static tok/s",
        "server / static",
        "server TTFT p50 / p95 (ms)",
        "static TTFT p50 / p95 (ms)",
        "server per-token p50 / p95 (ms)",
        "static per-token p50 / p95 (ms)",
    ]
    print("| " + " | ".join(columns) + " |")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    data = {
        "title": "Serving: continuous batching (python -m infer serve) vs static batched generate",
        "order": 60,
        "setup": f"{args.target}, float32, K={args.k}, a random P-EAGLE head (acceptance near 1), "
        f"{args.prompts} MT-Bench prompts, greedy, {args.max_new_tokens} "
        f"new tokens each, {args.repeats} passes a side interleaved (tokens/s: the median pass); one server of --max-batch {args.max_batch} x --max-len {args.max_len} "
        f"(--rounds-per-step {args.rounds_per_step}) for every "
        f"client count; static: generate in batches of C.",
        "command": command_line("bench.serve_bench"),
        **run_facts(),
        "columns": columns,
        "rows": rows,
        "notes": "",
        "raw": raw,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
