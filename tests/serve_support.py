"""A `python -m infer serve` process on 127.0.0.1 for the server tests, and plain HTTP to it.

The process is the real command line (its own interpreter, signals, sockets); it inherits the
test run's XLA settings and compilation cache (`tests/xla_env.py`)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from limits import HANG_S

ROOT = Path(__file__).resolve().parent.parent


def tiny_assets(root: Path, max_position_embeddings: int | None = None):
    """A tiny random target with the word tokenizer (root/target) and a random one-layer P-EAGLE
    head (root/drafter), as the server tests and the probe serve them; returns the target."""
    import hf_tiny

    import peagle_jax as pj

    hf_tiny.build("llama-gqa2-tied-llama3", root / "target")
    hf_tiny.word_tokenizer(root / "target")
    if max_position_embeddings:  # room for long generations; the weights and rope do not read it
        hf_tiny.edit_config(root / "target", lambda c: c.update(max_position_embeddings=max_position_embeddings))
    target = pj.load_target(root / "target", dtype="float32")
    pj.new_drafter(target, num_layers=1, mode="parallel", seed=1).save(root / "drafter")
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`model`: the --served-model-name (None: the server's default); `env`: extra environment;
    `tls`: an ssl.SSLContext trusting the server's certificate (it speaks HTTPS); `headers`: sent
    with every `request` (an API key)."""

    def __init__(self, argv: list[str], log: Path, model: str | None, env=None, tls=None, headers=None):
        self.port, self.model, self.log, self.tls = free_port(), model, log, tls
        self.headers = dict(headers or {})
        cmd = [sys.executable, "-m", "infer", "serve", *argv, "--port", str(self.port)]
        if "--prefill-chunk" not in argv:  # fewer prefill shapes to compile at each test server's start
            cmd += ["--prefill-chunk", "16"]
        if model is not None:
            cmd += ["--served-model-name", model]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("wb"), env={**os.environ, **(env or {})}
        )
        self.wait_ready()

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.stderr()}")
            try:
                if request(self, "GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the server did not come up")

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def metric(self, name: str) -> float:
        """A metric's value from /metrics (a gauge, or a counter's _total)."""
        text = request(self, "GET", "/metrics")[2]
        for line in text.splitlines():
            if line.split(" ")[0] == name:
                return float(line.split(" ")[1])
        raise KeyError(f"{name} not in /metrics")


def connection(server, timeout: float = HANG_S) -> http.client.HTTPConnection:
    if getattr(server, "tls", None) is not None:
        return http.client.HTTPSConnection("127.0.0.1", server.port, timeout=timeout, context=server.tls)
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)


def request(server, method: str, path: str, body=None, headers=None, timeout: float = HANG_S):
    """(status, headers, text) of one HTTP request (the server's own headers, then `headers`);
    a dict body is sent as JSON."""
    conn = connection(server, timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        sent = {"Content-Type": "application/json", **getattr(server, "headers", {}), **(headers or {})}
        conn.request(method, path, body=data, headers=sent)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read().decode()
    finally:
        conn.close()


def sse_events(text: str) -> list:
    """The JSON events of a server-sent-event body, then "[DONE]" if it came."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def words_to_ids(text: str) -> list[int]:
    """The tiny word tokenizer's text back to ids ("w5 w17" -> [5, 17])."""
    return [int(w[1:]) for w in text.split()]


def shown(ids: list[int]) -> list[int]:
    """The ids the word tokenizer's text shows: its unknown token w0 is special, left out of text."""
    return [t for t in ids if t != 0]


def mixed_requests(lengths=(3, 9, 17, 30)) -> list[tuple]:
    """(prompt ids, max tokens, temperature, seed, stream): a prompt of each length, greedy and
    sampled, streaming and not."""
    import hf_tiny
    import numpy as np

    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, hf_tiny.VOCAB, size=n).tolist() for n in lengths]
    return [
        (p, n, temperature, seed + i, stream)
        for i, p in enumerate(prompts)
        for n, temperature, seed, stream in ((12, 0.0, 0, False), (10, 0.0, 0, True), (12, 0.9, 100, False),
                                             (10, 0.9, 200, True))
    ]  # fmt: skip


def alone(target, drafter: Path, k: int, requests) -> list[list[int]]:
    """Each request's tokens from one-device `generate` of its prompt alone (seed s: row_key(s, 0))."""
    import peagle_jax as pj
    from infer import SpeculativeDecoder

    dec = SpeculativeDecoder(target, pj.load_drafter(drafter), k=k, mode="parallel")
    return [
        dec.generate([p], max_new_tokens=n, temperature=t, top_p=0.95 if t else 1.0, seed=s).tokens[0]
        for p, n, t, s, _ in requests
    ]


def ask(server, req) -> list[int]:
    """The ids of a `mixed_requests` request's text, through /v1/completions (model "tiny")."""
    ids, n, temperature, seed, stream = req
    body = {"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": temperature, "seed": seed, "stream": stream}
    body["top_p"] = 0.95 if temperature else 1.0
    status, _, text = request(server, "POST", "/v1/completions", body)
    assert status == 200, text
    if stream:
        events = sse_events(text)
        assert events[-1] == "[DONE]"
        return words_to_ids("".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]))
    return words_to_ids(json.loads(text)["choices"][0]["text"])


class OnFirstUse(dict):
    """name -> a future of what `start(name)` returns, started on first use (`eager` names at once,
    together): a module's servers that only `slow` tests use start only when those run."""

    def __init__(self, start, eager=()):
        super().__init__()
        from concurrent.futures import ThreadPoolExecutor

        self.start, self.pool = start, ThreadPoolExecutor(4)
        for name in eager:
            self[name]

    def __missing__(self, name):
        future = self[name] = self.pool.submit(self.start, name)
        return future

    def results(self) -> dict:
        """name -> what started, of the names started (their start waited for)."""
        self.pool.shutdown()
        return {name: future.result() for name, future in list(self.items())}
