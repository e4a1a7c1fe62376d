"""The device loop: requests in, tokens out (continuous batching over `peagle_jax.engine.slots`).

One thread owns the device. Between steps (one round, or a few: `--rounds-per-step`) it admits waiting requests into free slots (each
prefilled alone, then inserted), releases the slots of cancelled ones, runs one round over every
slot, and hands each request the tokens it gained. A request leaves its slot the round it ends:
an eos id or stop token id, its token budget, or a cancel (a stop string seen by the HTTP side,
a client gone). The HTTP side only submits, cancels and reads events (`Job.emit`).

Failures: an exception in one request's own work (its prefill) ends that request with
`Failed(..., 500)` and the loop goes on; an exception anywhere else (a step, an insert: the
device state every slot shares) ends every request with `Failed(..., 503)`, logs one line and
stops the loop (`on_failure` is called: the server exits, or stays up answering 503). A stop
(`begin_shutdown`) ends every request with `Failed("the server is shutting down", 503)`.

For tests only: PEAGLE_SERVE_FAULT=prefill:N or step:N, or both (read at start), makes the Nth
prefill or the Nth step raise, so that both failure paths can be driven through the real process.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable

from peagle_jax.engine.sampling import SamplingParams, row_key, stop_ids

log = logging.getLogger("infer.serve")
FAULT_ENV = "PEAGLE_SERVE_FAULT"
SHUTTING_DOWN = "the server is shutting down"


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target's raw distribution, and the `logprobs` most
    likely (id, log-probability) pairs there, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Tokens:
    ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per id when the request asked for logprobs


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's own log-probabilities (echo with logprobs), before any Tokens: one per prompt
    token, None for the first (nothing precedes it)."""

    logprobs: list[TokenLogprob | None]


@dataclasses.dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (an eos id or stop token id), "length"; metrics also count "cancelled"
    completion_tokens: int  # generated, the stop token included


@dataclasses.dataclass(frozen=True)
class Failed:
    """The request ended without finishing: its own work failed (status 500), or the server stops
    (503). The HTTP side answers an error (an error event in a stream)."""

    message: str
    status: int = 500


Event = Tokens | PromptLogprobs | Finished | Failed


@dataclasses.dataclass(eq=False)
class Job:
    ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]  # called from the device thread
    prompt_logprobs: int | None = None  # echo with logprobs: the prompt's, with this many top tokens
    choice: int = 0  # which of its request's choices (n > 1): its key is row_key(seed, choice)
    stops: frozenset[int] = frozenset()  # the ids that end it (`sampling.stop_ids`); set on submit
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    cancel_reason: str = "abort"  # for the metrics: "stop" (a stop string) or "abort" (a client gone)
    generated: int = 0
    rounds: int = 0  # the speculative rounds it took part in
    accepted: object = None  # [K + 1] how many of its rounds accepted n drafts (numpy)
    admitted: float = 0.0  # when its prefill began
    last_tokens: float = 0.0  # when it last gained tokens (inter-token latency)


class QueueFull(Exception):
    """Every slot is busy and the queue is full."""


class Closed(Exception):
    """The server is shutting down."""


def cause(err: BaseException) -> str:
    """An exception as one line: its type, message and the line of code that raised it."""
    where = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ else []
    at = f" (at {os.path.basename(where[0].filename)}:{where[0].lineno})" if where else ""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}{at}"


class Faults:
    """For tests only: `PEAGLE_SERVE_FAULT=prefill:N` / `step:N` (or both, comma separated) makes
    the Nth prefill / step raise (N >= 1), so that the tests drive a request's failure and the
    device's through the real process. Unset in production: `hit` only counts."""

    KINDS = ("prefill", "step")

    def __init__(self, spec: str | None):
        self.at, self.counts = {}, dict.fromkeys(self.KINDS, 0)
        for part in (spec or "").split(","):
            if not part:
                continue
            kind, _, n = part.partition(":")
            if kind not in self.KINDS or not n.isdigit() or int(n) < 1:
                raise ValueError(f"{FAULT_ENV}={spec!r}: expected prefill:N, step:N or both, comma separated (N >= 1)")
            self.at[kind] = int(n)

    def hit(self, kind: str) -> None:
        self.counts[kind] += 1
        if self.at.get(kind) == self.counts[kind]:
            raise RuntimeError(f"injected fault ({FAULT_ENV}: {kind} {self.counts[kind]})")


class Scheduler:
    def __init__(self, slots, max_queue: int, metrics, on_failure: Callable[[BaseException], None] | None = None):
        self.slots, self.max_queue, self.metrics = slots, int(max_queue), metrics
        self.on_failure = on_failure  # called from the device thread once the loop has failed
        self.faults = Faults(os.environ.get(FAULT_ENV))
        self._pending: collections.deque[Job] = collections.deque()
        self._admitting: list[Job] = []  # taken from the queue, not yet in a slot
        self._swaps: list[tuple[object, concurrent.futures.Future]] = []  # engines to take between turns
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="device-loop", daemon=True)
        self.failure: BaseException | None = None

    # ------------------------------------------------------------ the HTTP side

    def start(self) -> None:
        self._thread.start()

    def submit(self, *jobs: Job) -> None:
        """Queues the jobs of one request, all or none."""
        with self._wake:
            if self.failure is not None:
                raise Closed("the device failed; this server serves nothing until it is restarted")
            if self._closing:
                raise Closed(SHUTTING_DOWN)
            if len(self._pending) + len(jobs) > self.max_queue:
                raise QueueFull(f"all {self.slots.batch} slots are busy and {len(self._pending)} requests wait")
            for job in jobs:
                job.stops = frozenset(stop_ids(job.params, self.slots.engine.eos_ids))
            self._pending.extend(jobs)
            self.metrics.waiting(len(self._pending))
            self._wake.notify()

    def cancel(self, job: Job, reason: str = "abort") -> None:
        """The job's slot is freed before the next round (no event follows). `reason`, for the
        metrics: "stop" (a stop string ended it), "abort" (its client went away)."""
        with self._wake:
            job.cancelled, job.cancel_reason = True, reason
            self._wake.notify()

    def swap(self, engine, timeout: float = 600.0) -> None:
        """Serves with `engine` (the served one with another head: `Engine.with_drafter`) from the
        next turn on; returns once the device loop has taken it (Closed when it never will)."""
        taken = concurrent.futures.Future()
        with self._wake:
            if self._closing or self.failure is not None:
                raise Closed("the server is not serving: no head is swapped in")
            self._swaps.append((engine, taken))
            self._wake.notify()
        taken.result(timeout)

    def begin_shutdown(self) -> None:
        """New requests are refused; the loop ends every waiting and running one with
        Failed(SHUTTING_DOWN, 503) and stops (returns at once: a signal handler calls it)."""
        with self._wake:
            self._closing = True
            self._wake.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        """`begin_shutdown`, then waits for the loop to stop."""
        self.begin_shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def closing(self) -> bool:
        return self._closing

    # ------------------------------------------------------------ the device thread

    def _loop(self) -> None:
        failed = None
        try:
            while self._next():
                pass
        except BaseException as err:  # noqa: BLE001 - a device failure: every request ends, /health says so
            failed = Failed(f"the device failed ({cause(err)})", 503)
            log.error("the device loop failed: %s", cause(err))
            self.failure = err
        with self._wake:
            self._closing = True
            for _, taken in self._swaps:
                taken.set_exception(Closed("the server stopped before the head was swapped in"))
            self._swaps.clear()
            jobs = self._admitting + list(self._pending) + list(self.slots.holders.values())
            self._admitting = []
            self._pending.clear()
        for job in jobs:
            self._fail(job, failed or Failed(SHUTTING_DOWN, 503))
        self._gauges()
        if self.failure is not None and self.on_failure is not None:
            self.on_failure(self.failure)

    def _next(self) -> bool:
        """One turn: admissions, releases, a piece of the waiting prompts, a step of rounds. False
        once closing."""
        with self._wake:
            while not (self._closing or self._pending or self.slots.holders or self._swaps):
                self._wake.wait()
            if self._closing:
                return False
            for engine, taken in self._swaps:  # between two turns: no program is running
                self.slots.engine = engine
                taken.set_result(True)
            self._swaps.clear()
            count = min(len(self.slots.free()), len(self._pending))
            self._admitting = [self._pending.popleft() for _ in range(count)]
        self._admit()
        self._release_cancelled()
        self._gauges()
        if self.slots.filling:
            self._prefill()
        if self.slots.running:
            self._step()
        self._gauges()
        return True

    def _admit(self) -> None:
        """The admitted jobs into free slots; their prompts are prefilled from the next call on."""
        while self._admitting:
            job = self._admitting.pop(0)
            if job.cancelled:
                self.metrics.cancelled(job)
                continue
            job.admitted = time.perf_counter()
            params = dataclasses.replace(job.params, prompt_logprobs=job.prompt_logprobs)
            try:  # the HTTP side checked the sizes: a refusal here is this request's alone
                self.slots.admit([(job.ids, params, row_key(job.params.seed, job.choice))], [job])
            except ValueError as err:
                self._fail(job, Failed(f"the request cannot be served ({cause(err)})", 500))

    def _prefill(self) -> None:
        """A piece of the waiting prompts, several requests in one call. A failure ends the
        requests of that call (500) and the others go on, unless the slots' state is lost with
        it (the device's failure: the loop ends)."""
        rows, piece = self.slots.next_prefill()
        try:
            self.faults.hit("prefill")
            news = self.slots.prefill(rows, piece)
        except Exception as err:  # noqa: BLE001 - the requests of this call end, the server goes on
            if not self.slots.intact():
                raise
            jobs = [self.slots.holders[s] for s in rows]
            self.slots.release(rows)
            for job in jobs:
                log.error("a request failed in its prefill (%d prompt tokens): %s", len(job.ids), cause(err))
                self._fail(job, Failed(f"the request failed in its prefill ({cause(err)})", 500))
            return
        for n in news:
            job: Job = n.holder
            self.metrics.first_token(job)
            if n.prompt_logprobs is not None and not job.cancelled:
                entries = [TokenLogprob(lp, tuple(top)) for lp, top in n.prompt_logprobs]
                job.emit(PromptLogprobs([None, *entries]))
            if self._deliver(n) and not n.done:  # cancelled meanwhile: its row would decode
                self._release(job)

    def _release_cancelled(self) -> None:
        gone = [slot for slot, job in self.slots.holders.items() if job.cancelled]
        for slot in gone:
            self.metrics.cancelled(self.slots.holders[slot])
        self.slots.release(gone)

    def _release(self, job: Job) -> None:
        self.slots.release([s for s, held in self.slots.holders.items() if held is job])

    def _step(self) -> None:
        self.faults.hit("step")
        news = self.slots.step()
        rounds = max((n.rounds for n in news), default=0)
        self.metrics.rounds.inc(rounds)
        gained = 0
        for n in news:
            gained += len(n.ids)
            if n.rounds:
                self.metrics.acceptance.observe(len(n.ids) / n.rounds)
                self.metrics.rounds_accepted(n.accepted)
                job: Job = n.holder
                job.rounds += n.rounds
                job.accepted = n.accepted if job.accepted is None else job.accepted + n.accepted
            if self._deliver(n) and not n.done:  # cancelled meanwhile: its row still runs
                self._release(n.holder)
        if rounds:
            self.metrics.per_round.observe(gained / rounds)

    def _deliver(self, news) -> bool:
        """Sends a job its new tokens; True when it has ended (a stop or eos id, its budget, a cancel)."""
        job: Job = news.holder
        if job.cancelled:
            self.metrics.cancelled(job)
            return True
        ids = news.ids
        job.generated += len(ids)
        self.metrics.tokens(job, len(ids))
        stopped = news.done and bool(ids) and ids[-1] in job.stops
        kept = ids[:-1] if stopped else ids
        if kept:
            job.emit(Tokens(kept, _logprobs(news, job, len(kept))))
        if news.done:
            self._end(job, "stop" if stopped else "length")
        return news.done

    def _end(self, job: Job, reason: str) -> None:
        self.metrics.finished(job, reason)
        job.emit(Finished(reason, job.generated))

    def _fail(self, job: Job, failure: Failed) -> None:
        self.metrics.finished(job, "failed")
        job.emit(failure)

    def _gauges(self) -> None:
        self.metrics.waiting(len(self._pending))
        self.metrics.running(len(self.slots.holders))


def _logprobs(news, job: Job, count: int) -> list[TokenLogprob] | None:
    """The first `count` of a news' tokens' log-probabilities, with the job's top n of them."""
    if job.params.logprobs is None or news.logprobs is None:
        return None
    token, top_ids, top = news.logprobs
    n = job.params.logprobs
    return [
        TokenLogprob(float(token[i]), tuple((int(t), float(v)) for t, v in zip(top_ids[i][:n], top[i][:n])))
        for i in range(count)
    ]
