"""The server and its clients for `bench.online_loop`: a `python -m infer serve` process, streaming
chat requests over HTTP from several threads, and a head swapped in while they stream.

A request is a dict: {"index", "prompt" (its index in the prompt set), "messages", "max_tokens",
"temperature", "seed"}; its result says whether it was answered whole (status 200, a finish reason,
`[DONE]`, no error event), its text, token count and times (time.monotonic())."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.serve_bench import free_port
from bench.serve_setup import map_in_threads

ROOT = Path(__file__).resolve().parent.parent
MODEL = "online-loop"  # the --served-model-name the clients send
COMPILE_LINE = "Finished XLA compilation"  # what JAX_LOG_COMPILES=1 logs once per compiled program
REQUEST_TIMEOUT = 3600.0


class Server:
    """`python -m infer serve ARGV` on 127.0.0.1 (a free port), its stderr in `log`; up once /health answers."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None, start_timeout: float = 1800.0):
        self.port, self.log = free_port(), Path(log)
        cmd = [sys.executable, "-m", "infer", "serve", *argv, "--port", str(self.port), "--served-model-name", MODEL]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log.open("wb"), env={**os.environ, **(env or {})}
        )
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"error: the server exited with {self.proc.returncode} (its log: {self.log})")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"error: the server did not come up in {start_timeout:.0f} s (its log: {self.log})")

    def call(self, method: str, path: str, body=None, headers=None, timeout: float = 600.0) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body)
            conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, str]:
        return self.call("GET", path, timeout=10.0)

    def head(self) -> dict:
        """The head in use, as /v1/models names it: {"name", "fingerprint"}."""
        return json.loads(self.get("/v1/models")[1])["data"][0]["head"]

    def swap(self, path: str, admin_key: str) -> tuple[int, str]:
        auth = {"Authorization": f"Bearer {admin_key}"}
        return self.call("POST", "/v1/admin/head", {"path": str(path)}, auth)

    def compiles(self) -> int:
        """Programs compiled so far (the server runs with JAX_LOG_COMPILES=1)."""
        return self.log.read_text(errors="replace").count(COMPILE_LINE)

    def stop(self) -> int:
        """SIGTERM, then its exit status (its request log's shards are finished on the way out)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(300)


def chat_body(req: dict) -> dict:
    body = {"model": MODEL, "messages": req["messages"], "max_tokens": req["max_tokens"], "stream": True}
    body |= {"temperature": req["temperature"], "stream_options": {"include_usage": True}}
    if req.get("seed") is not None:
        body["seed"] = req["seed"]
    if req.get("ignore_eos"):
        body["ignore_eos"] = True
    return body


def read_stream(resp, res: dict) -> None:
    """The SSE events of a chat stream into `res`: text, tokens, finish reason, an error event, [DONE]."""
    pieces = []
    for line in resp:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            res["done"] = True
            break
        event = json.loads(data)
        if "error" in event:
            res["error"] = str(event["error"].get("message", event["error"]))[:300]
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                pieces.append(piece)
                res["first"] = res["first"] or time.monotonic()
            res["finish"] = choice.get("finish_reason") or res["finish"]
        res["tokens"] = (event.get("usage") or {}).get("completion_tokens", res["tokens"])
    res["text"] = "".join(pieces)


def new_result(req: dict) -> dict:
    res = {"index": req["index"], "sent": time.monotonic(), "first": None, "end": None, "status": None}
    return res | {"done": False, "finish": None, "error": None, "text": "", "tokens": 0, "ok": False}


def stream_chat(port: int, req: dict, res: dict | None = None, timeout: float = REQUEST_TIMEOUT) -> dict:
    """One streaming chat request; `ok` when it was answered whole. `res`: the result to fill in
    (from `new_result`), which another thread may watch while it streams (its "first" token time)."""
    res = new_result(req) if res is None else res
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(chat_body(req)), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        res["status"] = resp.status
        if resp.status != 200:
            res["error"] = resp.read().decode(errors="replace")[:300]
        else:
            read_stream(resp, res)
    except (OSError, http.client.HTTPException, ValueError) as err:
        res["error"] = f"{type(err).__name__}: {err}"[:300]
    finally:
        conn.close()
        res["end"] = time.monotonic()
    res["ok"] = res["status"] == 200 and res["done"] and res["finish"] is not None and res["error"] is None
    return res


def drive(port: int, requests: list[dict], clients: int, on_done) -> None:
    """Every request once, from `clients` threads each taking the next as it finishes one;
    `on_done(request, result)` is called under one lock."""
    lock = threading.Lock()

    def one(req: dict) -> None:
        res = stream_chat(port, req)
        with lock:
            on_done(req, res)

    map_in_threads(one, requests, clients)
