"""The device loop: requests in, tokens out (continuous batching over `peagle_jax.engine.slots`).

One thread owns the device. Between steps (one round, or a few: `--rounds-per-step`) it admits waiting requests into free slots (each
prefilled alone, then inserted), releases the slots of cancelled ones, runs one round over every
slot, and hands each request the tokens it gained. A request leaves its slot the round it ends:
an eos id or stop token id, its token budget, or a cancel (a stop string seen by the HTTP side,
a client gone). The HTTP side only submits, cancels and reads events (`Job.emit`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from peagle_jax.engine.sampling import SamplingParams, row_key, stop_ids

log = logging.getLogger("infer.serve")


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
    generated: int = 0


class QueueFull(Exception):
    """Every slot is busy and the queue is full."""


class Closed(Exception):
    """The server is shutting down."""


class Scheduler:
    def __init__(self, slots, max_queue: int, metrics):
        self.slots, self.max_queue, self.metrics = slots, int(max_queue), metrics
        self._pending: collections.deque[Job] = collections.deque()
        self._admitting: list[Job] = []  # taken from the queue, not yet in a slot
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="device-loop", daemon=True)
        self.failure: BaseException | None = None

    # ------------------------------------------------------------ the HTTP side

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._closing:
                raise Closed("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"all {self.slots.batch} slots are busy and {self.max_queue} requests wait")
            job.stops = frozenset(stop_ids(job.params, self.slots.engine.eos_ids))
            self._pending.append(job)
            self.metrics.queue.set(len(self._pending))
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """The job's slot is freed before the next round (no event follows)."""
        with self._wake:
            job.cancelled = True
            self._wake.notify()

    def begin_shutdown(self) -> None:
        """New requests are refused; the loop ends every waiting and running one with
        Finished("abort") and stops (returns at once: a signal handler calls it)."""
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
        try:
            while self._next():
                pass
        except BaseException as err:  # a device failure: every request ends, /health says so
            self.failure = err
            log.exception("the device loop failed")
        with self._wake:
            self._closing = True
            jobs = self._admitting + list(self._pending) + list(self.slots.holders.values())
            self._admitting = []
            self._pending.clear()
        for job in jobs:
            self._end(job, "abort")
        self._gauges()

    def _next(self) -> bool:
        """One step: admissions, releases, a step of rounds. False once closing."""
        with self._wake:
            while not (self._closing or self._pending or self.slots.holders):
                self._wake.wait()
            if self._closing:
                return False
            free = self.slots.free()
            self._admitting = [self._pending.popleft() for _ in range(min(len(free), len(self._pending)))]
        while self._admitting:
            job = self._admitting[0]
            if job.cancelled:
                self.metrics.finished.labels("cancelled").inc()
            else:
                self._admit(job, free)
            self._admitting.pop(0)
        self._release_cancelled()
        self._gauges()
        if self.slots.holders:
            self._step()
            self._gauges()
        return True

    def _admit(self, job: Job, free: list[int]) -> None:
        if job.prompt_logprobs is not None:
            job.emit(
                PromptLogprobs(
                    [None, *map(_token_logprob, self.slots.engine.prompt_logprobs(job.ids, job.prompt_logprobs))]
                )
            )
        key = row_key(job.params.seed, job.choice)
        prefilled = self.slots.prefill([(job.ids, job.params, key)], [job])
        self.metrics.prompt_tokens.inc(len(job.ids))
        self.metrics.ttft.observe(time.perf_counter() - job.arrived)
        if self._deliver(prefilled.news[0]):
            return
        self.slots.insert(prefilled, [free.pop(0)])

    def _release_cancelled(self) -> None:
        gone = [slot for slot, job in self.slots.holders.items() if job.cancelled]
        for _ in gone:
            self.metrics.finished.labels("cancelled").inc()
        self.slots.release(gone)

    def _step(self) -> None:
        news = self.slots.step()
        rounds = max((n.rounds for n in news), default=0)
        self.metrics.rounds.inc(rounds)
        gained = 0
        for n in news:
            gained += len(n.ids)
            if n.rounds:
                self.metrics.acceptance.observe(len(n.ids) / n.rounds)
            if self._deliver(n) and not n.done:  # cancelled meanwhile: its row still runs
                self.slots.release([s for s, job in self.slots.holders.items() if job is n.holder])
        if rounds:
            self.metrics.per_round.observe(gained / rounds)

    def _deliver(self, news) -> bool:
        """Sends a job its new tokens; True when it has ended (a stop or eos id, its budget, a cancel)."""
        job: Job = news.holder
        if job.cancelled:
            self.metrics.finished.labels("cancelled").inc()
            return True
        ids = news.ids
        job.generated += len(ids)
        self.metrics.generated.inc(len(ids))
        stopped = news.done and bool(ids) and ids[-1] in job.stops
        kept = ids[:-1] if stopped else ids
        if kept:
            job.emit(Tokens(kept, _logprobs(news, job, len(kept))))
        if news.done:
            self._end(job, "stop" if stopped else "length")
        return news.done

    def _end(self, job: Job, reason: str) -> None:
        self.metrics.finished.labels(reason).inc()
        job.emit(Finished(reason, job.generated))

    def _gauges(self) -> None:
        self.metrics.queue.set(len(self._pending))
        self.metrics.slots.set(len(self.slots.holders))


def _token_logprob(entry) -> TokenLogprob:
    logprob, top = entry
    return TokenLogprob(logprob, tuple(top))


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
