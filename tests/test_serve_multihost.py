"""One `python -m infer serve` across two processes (jax.distributed on 127.0.0.1, gloo collectives,
2 simulated CPU devices each, one tensor 2 x data 2 mesh over the 4): requests through process 0's
port, greedy and seeded-sampled, streamed and not, queued past the slots, a prompt prefilled in
pieces, give the tokens one process's `SpeculativeDecoder.generate` gives each prompt alone; a
follower's SIGTERM stops both processes (exit 0); a killed follower ends process 0 with one line
and exit 1.

Two servers start together (module fixture): one serves and is stopped, the other loses its
follower. Prefill pieces of 16 tokens (--prefill-chunk 16) keep the programs to compile few."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import xla_env
from limits import HANG_S
from serve_support import OnFirstUse, ServerProcess, alone, ask, free_port, mixed_requests, request, shown, tiny_assets

ROOT = Path(__file__).resolve().parents[1]
K = 3
REQUESTS = mixed_requests(lengths=(3, 17, 30, 90))  # 90 tokens: six prefill pieces
LAYOUT = ["--tensor", "2", "--data", "2", "--max-batch", "4", "--max-len", "128", "--prefill-chunk", "16"]


class Pair:
    """The two processes of one server: process 1 (a follower, started first), then process 0
    (serving HTTP; ready once /health answers)."""

    def __init__(self, root: Path, name: str):
        model = ["--target", str(root / "target"), "--drafter", str(root / "drafter"), "--k", str(K)]
        dist = ["--dist.coordinator", f"127.0.0.1:{free_port()}", "--dist.num_processes", "2"]
        argv = [*model, *LAYOUT, *dist, "--dist.heartbeat_timeout", "20"]
        env = xla_env.simulated_devices(2)
        self.follower_log = root / f"{name}-1.log"
        self.follower = subprocess.Popen(
            [sys.executable, "-m", "infer", "serve", *argv, "--dist.process_id", "1"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=self.follower_log.open("wb"),
        )  # fmt: skip
        try:
            self.leader = ServerProcess([*argv, "--dist.process_id", "0"], root / f"{name}-0.log", "tiny", env=env)
        except BaseException:
            self.follower.kill()
            raise

    def kill(self) -> None:
        for proc in (self.follower, self.leader.proc):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost-serve")
    return root, tiny_assets(root)


@pytest.fixture(scope="module")
def pairs(assets):
    """name -> its Pair: "served" (requests, then a follower's stop), "killed" (its follower
    killed; started by the slow test that kills it)."""
    root, _ = assets
    started = OnFirstUse(lambda name: Pair(root, name), eager=["served"])
    yield Ready(started)
    for pair in started.results().values():
        pair.kill()


class Ready:
    """The started pairs, each once it is up."""

    def __init__(self, started: OnFirstUse):
        self.started = started

    def __getitem__(self, name: str) -> Pair:
        return self.started[name].result()


@pytest.fixture(scope="module")
def reference(assets):
    root, target = assets
    return alone(target, root / "drafter", K, REQUESTS)


def test_every_request_across_two_processes_equals_generate_alone(pairs, reference):
    server = pairs["served"].leader
    assert "on tensor 2 x data 2 (4 cpu devices, 2 processes)" in server.stderr()
    with ThreadPoolExecutor(len(REQUESTS)) as pool:  # more requests than slots: they queue and reuse slots
        got = list(pool.map(lambda r: ask(server, r), REQUESTS))
    wrong = [i for i, (g, want) in enumerate(zip(got, reference)) if g != shown(want)]
    assert not wrong, [(i, REQUESTS[i][1:], got[i], reference[i]) for i in wrong]
    assert any(a != b for a, b in zip(reference[::4], reference[2::4]))  # the sampled requests did sample


def test_a_prompts_logprobs_come_from_every_process(pairs, reference):
    """echo with logprobs: the prompt's log-probabilities are gathered from the rows of both processes."""
    ids, n = REQUESTS[12][:2]  # the 90-token prompt, greedy
    body = {"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0, "echo": True, "logprobs": 1}
    status, _, text = request(pairs["served"].leader, "POST", "/v1/completions", body)
    assert status == 200, text
    logprobs = json.loads(text)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"w{t}" for t in ids + reference[12]]
    assert logprobs["token_logprobs"][0] is None and all(lp < 0 for lp in logprobs["token_logprobs"][1:])


def test_a_requests_own_failure_is_its_500_on_every_process_and_the_server_goes_on(pairs, reference):
    """40 stop ids pass the HTTP checks but not a slot's 32: its prefill call fails on the host of
    every process alike, before any device work; that request ends, the others are served."""
    server = pairs["served"].leader
    body = {"model": "tiny", "prompt": REQUESTS[0][0], "max_tokens": 4, "stop_token_ids": list(range(5, 45))}
    status, _, text = request(server, "POST", "/v1/completions", body)
    assert status == 500 and "the request failed in its prefill" in text, text
    assert ask(server, REQUESTS[0]) == shown(reference[0])
    assert pairs["served"].follower.poll() is None


def test_a_followers_sigterm_stops_every_process(pairs):
    pair = pairs["served"]
    pair.follower.send_signal(signal.SIGTERM)
    assert pair.follower.wait(HANG_S) == 0, pair.follower_log.read_text()
    assert pair.leader.proc.wait(HANG_S) == 0, pair.leader.stderr()
    assert "process 1 was asked to stop: the server stops" in pair.leader.stderr()
    for log in (pair.leader.stderr(), pair.follower_log.read_text()):
        assert log.rstrip().endswith("[infer] stopped") and "Traceback" not in log, log


@pytest.mark.slow  # a second pair of processes: ~40 s of the 2-core CI
def test_a_killed_follower_ends_process_0_with_one_line(pairs):
    pair = pairs["killed"]
    before = pair.leader.stderr()
    pair.follower.kill()
    assert pair.follower.wait(HANG_S) == -signal.SIGKILL
    assert pair.leader.proc.wait(HANG_S) == 1  # by itself: its next exchange fails (or its watchdog fires)
    said = pair.leader.stderr()[len(before) :].strip().splitlines()
    assert len(said) == 1 and said[0].startswith("[infer] error: process 0 of 2: "), said
    assert said[0].endswith("; the server stops"), said


def test_a_mesh_short_of_every_processs_devices_is_refused(assets):
    """Checked once the processes joined, before anything loads: one line, exit 2, on both."""
    root, _ = assets
    model = ["--target", str(root / "target"), "--drafter", str(root / "drafter")]
    dist = ["--tensor", "2", "--dist.coordinator", f"127.0.0.1:{free_port()}", "--dist.num_processes", "2"]
    env = xla_env.simulated_devices(2)
    procs = [
        subprocess.Popen([sys.executable, "-m", "infer", "serve", *model, *dist, "--dist.process_id", str(i)],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]  # fmt: skip
    for proc in procs:
        err = proc.communicate(timeout=HANG_S)[1]
        assert proc.returncode == 2, err
        assert [line for line in err.splitlines() if "Gloo" not in line] == [
            "error: --tensor 2: a server across 2 processes runs on all their 4 devices: tensor x data must be 4, not 2"
        ]


# ---------------------------------------------------------------- the channel and the watchdog


def test_the_channel_carries_every_size_and_a_followers_stop():
    env = {**xla_env.simulated_devices(1), "PYTHONPATH": str(ROOT)}
    program, port = str(ROOT / "tests" / "programs" / "lockstep_exchange.py"), str(free_port())
    procs = [
        subprocess.Popen([sys.executable, program, str(i), port], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]  # fmt: skip
    for proc in procs:
        out, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"whole": [True] * 5, "asked": [[], [], [], [], [1]]}


def test_a_call_past_the_watchdogs_limit_ends_the_process_with_one_line():
    code = "import time\nfrom infer.serve.lockstep import Watchdog\nwith Watchdog(1).guard('a step call'):\n    time.sleep(600)"
    env = {**xla_env.simulated_devices(1), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "[infer] error: process 0 of 1: a step call: no answer from the other processes in 1 s (one died or hangs); "
        "the server stops"
    ]
