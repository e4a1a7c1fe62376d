"""The server's load benchmarks without running them: the soak's analysis on synthetic samples,
GuideLLM's report read back, the CPU sampler, the client threads, and both command lines' help
(no GuideLLM, no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bench.guidellm_sweep import guidellm_figures, sent_requests
from bench.proc_cpu import CpuSampler, cpu_seconds, descendants
from bench.serve_setup import map_in_threads
from bench.serve_soak import MIB, checks, gauge, rss_trend

ROOT = Path(__file__).resolve().parent.parent

GOOD_COUNTS = {"5xx": 0, "unexpected": 0}
GOOD_END = {"tracebacks": 0, "num_requests_running": 0.0, "slots_in_use": 0.0, "exit_status": 0}


def samples(mib_at, minutes: float = 30, every: float = 10, seed: int = 0):
    """(seconds, bytes) every `every` seconds for `minutes`, the memory `mib_at(t)` plus 1 MiB of noise."""
    rng = np.random.default_rng(seed)
    times = np.arange(0, 60 * minutes, every)
    return [(float(t), int((mib_at(t) + rng.normal(0, 1)) * MIB)) for t in times]


def test_flat_memory_is_flat():
    trend = rss_trend(samples(lambda t: 900.0))
    assert abs(trend["first_quarter_mib"] - 900) < 1 and abs(trend["last_quarter_mib"] - 900) < 1
    assert abs(trend["slope_mib_per_h"]) < 5 and abs(trend["growth"]) < 0.005
    assert all(checks(trend, GOOD_COUNTS, GOOD_END, tolerance=0.05).values())


def test_a_leak_is_its_slope_and_fails_the_check():
    # 900 MiB growing 200 MiB an hour for 30 minutes: the quarters' medians sit at 3.75 and 26.25 min
    trend = rss_trend(samples(lambda t: 900.0 + 200.0 * t / 3600))
    assert trend["slope_mib_per_h"] == pytest.approx(200, rel=0.03)
    assert trend["first_quarter_mib"] == pytest.approx(900 + 200 * 3.75 / 60, abs=1.5)
    assert trend["last_quarter_mib"] == pytest.approx(900 + 200 * 26.25 / 60, abs=1.5)
    assert trend["growth"] == pytest.approx(trend["last_quarter_mib"] / trend["first_quarter_mib"] - 1)
    verdict = checks(trend, GOOD_COUNTS, GOOD_END, tolerance=0.05)
    assert not verdict["memory flat"] and sum(not ok for ok in verdict.values()) == 1


def test_a_warm_up_then_flat_passes():
    # the first minutes' growth (compiles, first allocations) then a plateau: flat by the quarters
    trend = rss_trend(samples(lambda t: 800.0 + 100.0 * min(t, 120) / 120))
    assert trend["last_quarter_mib"] == pytest.approx(900, abs=1) and trend["growth"] < 0.05
    assert checks(trend, GOOD_COUNTS, GOOD_END, tolerance=0.05)["memory flat"]


@pytest.mark.parametrize(
    "counts, end, failed",
    [
        ({"5xx": 1, "unexpected": 1}, {}, {"no 5xx", "every answer as expected"}),
        ({"unexpected": 2}, {}, {"every answer as expected"}),
        ({}, {"tracebacks": 1}, {"no traceback in the log"}),
        ({}, {"num_requests_running": 1.0}, {"no slot left in use"}),
        ({}, {"slots_in_use": 2.0}, {"no slot left in use"}),
        ({}, {"exit_status": 1}, {"clean exit"}),
    ],
)
def test_each_check_fails_on_its_own(counts, end, failed):
    trend = rss_trend(samples(lambda t: 500.0))
    verdict = checks(trend, {**GOOD_COUNTS, **counts}, {**GOOD_END, **end}, tolerance=0.05)
    assert {name for name, ok in verdict.items() if not ok} == failed


def test_too_few_samples_is_an_error():
    with pytest.raises(ValueError, match="at least 4 samples, got 3"):
        rss_trend([(0.0, MIB), (1.0, MIB), (2.0, MIB)])


def test_gauge_sums_a_metric_over_its_labels():
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        'vllm:num_requests_running{engine="0",model_name="bench"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="bench"} 1.0\n'
        "vllm:num_requests_running_other 7.0\n"
        "peagle_slots_in_use 3.0\n"
    )
    assert gauge(text, "vllm:num_requests_running") == 3.0
    assert gauge(text, "peagle_slots_in_use") == 3.0
    with pytest.raises(ValueError, match="no peagle_queue_length"):
        gauge(text, "peagle_queue_length")


def guidellm_benchmark(bodies: list[dict], errored: int = 0) -> dict:
    """One benchmark as GuideLLM 0.8.1's JSON report writes it (the fields the sweep reads)."""

    def stat(mean: float, p50: float, p95: float) -> dict:
        return {"successful": {"mean": mean, "median": p50, "percentiles": {"p50": p50, "p95": p95}}}

    metrics = {
        "request_totals": {"successful": len(bodies), "errored": errored, "incomplete": 1, "total": len(bodies) + 1},
        "requests_per_second": stat(0.5, 0.4, 0.9),
        "output_tokens_per_second": stat(16.0, 15.0, 30.0),
        "time_to_first_token_ms": stat(300.0, 250.0, 700.0),
        "inter_token_latency_ms": stat(60.0, 55.0, 90.0),
    }
    requests = [{"request_args": json.dumps({"stream": True, "body": b})} for b in bodies]
    return {"metrics": metrics, "requests": {"successful": requests}, "duration": 12.5}


def test_guidellm_report_figures_and_requests_read_back():
    body = {
        "model": "bench",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 32,
        "ignore_eos": True,
        "temperature": 0,
    }
    messages = [[{"role": "user", "content": [{"type": "text", "text": f"prompt {i}"}]}] for i in range(3)]
    bench = guidellm_benchmark([{**body, "messages": m} for m in messages], errored=2)
    figures = guidellm_figures(bench)
    assert figures["requests"] == 4 and figures["errors"] == 3  # 2 errored + 1 incomplete
    assert figures["tokens_per_s"] == 16.0 and figures["requests_per_s"] == 0.5
    assert (figures["ttft_p50_ms"], figures["ttft_p95_ms"]) == (250.0, 700.0)
    assert (figures["itl_p50_ms"], figures["itl_p95_ms"]) == (55.0, 90.0)
    sent, budget, fields = sent_requests(bench)
    assert sent == messages and budget == 32
    assert fields == {"stream_options": body["stream_options"], "ignore_eos": True, "temperature": 0}


@pytest.mark.parametrize("module", ["bench.guidellm_sweep", "bench.serve_soak"])
def test_help_runs(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"python -m {module}" in done.stdout and "--json" in done.stdout


def test_cpu_sampler_reads_processes_and_windows():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in descendants(os.getpid())
    finally:
        child.kill()
        child.wait()
    before, start = cpu_seconds(os.getpid()), time.process_time()
    while time.process_time() - start < 0.3:  # 0.3 s of this process's CPU
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.25
    assert cpu_seconds(2**22 + 1) == 0.0  # no such process
    sampler = CpuSampler(server=child.pid)
    sampler.samples = [(100.0, 10.0, 1.0), (101.0, 10.5, 1.1), (102.0, 11.5, 1.3), (103.0, 12.0, 2.0)]
    assert sampler.share(100.5, 102.5) == pytest.approx({"server_cores": 1.0, "client_cores": 0.2})
    assert sampler.share(100.0, 103.0) == pytest.approx({"server_cores": 2 / 3, "client_cores": 1 / 3})
    assert sampler.share(101.5, 102.5) == {"server_cores": None, "client_cores": None}


def test_client_threads_keep_the_order_and_a_failure_cancels_what_did_not_start():
    """Results in the items' order from at most `threads` at once; a failure (an interrupt) ends
    the call with the requests in flight, not after every queued one has run."""
    lock, running, most, started = threading.Lock(), [0], [0], []

    def work(i):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            started.append(i)
        time.sleep(0.01 if i < 40 else 0.05)
        with lock:
            running[0] -= 1
        if i == 40:
            raise KeyboardInterrupt
        return i * i

    assert map_in_threads(work, range(40), 3) == [i * i for i in range(40)]
    assert most[0] == 3
    started.clear()
    with pytest.raises(KeyboardInterrupt):
        map_in_threads(work, range(40, 240), 2)
    assert len(started) < 10, len(started)  # 200 queued at 0.05 s each: all of them would take 5 s
