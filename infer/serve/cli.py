"""`python -m infer serve`: its flags (`infer/__main__.py` adds them to its parser) and its entry
point; the server itself (`infer.serve.server`) loads only when it runs."""

from __future__ import annotations

import argparse

from infer.flags import add_dist_flags, add_model_flags, dist_config
from peagle_jax.runtime.command_line import number_type, positive_int

PREFILL_CHUNK = 512  # prompt tokens a prefill call runs at most (--prefill-chunk)
port_number = number_type(int, 0, 65535, "a port number in [0, 65535]")
seconds = number_type(float, 0.1, 86400.0, "seconds in [0.1, 86400]")
share = number_type(float, 1e-9, 1.0, "a share in (0, 1]")


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
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=PREFILL_CHUNK,
        metavar="TOKENS",
        help="the most prompt tokens one prefill call runs, over all the prompts it takes (a power of two; while "
        "other requests decode, about what a step verifies): a longer prompt is prefilled in pieces between steps",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    p.add_argument(
        "--served-model-name", metavar="NAME", help="the model name clients send (default: the target folder's name)"
    )
    _access_args(p)
    _limit_args(p)
    _log_args(p)
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse request fields the server does not know (422; default: ignored, named in a warning)",
    )
    p.add_argument(
        "--on-device-failure",
        choices=["exit", "stay"],
        default="exit",
        help="when the device loop fails: exit non-zero (a supervisor restarts the server), or stay up answering 503",
    )
    add_dist_flags(p)


def _access_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        metavar="KEY",
        action="append",
        help="a key clients must send (Authorization: Bearer KEY) on /v1/*; repeat for several "
        "(also PEAGLE_API_KEY, --api-key-file; a key on the command line shows in the process list)",
    )
    p.add_argument(
        "--api-key-file", metavar="FILE", help="a file of keys, one a line (# comments and blank lines ignored)"
    )
    p.add_argument(
        "--admin-key",
        metavar="KEY",
        help="the key of the admin routes (POST /v1/admin/head: swap the head without a restart); without it "
        "they do not exist (also PEAGLE_ADMIN_KEY)",
    )
    p.add_argument(
        "--probes-need-key", action="store_true", help="/health and /metrics need the key too (default: open)"
    )
    p.add_argument(
        "--ssl-keyfile", metavar="FILE", help="TLS private key (PEM); with --ssl-certfile the server speaks HTTPS"
    )
    p.add_argument("--ssl-certfile", metavar="FILE", help="TLS certificate chain (PEM)")
    p.add_argument(
        "--allowed-origins",
        metavar="ORIGIN",
        action="append",
        help="browser origins allowed to call the API (CORS; repeat, or * for any; default: none, CORS off)",
    )
    p.add_argument(
        "--allowed-hosts",
        metavar="HOST",
        action="append",
        help="Host header names the server answers (repeat; default: any): guards a loopback server from DNS rebinding",
    )


def _limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="largest request body (413)")
    p.add_argument("--max-header-bytes", type=positive_int, default=16 << 10, help="largest request head (400)")
    p.add_argument(
        "--client-timeout",
        type=seconds,
        default=30.0,
        help="seconds a client has to send a request's head, then its body (an idle connection is closed; a slow body: 408)",
    )
    p.add_argument(
        "--max-connections", type=positive_int, default=512, help="open connections before new requests get 503"
    )


SHUTDOWN_S = 60  # how long a stopped server's process waits for the others at the exit barrier


def dist_problem(args) -> str | None:
    """What is wrong with the --dist.* flags (one line), or None."""
    from peagle_jax.runtime.distributed import checks

    return next((rule for holds, rule in checks(dist_config(args)) if not holds), None)


def join_processes(args) -> None:
    """With --dist.*: this process joins the others (`jax.distributed`), before any JAX op: the mesh
    flags then span every process's devices."""
    from peagle_jax.runtime.distributed import setup

    setup(dist_config(args), shutdown_timeout=SHUTDOWN_S)


def run_serve(args) -> int:
    from infer.serve.server import serve

    return serve(args)


def _log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-requests",
        metavar="DIR",
        help="append every finished request (its prompt, completion, token ids, sampling settings, finish reason, "
        "the head's acceptance, its time; no client address or header) to a request log in DIR, what "
        "`python -m train --data.source DIR` trains on (docs/serving.md: the request log); off by default",
    )
    p.add_argument(
        "--log-sample",
        type=share,
        default=1.0,
        metavar="F",
        help="the share of requests --log-requests keeps, in (0, 1]",
    )
    p.add_argument(
        "--log-shard-bytes",
        type=shard_size,
        default="64MB",
        metavar="SIZE",
        help="a request log shard is finished at this size (64MB, 500KB, 1GiB, ...)",
    )


def shard_size(text: str) -> int:
    from peagle_jax.runtime.folders import parse_size

    try:
        size = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if size < 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1KB")
    return size
