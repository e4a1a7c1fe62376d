"""The server's start and stop.

Start: load the target and head, build the slots, compile the steps (one per row count), the
insert and the first prompt bucket (the other buckets compile on their first request), then listen. Stop (SIGINT or
SIGTERM): refuse new requests, end the ones in flight with a last event (finish reason "abort"),
close the connections, exit 0.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time

import uvicorn

from infer.load import load_head, load_target, mesh_words
from infer.serve.app import Served, create_app
from infer.serve.metrics import ServerMetrics
from infer.serve.scheduler import Scheduler
from peagle_jax.cli import UsageError
from peagle_jax.engine import Engine, SamplingParams, Slots, row_key

GRACE_S = 5  # how long open connections may take to close once a stop was asked for


def status(message: str) -> None:
    print(f"[infer] {message}", file=sys.stderr, flush=True)


def build(args):
    """(Served, Scheduler): the model loaded, the slots built and compiled."""
    t0 = time.perf_counter()
    target = load_target(args)
    if target.tokenizer is None:  # responses are text: every request is detokenized
        raise ValueError(f"{args.target}: serving needs the target's tokenizer files beside its weights")
    drafter = None if args.mode == "none" else load_head(args.drafter, target, args.mode or "parallel")
    mode = args.mode or drafter.config.mode
    engine = Engine(target, drafter, k=args.k, mode=mode, deep_k=args.deep_k)
    slots = Slots(engine, args.max_batch, args.max_len, args.rounds_per_step)
    if slots.max_new_tokens(1) < 1:
        raise UsageError(f"--max-len {args.max_len}: a slot cannot hold a 1-token prompt and one round of k={args.k}")
    scheduler = Scheduler(slots, args.max_queue, ServerMetrics(engine.k, slots.batch))
    status(
        f"loaded in {time.perf_counter() - t0:.1f}s; compiling the steps, the insert and the first prompt bucket ..."
    )
    t0 = time.perf_counter()
    warm_up(slots)
    status(f"compiled in {time.perf_counter() - t0:.1f}s")
    name = args.served_model_name or args.target
    served = Served(scheduler, target.tokenizer, name, target.config.vocab_size, slots.length)
    return served, scheduler


def warm_up(slots: Slots) -> None:
    """Compiles what every request runs (its prefill at the first bucket, its insert, a step at
    each row count), on a slot left free again."""
    params = SamplingParams(2, ignore_eos=True)  # its first token cannot end it: the insert runs
    slots.insert(slots.prefill([([0], params, row_key(0, 0))], [None]), [0])
    slots.release([0])
    for rows in slots.row_counts():
        slots.step(rows)


def serve(args) -> int:
    served, scheduler = build(args)
    config = uvicorn.Config(
        create_app(served),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACE_S,
        lifespan="off",
    )
    server = StoppingServer(config)
    server.scheduler = scheduler
    scheduler.start()
    status(
        f"serving {served.model!r} on http://{args.host}:{args.port} ({scheduler.slots.batch} slots x "
        f"{scheduler.slots.length} positions, k={scheduler.slots.engine.k}, mode {scheduler.slots.engine.mode}, "
        f"on {mesh_words(scheduler.slots.engine.target.mesh)})"
    )
    try:
        server.run()
    finally:
        scheduler.shutdown()
    status("stopped")
    return 0


class StoppingServer(uvicorn.Server):
    """uvicorn's server whose stop signals also end the requests in flight, and which exits
    quietly: uvicorn re-raises a caught signal once it has shut down; here a stop asked for is
    the normal end (exit 0)."""

    scheduler: Scheduler

    def handle_exit(self, sig, frame):
        self.scheduler.begin_shutdown()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        stops = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
