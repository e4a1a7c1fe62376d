"""The server on the traffic continuous batching is for, and a long prompt arriving while streams
decode (`python -m infer serve`, Gemma-3-270M, greedy).

mixed: ShareGPT conversations (the first user turn of each) of 16 to --longest-prompt tokens, each
asking for as many tokens as its first answer had, clipped to 16 .. --longest-output, exactly
(`ignore_eos`). The server with C client threads against static batched generation of the same
requests in batches of C (the engine's own prefill and device loop, each row its own budget: a
batch ends with its longest row), side by side, passes interleaved (tokens/s: the median pass).
Static batching's programs (one per batch shape) are compiled by an untimed first pass, as the
server compiles its own at start.

interference: C - 1 streams decoding --stream-tokens tokens each; once all have started, one
prompt of --long-prompt tokens arrives. Reported: its time to first token, and the streams'
inter-token latency while it is prefilled (its arrival to its first token: p50 / p95) against
their median over the whole run; the goal is p95 during the prefill <= 2x the median
(chunked prefill: a prefill call runs about a step's worth of prompt tokens while slots decode).

    python -m bench.serve_mixed [--target gemma3-270m] [--drafter DIR] [--requests 32] [--clients 16] \\
        [--max-batch 16] [--k 3] [--repeats 2] [--json bench/results/serve_mixed.json]

Without --drafter a random P-EAGLE head is built (it accepts almost nothing: the numbers are the
serving machinery's, not a head's speedup).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np

import peagle_jax as pj
from bench.command import command_line
from bench.serve_bench import free_port, run_clients, server_flags, start_server, stream_one, summary
from bench.serve_setup import run_facts
from infer import SpeculativeDecoder
from peagle_jax.conversations.chat import encode_prompt
from peagle_jax.engine import SamplingParams
from peagle_jax.engine import cache as kv
from peagle_jax.sources.assets import prepare
from train.data import load_conversations, to_messages

ROOT = Path(__file__).resolve().parent.parent


def sharegpt_requests(tokenizer, count: int, longest_prompt: int, longest_output: int, seed: int = 0) -> list:
    """(conversation, prompt ids, new tokens) of `count` ShareGPT conversations whose first user
    turn has 16 .. longest_prompt tokens, in a seeded shuffle; new tokens: the first answer's
    length, clipped to 16 .. longest_output."""
    found = []
    for _, rec in load_conversations("sharegpt", limit=4000):
        try:
            turns = to_messages(rec)
        except ValueError:
            continue
        if len(turns) < 2 or turns[0]["role"] != "user" or turns[1]["role"] != "assistant":
            continue
        conversation = turns[:1]
        ids = encode_prompt(tokenizer, conversation)
        if 16 <= len(ids) <= longest_prompt:
            answer = len(tokenizer(turns[1]["content"][: 8 * longest_output])["input_ids"])
            found.append((conversation, ids, int(np.clip(answer, 16, longest_output))))
    order = np.random.default_rng(seed).permutation(len(found))[:count]
    return [found[i] for i in order]


def run_static(decoder, requests, batch: int) -> tuple[list[dict], float]:
    """Static batching of the same requests: each batch of `batch` prefilled together and decoded in
    one device loop to its longest row's budget (each row stops at its own: ignore_eos)."""
    engine, results, start = decoder.engine, [], time.perf_counter()
    for i in range(0, len(requests), batch):
        part = requests[i : i + batch]
        ids, budgets = [r[1] for r in part], [r[2] for r in part]
        length = kv.bucket_length(max(map(len, ids)), max(budgets), engine.k)
        params = [SamplingParams(n, ignore_eos=True) for n in budgets]
        t0 = time.perf_counter()
        state = engine.run(engine.prefill(ids, params, length, rows=1 << (len(part) - 1).bit_length()))
        jax.block_until_ready(state.out_len)
        took = time.perf_counter() - t0
        results += [{"ttft": took, "decode": took, "tokens": n, "whole": True} for n in budgets]
    return results, time.perf_counter() - start


def interference(port: int, streams: list, long_prompt: list[int], stream_tokens: int) -> dict:
    """The streams decoding, then the long prompt: its TTFT and the streams' inter-token latency
    during its prefill against their median."""
    got, lock = [], threading.Lock()

    def stream(conversation):
        res = stream_one(port, conversation, stream_tokens, {"ignore_eos": True})
        with lock:
            got.append(res)

    threads = [threading.Thread(target=stream, args=(c,)) for c in streams]
    for t in threads:
        t.start()
    time.sleep(2.0 + 0.5 * len(streams))  # every stream admitted, prefilled and decoding
    long = stream_one(port, long_prompt, 4, {"ignore_eos": True})
    for t in threads:
        t.join()
    window = (long["sent"], long["sent"] + long["ttft"])
    during, every = [], []
    for res in got:
        times = [t for t, _ in res["events"]]
        for (t0, _), (t1, n) in zip(res["events"], res["events"][1:]):
            gap = (t1 - t0) / n
            every.append(gap)
            if window[0] <= t1 <= window[1]:
                during.append(gap)
        assert times == sorted(times)
    median = float(np.median(every))
    p95 = float(np.percentile(during, 95)) if during else float("nan")
    return {
        "long_prompt_tokens": len(long_prompt),
        "long_ttft_ms": 1e3 * long["ttft"],
        "itl_median_ms": 1e3 * median,
        "itl_during_prefill_p50_ms": 1e3 * float(np.median(during)) if during else float("nan"),
        "itl_during_prefill_p95_ms": 1e3 * p95,
        "p95_during_over_median": p95 / median,
        "intervals_during_prefill": len(during),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve_mixed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="gemma3-270m", help="a HF folder, or gemma3-270m (the prepared asset)")
    p.add_argument("--drafter", help="a head folder (default: a random P-EAGLE head)")
    p.add_argument("--requests", type=int, default=32, help="ShareGPT requests of the mixed load")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--longest-prompt", type=int, default=1024)
    p.add_argument("--longest-output", type=int, default=512)
    p.add_argument("--long-prompt", type=int, default=1024, help="interference: the prompt that arrives")
    p.add_argument("--stream-tokens", type=int, default=256, help="interference: each stream's tokens")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prefill-chunk", type=int, default=512, help="the server's --prefill-chunk")
    p.add_argument("--rounds-per-step", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="passes of each side, interleaved (tokens/s: the median)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "serve_mixed.json"))
    args = p.parse_args(argv)
    args.max_len = kv.round_up(max(args.longest_prompt, args.long_prompt) + args.longest_output + 2 * args.k + 2, 64)
    args.prompts = args.requests
    folder = str(prepare(args.target)) if args.target == "gemma3-270m" else args.target
    target = pj.load_target(folder, dtype="float32")
    tmp = tempfile.TemporaryDirectory()
    drafter_dir = args.drafter or os.path.join(tmp.name, "head")
    if args.drafter is None:
        small_vocab = np.arange(min(32768, target.config.vocab_size))
        pj.new_drafter(target, num_layers=1, mode="parallel", seed=0, draft_vocab=small_vocab).save(drafter_dir)
    decoder = SpeculativeDecoder(target, pj.load_drafter(drafter_dir), k=args.k, mode="parallel")
    requests = sharegpt_requests(target.tokenizer, args.requests, args.longest_prompt, args.longest_output)
    print(f"{len(requests)} requests: prompts {sorted(len(r[1]) for r in requests)}", flush=True)
    print(f"new tokens {sorted(r[2] for r in requests)}", flush=True)
    log = open(os.path.join(tmp.name, "server.log"), "wb")
    port = free_port()
    server = start_server(server_flags(args, folder, drafter_dir), port, log)
    try:
        run_static(decoder, requests, args.clients)  # compiles every batch shape (untimed)
        conversations, budgets = [r[0] for r in requests], [r[2] for r in requests]
        served, static = [], []
        for _ in range(args.repeats):
            served.append(run_clients(port, conversations, args.clients, budgets, {"ignore_eos": True}))
            static.append(run_static(decoder, requests, args.clients))
            print(f"pass: server {served[-1][1]:.1f} s, static {static[-1][1]:.1f} s", flush=True)
        mixed = {"server": summary(served), "static": summary(static)}
        rng = np.random.default_rng(1)
        long_prompt = rng.integers(1000, min(target.config.vocab_size, 200000), size=args.long_prompt).tolist()
        stalls = interference(port, conversations[: args.clients - 1], long_prompt, args.stream_tokens)
        print(stalls, flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    write(args, mixed, stalls, requests)
    return 0


def write(args, mixed: dict, stalls: dict, requests) -> None:
    import json

    f = "{:.1f}".format
    s, t = mixed["server"], mixed["static"]
    columns = ["load", "server", "static", "server / static or ratio"]
    rows = [
        [
            "mixed: tokens/s",
            f(s["tokens_per_s"]),
            f(t["tokens_per_s"]),
            f"{s['tokens_per_s'] / t['tokens_per_s']:.2f}x",
        ],
        [
            "mixed: TTFT p50 / p95 (ms)",
            f"{f(s['ttft_p50_ms'])} / {f(s['ttft_p95_ms'])}",
            f"{f(t['ttft_p50_ms'])} / {f(t['ttft_p95_ms'])}",
            "",
        ],  # fmt: skip
        [f"interference: {stalls['long_prompt_tokens']}-token prompt's TTFT (ms)", f(stalls["long_ttft_ms"]), "", ""],
        [
            f"interference: {args.clients - 1} streams' ITL median / p95 during its prefill (ms)",
            f"{f(stalls['itl_median_ms'])} / {f(stalls['itl_during_prefill_p95_ms'])}",
            "",
            f"{stalls['p95_during_over_median']:.2f}x",
        ],  # fmt: skip
    ]
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    data = {
        "title": "Serving mixed lengths, and a long prompt among decoding streams",
        "order": 61,
        "setup": f"{args.target}, float32, K={args.k}, a random P-EAGLE head (acceptance near 1); mixed: "
        f"{len(requests)} ShareGPT requests (prompts 16..{args.longest_prompt} tokens, outputs 16.."
        f"{args.longest_output}, exact), {args.clients} clients against static batches of {args.clients}, "
        f"{args.repeats} passes a side interleaved; interference: {args.clients - 1} streams of "
        f"{args.stream_tokens} tokens, then a {args.long_prompt}-token prompt; one server of --max-batch "
        f"{args.max_batch} x --max-len {args.max_len}, --prefill-chunk {args.prefill_chunk}.",
        "command": command_line("bench.serve_mixed"),
        **run_facts(),
        "columns": columns,
        "rows": rows,
        "notes": "",
        "raw": {"mixed": mixed, "interference": stalls},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
