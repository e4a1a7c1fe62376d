"""One server across hosts (JAX multi-controller): process 0 decides, every process applies.

Every process holds the same `Slots` over the global mesh, and each must launch the same device
programs in the same order. Process 0 runs the HTTP side and the scheduler over a `Leader`: its
slots, wrapped, so that each device call the scheduler makes (a release, a prefill call, a step) is
first sent to the other processes as an `Order`: the admissions made since the previous order
(prompt ids, sampling settings, key), then that call. The others (`follow`) apply each order to
their own slots: the same admissions take the same slots, the same calls run the same programs.
A call is what is sent, not a whole turn of the loop: what a prefill call returns decides whether
a cancelled request is released before the step that follows it.

Orders travel with JAX's own collectives (`Channel`: `multihost_utils`, no transport of ours).
While the server is idle, process 0 sends an empty order every TICK_S, so that every process hears
from the others. A stop: process 0's (SIGTERM, Ctrl-C) stops its server, then its last order ends
the others (exit 0); a follower's rides on its part of the next exchange, and process 0 stops as
on its own signal. A call that fails on the host before it took the state (a request's own bad
input) fails alike on every process: process 0's scheduler ends that call's requests as on one
process, the others go on. A lost process: an exchange or a device call that fails otherwise, or
that has not returned within the watchdog's limit, ends this process with one line and exit 1
(`fatal`); the others notice the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from infer.load import status
from infer.serve.scheduler import cause
from peagle_jax.engine.sampling import SamplingParams
from peagle_jax.runtime.command_line import started

TICK_S = 1.0  # the longest process 0 stays silent (an idle server's empty orders)
HEAD_BYTES = 4096  # what each process sends in every exchange: a follower's stop, process 0's order when it fits
BLOCK_BYTES = 1 << 16  # the rest of a longer order follows in blocks of this size (one program, however long)
INLINE_BYTES = HEAD_BYTES - 9  # the head: [a stop asked, the order's length (8 bytes), the order's first bytes]


@dataclasses.dataclass(frozen=True)
class Admission:
    """A request that `Slots.admit` gave a slot: its prompt ids, settings and key (its data)."""

    ids: tuple[int, ...]
    params: SamplingParams
    key: np.ndarray

    def request(self) -> tuple:
        return list(self.ids), self.params, jax.random.wrap_key_data(self.key)


@dataclasses.dataclass(frozen=True)
class Order:
    """What every process applies, in this order: the admissions, then one call: "release"
    (`slots`), "prefill" (`slots`, `piece`), "step" (`rows`), "" (nothing: an idle tick) or
    "stop" (the server ends; `failed`: after a failure of process 0's loop)."""

    admit: tuple[Admission, ...] = ()
    call: str = ""
    slots: tuple[int, ...] = ()
    piece: int | None = None
    rows: int | None = None
    failed: bool = False


def apply(slots, order: Order) -> None:
    """An order's admissions and call on a follower's slots (the news are process 0's to deliver)."""
    for a in order.admit:
        slots.admit([a.request()], [None])
    if order.call == "release":
        slots.release(list(order.slots))
    elif order.call == "prefill":
        slots.prefill(list(order.slots), order.piece)
    elif order.call == "step":
        slots.step(order.rows)


def fatal(message: str) -> None:
    """One line, then this process ends at once (exit 1): the mesh needs every process, and the
    JAX runtime's own exit would wait for the lost one."""
    status(f"error: process {jax.process_index()} of {jax.process_count()}: {message}; the server stops")
    os._exit(1)


def alike(slots) -> Callable[[BaseException], bool]:
    """Whether a call's failure is one every process meets alike: raised on the host before the
    call took the state (a request's own bad input: its prefill fails as on one process), not by
    the runtime (a device, a collective: this process's alone)."""
    return lambda err: slots.intact() and not isinstance(err, jax.errors.JaxRuntimeError)


class Watchdog:
    """`guard`: what runs inside it (an exchange, a device call) fails (unless `passes` the
    failure: raised as usual) or takes longer than `limit` seconds: `fatal` (a lost or hung
    process: the collectives never complete)."""

    def __init__(self, limit: float):
        self.limit = float(limit)
        self._since: float | None = None
        self._what = ""
        threading.Thread(target=self._watch, name="lockstep-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def guard(self, what: str, passes: Callable[[BaseException], bool] = lambda err: False):
        self._since, self._what = time.monotonic(), what
        try:
            yield
        except Exception as err:  # noqa: BLE001 - a collective that failed: a peer is gone
            if not passes(err):
                fatal(f"{what} failed ({cause(err)})")
            raise
        finally:
            self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.limit / 4))
            since = self._since
            if since is not None and time.monotonic() - since > self.limit:
                fatal(f"{self._what}: no answer from the other processes in {self.limit:.0f} s (one died or hangs)")


class Channel:
    """Process 0's bytes to every process, and whether any process asks to stop: one allgather of
    HEAD_BYTES per process, then, for an order longer than the head holds, its rest in broadcast
    blocks. Pickle: the peers are this server's own processes, running the same code."""

    def __init__(self):
        self.leads = jax.process_index() == 0

    def exchange(self, payload: bytes = b"", stop: bool = False) -> tuple[bytes, list[int]]:
        """(process 0's payload, the processes that asked to stop)."""
        head = np.zeros((HEAD_BYTES,), np.uint8)
        head[0] = stop
        if self.leads:
            head[1:9] = np.frombuffer(np.int64(len(payload)).tobytes(), np.uint8)
            head[9 : 9 + min(len(payload), INLINE_BYTES)] = np.frombuffer(payload[:INLINE_BYTES], np.uint8)
        heads = np.asarray(multihost_utils.process_allgather(head))
        size = int(heads[0, 1:9].copy().view(np.int64)[0])
        got = [heads[0, 9 : 9 + min(size, INLINE_BYTES)].tobytes()]
        for start in range(INLINE_BYTES, size, BLOCK_BYTES):
            block = np.zeros((BLOCK_BYTES,), np.uint8)
            if self.leads:
                part = payload[start : start + BLOCK_BYTES]
                block[: len(part)] = np.frombuffer(part, np.uint8)
            got.append(np.asarray(multihost_utils.broadcast_one_to_all(block))[: size - start].tobytes())
        return b"".join(got), [i for i in range(len(heads)) if heads[i, 0]]

    def warm_up(self) -> None:
        """Every process compiles the exchange's programs (a head, a block) before serving."""
        self.exchange(bytes(INLINE_BYTES + 1) if self.leads else b"")


class Leader:
    """Process 0's slots: the `Slots` the scheduler drives, each device call first sent to the
    other processes (`Order`, with the admissions made since the last one). Whatever else the
    scheduler reads (holders, filling, free slots, the next prefill's rows) is the slots' own."""

    def __init__(self, slots, limit: float):
        self._slots, self._channel, self._watchdog = slots, Channel(), Watchdog(limit)
        self._admitted: list[Admission] = []
        self._lock = threading.Lock()  # the device thread's calls and the idle ticks, one at a time
        self._last = time.monotonic()
        self._done = False
        self._on_stop: Callable[[], None] = lambda: None
        self._stopping = False

    def __getattr__(self, name):
        return getattr(self._slots, name)

    def start(self, on_stop: Callable[[], None]) -> None:
        """Once every process has compiled the exchange (`follow` does too), the idle ticks begin;
        `on_stop`: a follower asked to stop (the server stops as on a signal)."""
        self._on_stop = on_stop
        self._channel.warm_up()
        threading.Thread(target=self._tick, name="lockstep-tick", daemon=True).start()

    def admit(self, requests, holders) -> list[int]:
        with self._lock:
            taken = self._slots.admit(requests, holders)
            keys = [np.asarray(jax.random.key_data(key)) for _, _, key in requests]
            self._admitted += [Admission(tuple(ids), p, k) for (ids, p, _), k in zip(requests, keys)]
            return taken

    def release(self, slots) -> None:
        slots = [s for s in slots if s in self._slots.holders]
        if slots:  # nothing held: no device call, nothing to send
            self._call(Order(call="release", slots=tuple(slots)), lambda: self._slots.release(slots))

    def prefill(self, rows=None, piece=None):
        if rows is None:
            rows, piece = self._slots.next_prefill()
        order = Order(call="prefill", slots=tuple(rows), piece=piece)
        return self._call(order, lambda: self._slots.prefill(rows, piece))

    def step(self, rows=None):
        return self._call(Order(call="step", rows=rows), lambda: self._slots.step(rows))

    def stop(self, failed: bool = False) -> None:
        """The last order: every follower ends (exit 1 when `failed`). After the scheduler's loop."""
        with self._lock:
            if not self._done:
                self._send(Order(call="stop", failed=failed))
                self._done = True

    def _call(self, order: Order, call: Callable):
        with self._lock:
            self._send(order)
            with self._watchdog.guard(f"a {order.call} call", passes=alike(self._slots)):
                return call()

    def _send(self, order: Order) -> None:
        order = dataclasses.replace(order, admit=tuple(self._admitted))
        self._admitted = []
        with self._watchdog.guard("an exchange with the other processes"):
            _, asked = self._channel.exchange(pickle.dumps(order))
        self._last = time.monotonic()
        if asked and not self._stopping:
            self._stopping = True
            status(f"process {asked[0]} was asked to stop: the server stops")
            self._on_stop()

    def _tick(self) -> None:
        while not self._done:
            time.sleep(TICK_S / 4)
            with self._lock:
                if not self._done and time.monotonic() - self._last >= TICK_S:
                    self._send(Order())


def follow(slots, limit: float) -> int:
    """A follower's server: the orders of process 0 applied to `slots` until its last one; its
    exit status. SIGTERM / Ctrl-C ask process 0 to stop the server (the mesh needs every process)."""
    asked: list[int] = []

    def ask(sig, _frame):
        if not asked:
            status(f"{signal.Signals(sig).name}: asking process 0 to stop the server")
        asked.append(sig)

    started()  # the command's start-up is over: a signal is this handler's, not an exit at once
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, ask)
    channel, watchdog = Channel(), Watchdog(limit)
    with watchdog.guard("waiting for process 0 to serve"):
        channel.warm_up()
    status(f"following process 0 (process {jax.process_index()} of {jax.process_count()})")
    while True:
        with watchdog.guard("waiting for process 0's next order"):
            order = pickle.loads(channel.exchange(stop=bool(asked))[0])
        if order.call == "stop":
            status("stopped" + (": process 0's loop failed (exit 1)" if order.failed else ""))
            return 1 if order.failed else 0
        with contextlib.suppress(Exception):  # one met alike: process 0's scheduler ends that call's requests
            with watchdog.guard(f"a {order.call or 'tick'} order", passes=alike(slots)):
                apply(slots, order)
