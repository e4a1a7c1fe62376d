"""The server's start and stop.

Start: check the flags (keys, TLS, limits), load the target and head, build the slots (a size
the device cannot hold is one line naming --max-batch x --max-len and the plan command that
sizes them), compile the steps (one per row count), the insert and the first prompt bucket (the
other buckets compile on their first request), then listen (a warning line when the address is
beyond loopback and no key is set). Stop (SIGINT or SIGTERM): refuse new requests, end the ones
in flight with an error event (503 "the server is shutting down"), close the connections, exit
0. A device failure: every request ends with an error, the process exits 1 within seconds
(`--on-device-failure exit`), or stays up answering 503 (`stay`) until it is stopped (exit 1).
Across hosts (`--dist.*`): every process loads and compiles the same slots; process 0 serves and
the others follow it call by call (`infer.serve.lockstep`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import prometheus_client
import uvicorn

from infer.flags import dist_config
from infer.load import load_head, load_target, mesh_words
from infer.serve import lockstep
from infer.serve.app import create_app
from infer.serve.guard import Access, Limits, timed_h11
from infer.serve.heads import Heads
from infer.serve.jobs import Served
from infer.serve.metrics import ServerMetrics
from infer.serve.recorder import Recorder
from infer.serve.scheduler import Scheduler
from peagle_jax.engine import Engine, Slots
from peagle_jax.runtime.command_line import UsageError

GRACE_S = 5  # how long open connections may take to close once a stop was asked for
EXIT_DEADLINE_S = GRACE_S + 10  # a failed device: the process is gone by then, whatever hangs
KEY_ENV = "PEAGLE_API_KEY"
ADMIN_KEY_ENV = "PEAGLE_ADMIN_KEY"
TOKENIZER_THREADS = max(1, min(4, os.cpu_count() or 1))


def status(message: str) -> None:
    print(f"[infer] {message}", file=sys.stderr, flush=True)


def model_name(target: str) -> str:
    """The model id clients send: a target folder's name (never its path), or a Hub id as given."""
    path = Path(target)
    return path.resolve().name if path.is_dir() else str(target)


def api_keys(args) -> tuple[bytes, ...]:
    """The keys of --api-key, PEAGLE_API_KEY and --api-key-file (never echoed in an error)."""
    keys = list(args.api_key or [])
    if os.environ.get(KEY_ENV):
        keys.append(os.environ[KEY_ENV])
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot be read ({type(err).__name__})") from None
        found = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {args.api_key_file}: no key in it")
        keys += found
    for key in keys:
        if not (key.isascii() and key.isprintable()) or " " in key:
            raise UsageError("an API key must be printable ASCII without spaces (the key itself is not shown)")
    return tuple(k.encode() for k in keys)


def settings(args) -> tuple[Access, Limits]:
    """The access rules and limits of the flags (UsageError for a combination that cannot work)."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise UsageError("--ssl-keyfile and --ssl-certfile go together (TLS needs both)")
    for flag in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(args, flag)
        if path and not Path(path).is_file():
            raise UsageError(f"--{flag.replace('_', '-')} {path}: no such file")
    keys = api_keys(args)
    if args.probes_need_key and not keys:
        raise UsageError("--probes-need-key needs a key (--api-key, --api-key-file or PEAGLE_API_KEY)")
    hosts = tuple(h.lower() for h in args.allowed_hosts or ())
    access = Access(keys, open_probes=not args.probes_need_key, hosts=hosts)
    return access, Limits(args.max_body_bytes, args.client_timeout, args.max_header_bytes, args.max_connections)


def open_warning(host: str, keys) -> str | None:
    """The warning line of a server that anyone beyond this machine may reach and use."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback or keys:
        return None
    return (
        f"warning: listening on {host} without an API key: anyone who reaches the port can generate "
        f"(--api-key, --api-key-file or {KEY_ENV})"
    )


def load(args) -> Slots:
    """The slots over the target and head, every shape a request may take compiled (every process
    of a server across hosts does this)."""
    t0 = time.perf_counter()
    target = load_target(args)
    if target.tokenizer is None:  # responses are text: every request is detokenized
        raise ValueError(f"{args.target}: serving needs the target's tokenizer files beside its weights")
    drafter = None if args.mode == "none" else load_head(args.drafter, target, args.mode or "parallel")
    mode = args.mode or drafter.config.mode
    engine = Engine(target, drafter, k=args.k, mode=mode, deep_k=args.deep_k)
    slots = allocate(args, engine)
    if slots.max_new_tokens(1) < 1:
        raise UsageError(f"--max-len {args.max_len}: a slot cannot hold a 1-token prompt and one round of k={args.k}")
    status(
        f"loaded in {time.perf_counter() - t0:.1f}s; compiling every prefill piece and step a request may take "
        f"({len(slots.shapes()['prefill'])} + {len(slots.shapes()['step'])} programs) ..."
    )
    t0 = time.perf_counter()
    warm_up(slots)
    status(f"compiled in {time.perf_counter() - t0:.1f}s")
    return slots


def build(args, slots) -> tuple[Served, Scheduler]:
    """(Served, Scheduler) over the slots (process 0's, across hosts: a `lockstep.Leader`)."""
    target = slots.engine.target
    name = args.served_model_name or model_name(args.target)
    scheduler = Scheduler(slots, args.max_queue, ServerMetrics(slots.engine.k, slots.batch, name, slots.length))
    served = Served(scheduler, target.tokenizer, name, target.config.vocab_size, slots.length, strict=args.strict)
    if slots.engine.drafter is not None:
        across = jax.process_count() > 1  # every process would have to load it: a restart does
        served.heads = Heads(scheduler, slots.engine.mode, args.drafter, slots.engine.drafter, swappable=not across)
    admin = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    served.admin_keys = (admin.encode(),) if admin else ()
    if args.log_requests:
        served.recorder = Recorder(
            args.log_requests, model_name(args.target), name, args.log_sample, args.log_shard_bytes
        )
    return served, scheduler


def allocate(args, engine: Engine) -> Slots:
    """The slots, or one line naming the flags that size them when the device cannot hold them."""
    try:
        slots = Slots(engine, args.max_batch, args.max_len, args.rounds_per_step, prefill_tokens=args.prefill_chunk)
        jax.block_until_ready(slots.state)  # the allocation fails here, not at the first request
        return slots
    except Exception as err:  # noqa: BLE001 - XLA's out-of-memory is a RuntimeError subclass of its own
        if not isinstance(err, MemoryError) and "RESOURCE_EXHAUSTED" not in str(err):
            raise
        raise RuntimeError(
            f"--max-batch {args.max_batch} x --max-len {args.max_len}: the slots' KV caches do not fit this device "
            f"({type(err).__name__}); lower them, or size them with: python -m peagle_jax.plan --target {args.target} "
            f"--device DEVICE --job server --batch {args.max_batch} --cache-len {args.max_len}"
        ) from None


def warm_up(slots: Slots) -> None:
    """Compiles every shape a request may take (each prefill piece, each step), before serving."""
    slots.warm_up()


def serve(args) -> int:
    access, limits = settings(args)
    _log_lines()
    slots, leader = load(args), None
    if jax.process_count() > 1:  # one server across hosts: process 0 serves, the others follow it
        limit = lockstep_limit(args)
        if jax.process_index() > 0:
            return lockstep.follow(slots, limit)
        slots = leader = lockstep.Leader(slots, limit)
    served, scheduler = build(args, slots)
    served.pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
    config = uvicorn.Config(
        create_app(served, access, limits, tuple(args.allowed_origins or ())),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACE_S,
        lifespan="off",
        http=timed_h11(limits.client_timeout),
        h11_max_incomplete_event_size=limits.max_header,
        limit_concurrency=limits.max_connections,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )
    server = StoppingServer(config)
    server.scheduler = scheduler
    server.reload = None if served.heads is None else functools.partial(served.heads.reload, args.drafter)
    if args.on_device_failure == "exit":
        scheduler.on_failure = server.device_failed
    if leader is not None:
        leader.start(on_stop=lambda: server.handle_exit(signal.SIGTERM, None))
    scheduler.start()
    scheme = "https" if args.ssl_certfile else "http"
    status(
        f"serving {served.model!r} on {scheme}://{args.host}:{args.port} ({scheduler.slots.batch} slots x "
        f"{scheduler.slots.length} positions, k={scheduler.slots.engine.k}, mode {scheduler.slots.engine.mode}, "
        f"on {mesh_words(scheduler.slots.engine.target.mesh)})"
    )
    warning = open_warning(args.host, access.keys)
    if warning:
        status(warning)
    try:
        server.run()
    finally:
        scheduler.shutdown()
        if leader is not None:
            leader.stop(failed=scheduler.failure is not None)
        served.pool.shutdown(wait=False, cancel_futures=True)
        if served.recorder is not None:
            served.recorder.close()  # the last shard finished: nothing logged is lost
    if scheduler.failure is not None:
        status("stopped: the device failed (exit 1)")
        return 1
    status("stopped")
    return 0


def lockstep_limit(args) -> float:
    """How long an exchange or a device call of a server across hosts may take before its process
    gives the others up: half the heartbeat timeout, so that this one line comes before the JAX
    runtime's own end of the process (a lost peer's heartbeats missed)."""
    return max(dist_config(args).heartbeat_timeout / 2, 4 * lockstep.TICK_S)


def _log_lines() -> None:
    """The server's log lines beside its status lines: `[infer] WARNING: ...` on stderr."""
    log = logging.getLogger("infer.serve")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[infer] %(levelname)s: %(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    prometheus_client.disable_created_metrics()  # /metrics without a *_created series per counter


class StoppingServer(uvicorn.Server):
    """uvicorn's server whose stop signals also end the requests in flight, which stops when the
    device fails (`device_failed`), and which exits quietly: uvicorn re-raises a caught signal
    once it has shut down; here a stop asked for is the normal end (exit 0)."""

    scheduler: Scheduler

    def handle_exit(self, sig, frame):
        self.scheduler.begin_shutdown()
        super().handle_exit(sig, frame)

    def device_failed(self, _err: BaseException) -> None:
        """From the device thread: stop serving; the process is gone within EXIT_DEADLINE_S."""
        self.should_exit = True
        watchdog = threading.Timer(EXIT_DEADLINE_S, os._exit, (1,))
        watchdog.daemon = True
        watchdog.start()

    reload = None  # SIGHUP: the head re-read from --drafter (`Heads.reload`)

    def handle_hangup(self, sig, frame):
        if self.reload is not None:
            self.reload()

    @contextlib.contextmanager
    def capture_signals(self):
        stops = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self.handle_hangup)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
