"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own.

Two sets over the same events: this project's `peagle_*`, and vLLM's names, help texts, labels
(`model_name`, `engine`) and buckets for the same quantities, so that a dashboard built for vLLM
reads this server unchanged (docs/serving.md lists them; docs/grafana-dashboard.json is one).
Counters and histograms are written by the device thread and the HTTP handlers alike
(`prometheus_client` is thread-safe). Acceptance length is vLLM's: the tokens one slot gained in
one round (1 + accepted drafts); a round's accepted drafts occupy draft positions 0..n-1.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "peagle"
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vLLM's bucket families (vllm/v1/metrics/buckets.py)
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
VLLM_TTFT += (40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
VLLM_LATENCY += (480.0, 960.0, 1920.0, 7680.0)
VLLM_FINISH = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason values
LABELS = ("model_name", "engine")


def one_two_five(top: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, ... up to `top` (vLLM's request-token buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, k: int, batch: int, model: str = "model", max_len: int = 1024):
        self.registry = r = CollectorRegistry()
        self.k = k
        self.requests = Counter(
            f"{PREFIX}_requests", "HTTP requests answered, by route", ["endpoint", "status"], registry=r
        )
        self._finished = Counter(
            f"{PREFIX}_requests_finished",
            "generations ended, by reason: stop, length, cancelled (a stop string or a client gone), failed",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generated = Counter(f"{PREFIX}_generation_tokens", "tokens generated", registry=r)
        self.rounds = Counter(f"{PREFIX}_rounds", "speculative rounds run", registry=r)
        self.acceptance = Histogram(
            f"{PREFIX}_acceptance_length",
            "tokens one slot gained in one round (1 + accepted drafts)",
            buckets=tuple(range(1, k + 2)),
            registry=r,
        )
        self.per_round = Histogram(
            f"{PREFIX}_tokens_per_round",
            "tokens all slots gained in one round",
            buckets=tuple(sorted({1, 2, 4, 8, 16, 32, 64, 128, batch * (k + 1)})),
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "request arrival to its first token", buckets=SECONDS, registry=r
        )
        self.queue = Gauge(f"{PREFIX}_queue_length", "requests waiting for a slot", registry=r)
        self.slots = Gauge(f"{PREFIX}_slots_in_use", "decode slots holding a request", registry=r)
        Gauge(f"{PREFIX}_slots", "decode slots (--max-batch)", registry=r).set(batch)
        self.vllm = _VllmMetrics(r, (model, "0"), k, max_len)
        self.head_info = Gauge(
            f"{PREFIX}_head_info", "the head being served (1): its folder's name and weights' hash", ["head", "fingerprint"],
            registry=r,
        )  # fmt: skip

    def text(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------ what the scheduler reports

    def head(self, name: str, fingerprint: str) -> None:
        """The head now served: its series alone at 1."""
        self.head_info.clear()
        self.head_info.labels(name, fingerprint).set(1)

    def waiting(self, n: int) -> None:
        self.queue.set(n)
        self.vllm.waiting.set(n)

    def running(self, n: int) -> None:
        self.slots.set(n)
        self.vllm.running.set(n)

    def first_token(self, job) -> None:
        """A job's prefill gave its first token (its queue wait was arrival to `job.admitted`)."""
        now = time.perf_counter()
        self.prompt_tokens.inc(len(job.ids))
        self.ttft.observe(now - job.arrived)
        v = self.vllm
        v.prompt_tokens.inc(len(job.ids))
        v.ttft.observe(now - job.arrived)
        v.queue_time.observe(max(job.admitted - job.arrived, 0.0))

    def tokens(self, job, n: int) -> None:
        """A job gained `n` tokens (vLLM's inter-token latency: the time since its previous ones)."""
        now = time.perf_counter()
        self.generated.inc(n)
        self.vllm.generation_tokens.inc(n)
        if job.last_tokens:
            self.vllm.itl.observe(now - job.last_tokens)
        job.last_tokens = now

    def finished(self, job, reason: str) -> None:
        """A job ended: "stop", "length" or "failed"."""
        self._finished.labels(reason).inc()
        self.vllm.finished(job, "error" if reason == "failed" else reason)

    def cancelled(self, job) -> None:
        """A job cancelled by the HTTP side (`job.cancel_reason`: "stop" for a stop string, else "abort")."""
        self._finished.labels("cancelled").inc()
        self.vllm.finished(job, job.cancel_reason)

    def drafts(self, emitted: int, rounds: int, done: bool) -> None:
        """One slot's step: `emitted` tokens over `rounds` rounds, each 1 + its accepted drafts.
        Counted where exact: a round the slot did not end in (the round it ends in may cut the
        tokens after an eos or its budget, unless all K drafts were accepted)."""
        if not self.k or (done and not (rounds == 1 and emitted == self.k + 1)):
            return
        v = self.vllm
        v.drafts.inc(rounds)
        v.draft_tokens.inc(rounds * self.k)
        v.accepted.inc(emitted - rounds)
        if rounds == 1:
            for pos in range(emitted - 1):
                v.accepted_per_pos[pos].inc()
        # TODO(engine): per-position counts of a step of several rounds (--rounds-per-step > 1): `rounds_accepted`

    def rounds_accepted(self, histogram) -> None:
        """One slot's step as the engine counts it: `histogram[n]` rounds accepted n drafts
        (n = 0..K). Exact whatever the rounds per step: position p was accepted in every round
        that accepted more than p drafts."""
        if not self.k:
            return
        counts = [int(c) for c in histogram]
        v = self.vllm
        v.drafts.inc(sum(counts))
        v.draft_tokens.inc(sum(counts) * self.k)
        v.accepted.inc(sum(n * c for n, c in enumerate(counts)))
        for pos in range(self.k):
            v.accepted_per_pos[pos].inc(sum(counts[pos + 1 :]))


class _VllmMetrics:
    """vLLM's metrics (vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py) for one model."""

    def __init__(self, r: CollectorRegistry, labels: tuple[str, str], k: int, max_len: int):
        def counter(name, doc, extra=()):
            return Counter(name, doc, [*LABELS, *extra], registry=r)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*labels)

        self.labels = labels
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", LABELS, registry=r
        ).labels(*labels)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", LABELS, registry=r
        ).labels(*labels)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*labels)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(
            *labels
        )
        success = counter("vllm:request_success", "Count of successfully processed requests.", ["finished_reason"])
        self.success = {reason: success.labels(*labels, reason) for reason in VLLM_FINISH}
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", VLLM_TTFT
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", VLLM_ITL
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", VLLM_LATENCY
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", VLLM_LATENCY
        )
        tokens = one_two_five(max_len)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        if k:
            self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.").labels(*labels)
            self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.").labels(*labels)
            self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.").labels(
                *labels
            )
            per_pos = counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", ["position"]
            )
            self.accepted_per_pos = [per_pos.labels(*labels, str(pos)) for pos in range(k)]

    def finished(self, job, reason: str) -> None:
        self.success[reason].inc()
        self.e2e.observe(time.perf_counter() - job.arrived)
        self.request_prompt.observe(len(job.ids))
        self.request_generation.observe(job.generated)
