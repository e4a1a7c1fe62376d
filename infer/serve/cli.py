"""`python -m infer serve`: its flags (`infer/__main__.py` adds them to its parser) and its entry
point; the server itself (`infer.serve.server`) loads only when it runs."""

from __future__ import annotations

import argparse

from peagle_jax.cli import number_type, positive_int

port_number = number_type(int, 0, 65535, "a port number in [0, 65535]")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `serve` (the target and head flags as `generate` spells them)."""
    p.add_argument("--target", required=True, metavar="DIR", help="Hugging Face folder of the target, or a Hub id")
    p.add_argument(
        "--drafter",
        metavar="DIR",
        help="drafter checkpoint or Hub id, or new[:LAYERS] (a fresh random head); needed unless --mode none",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights of the target's shapes, nothing read (speed and memory runs; the folder's "
        "config.json and tokenizer are still needed)",
    )
    p.add_argument("--k", type=positive_int, default=7, help="drafts per round")
    p.add_argument(
        "--mode",
        default=None,
        choices=["parallel", "chain", "dflash", "none"],
        help="parallel = P-EAGLE, chain = EAGLE-3, dflash = DFlash, none = plain decoding (default: the head's own)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="target dtype")
    p.add_argument("--deep-k", default="error", choices=["error", "warn"], help="k above the head's trained depth")
    p.add_argument("--max-batch", type=positive_int, default=8, help="decode slots: requests decoded together")
    p.add_argument(
        "--max-len",
        type=positive_int,
        default=1024,
        help="KV cache positions per slot (prompt + new tokens + 2K), rounded up to a multiple of 64; "
        "--max-batch x --max-len is the cache memory",
    )
    p.add_argument("--max-queue", type=positive_int, default=64, help="requests waiting for a slot (more: 503)")
    p.add_argument(
        "--rounds-per-step",
        type=positive_int,
        default=1,
        help="rounds run in one device call between admissions (a step ends early when a request "
        "finishes); more: fewer host round trips (small models), new requests wait up to that many rounds",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: --target)")


def run_serve(args) -> int:
    from infer.serve.server import serve

    return serve(args)
