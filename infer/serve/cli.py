"""`python -m infer serve`: its flags (`infer/__main__.py` adds them to its parser) and its entry
point; the server itself (`infer.serve.server`) loads only when it runs."""

from __future__ import annotations

import argparse

from infer.flags import add_model_flags
from peagle_jax.cli import number_type, positive_int

port_number = number_type(int, 0, 65535, "a port number in [0, 65535]")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `serve` (the target and head flags `generate` has)."""
    add_model_flags(p)
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
