"""`serve --log-requests DIR`: every finished choice (or a sampled fraction) appended to a request
log (`peagle_jax.conversations.request_log`: size-bounded JSONL shards, finished ones renamed into place, so a
crash loses at most the shard being written), what `python -m train --data.source DIR` learns from.

A record holds the prompt as sent (the chat messages, or the prompt text), its token ids, the
completion's text and ids, the sampling settings, the finish reason, the head that drafted and
its acceptance (rounds, per draft position), and the time. Nothing else: no client address, no
header, no key. Appends run on a writer thread of their own, never on the device loop or the
event loop; a write that fails (a full disk) is one warning line and the server goes on (logging
resumes when a write succeeds again).
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import time

import numpy as np

from peagle_jax.conversations.request_log import Acceptance, Head, Request
from peagle_jax.conversations.request_log_writer import RequestLog

log = logging.getLogger("infer.serve")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
SAMPLING_FIELDS += ("repetition_penalty", "seed", "max_tokens")


class Recorder:
    """Appends finished choices to a `RequestLog` at `folder`, a `sample` fraction of them."""

    def __init__(self, folder: str, target: str, model: str, sample: float = 1.0, max_shard_bytes="64MB"):
        self.log = RequestLog(folder, max_shard_bytes, target=target)
        self.target, self.model, self.sample = target, model, float(sample)
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="request-log")
        self.failing = False

    def record(self, served, call, choice) -> None:
        """The choice's record, queued for the writer (None when the sample leaves it out)."""
        if self.sample < 1.0 and random.random() >= self.sample:
            return
        record = self._request(served, call, choice)
        self.writer.submit(self._append, record)

    def _append(self, record: Request) -> None:
        try:
            self.log.append(record)
        except OSError as err:
            if not self.failing:
                log.warning("the request log could not be written (%s): serving goes on without it", err)
            self.failing = True
        else:
            if self.failing:
                log.warning("the request log is written again")
            self.failing = False

    def _request(self, served, call, choice) -> Request:
        job, plan = choice.job, call.plan
        prompt = plan.prompts[choice.row.prompt]
        params = choice.row.params
        chat = plan.chat
        return Request(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{call.id}-{choice.row.index}",
            time=time.time(),
            model=self.model,
            target=self.target,
            head=None if served.heads is None else Head(served.heads.current.name, served.heads.current.fingerprint),
            kind="chat" if chat else "completion",
            messages=plan.body.conversation() if chat else None,
            prompt=None if chat else prompt.sent,
            prompt_ids=list(prompt.ids),
            completion="".join(choice.pieces),
            completion_ids=list(choice.ids),
            sampling={name: getattr(params, name) for name in SAMPLING_FIELDS},
            finish_reason=choice.reason,
            acceptance=_acceptance(job),
            seconds=time.perf_counter() - job.arrived,
        )

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        self.log.close()


def _acceptance(job) -> Acceptance | None:
    if job.accepted is None or not job.rounds:
        return None
    counts = np.asarray(job.accepted)
    per_pos = [int(counts[p + 1 :].sum()) for p in range(len(counts) - 1)]  # rounds whose draft p was accepted
    return Acceptance(int(job.rounds), per_pos, job.generated / job.rounds)
