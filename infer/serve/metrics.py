"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own.

Counters and histograms are written by the device thread and the HTTP handlers alike
(`prometheus_client` is thread-safe). Acceptance length is vLLM's: the tokens one slot gained in
one round (1 + accepted drafts).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "peagle"
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, k: int, batch: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.finished = Counter(
            f"{PREFIX}_requests_finished",
            "generations ended, by reason: stop, length, abort (shutdown), cancelled (a stop string or a client gone)",
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

    def text(self) -> bytes:
        return generate_latest(self.registry)
