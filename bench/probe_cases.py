"""The hostile probe's cases (`bench.serve_probe`): each family of cases sends its requests through
a `Client` and returns rows {"case", "expected", "got", "ok"}."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time

from bench.probe_client import (
    WAIT,
    Client,
    Row,
    matches,
    status_of,
)


def http(c: Client) -> list[Row]:
    rows = []

    def raw(case, data, expected, **kw):
        closed, got = c.raw(data, **kw)
        first = got.split(b"\r\n", 1)[0].decode(errors="replace")
        shown = first.split(" ")[1] if first.startswith("HTTP/") else ("closed" if closed else "open")
        rows.append({"case": case, "expected": expected, "got": shown, "ok": matches(expected, shown)})

    raw("garbage request line", b"HELLO WORLD\r\n\r\n", "400|closed")
    raw("HTTP/1.1 without Host", b"GET /health HTTP/1.1\r\n\r\n", "400|closed")
    raw("header line without a colon", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nbroken\r\n\r\n", "400|closed")
    raw("NUL in a header", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: a\x00b\r\n\r\n", "400|closed")
    raw("two Content-Lengths that differ", c.head(extra="Content-Length: 5\r\nContent-Length: 7\r\n\r\n"), "400|closed")
    raw("negative Content-Length", c.head(extra="Content-Length: -5\r\n\r\n"), "400|closed")
    raw("Content-Length not a number", c.head(extra="Content-Length: abc\r\n\r\n"), "400|closed")
    raw(
        "Transfer-Encoding and Content-Length",
        c.head(extra="Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"),
        "400|closed",
    )
    bad_chunk = c.head(extra="Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n")
    raw("a chunk size that is not hex", bad_chunk, "400|closed")
    raw("HTTP/2 preface on the plain port", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "400|closed")
    raw("a TLS ClientHello on the plain port", bytes.fromhex("16030100a5010000a10303") + os.urandom(64), "400|closed")
    raw("a 100 KB request target", b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "4xx|closed")
    raw(
        "a 64 KB header",
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n",
        "4xx|closed",
    )
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 20) for i in range(2000))
    raw("2,000 headers (56 KB)", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + many + b"\r\n", "4xx|closed")
    closed, got = c.raw(
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 3
        + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    n = got.count(b"HTTP/1.1 200")
    rows.append({"case": "4 pipelined requests", "expected": "4 answers", "got": f"{n} answers", "ok": n == 4})
    return rows


def size(c: Client) -> list[Row]:
    rows = []

    def post(case, body, expected, path="/v1/completions", headers=None):
        got = status_of(c.http("POST", path, body, headers=headers))
        rows.append({"case": case, "expected": expected, "got": got, "ok": matches(expected, got)})

    post("a 2 MiB body", json.dumps(c.body(prompt="w5 " * 700_000)).encode(), "413|closed")
    post("a 100,000-token prompt (ids)", c.body(prompt=[5] * 100_000), "413")
    post(
        "10,000 messages", c.chat(messages=[{"role": "user", "content": "w5"}] * 10_000), "413", "/v1/chat/completions"
    )
    chunked = c.head(extra="Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunked += b"".join(b"%x\r\n%s\r\n" % (65536, b" " * 65536) for _ in range(40))
    closed, got = c.raw(chunked)
    shown = got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/") else ("closed" if closed else "open")
    rows.append({"case": "a chunked body of 2.5 MiB", "expected": "413", "got": shown, "ok": shown == "413"})
    rows.append(_frozen_loop(c, "a 10 MB prompt", json.dumps(c.body(prompt="w5 " * 3_500_000)).encode()))
    rows.append(_frozen_loop(c, "a 0.9 MB prompt (tokenized)", json.dumps(c.body(prompt="w5 " * 300_000)).encode()))
    return rows


def _frozen_loop(c: Client, case: str, body: bytes) -> Row:
    """Whether /health answers within 1 s while the server takes a big body."""
    done = threading.Event()
    answer = {}

    def send():
        answer["status"] = status_of(c.http("POST", "/v1/completions", body, timeout=60))
        done.set()

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.05)
    worst = 0.0
    while not done.is_set():
        t0 = time.perf_counter()
        c.http("GET", "/health", timeout=30)
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.05)
    t.join()
    got = f"{answer['status']}, /health in {worst:.2f}s at worst"
    return {
        "case": f"{case}: /health meanwhile",
        "expected": "4xx, /health < 1 s",
        "got": got,
        "ok": answer["status"][:1] == "4" and worst < 1.0,
    }


def slow(c: Client, timeout: float) -> list[Row]:
    rows = []
    wait = timeout + 5

    def row(case, expected, got, ok):
        rows.append({"case": case, "expected": expected, "got": got, "ok": ok})

    closed, _ = c.raw(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ", wait=wait)
    row("a head that stops mid-way", f"closed within {wait:g}s", "closed" if closed else "still open", closed)
    slow = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: aaaa\r\n" * 40
    closed, got = c.raw(slow, wait=wait, pieces=40, gap=0.25)  # a header every 0.25 s: 10 s in all
    early = closed and not got.startswith(b"HTTP/1.1 200")
    row(
        "slowloris: a header every 0.25 s for 10 s",
        "closed before the head ends",
        "closed" if early else "served",
        early,
    )
    head = c.head(extra="Content-Type: application/json\r\nContent-Length: 500\r\n\r\n")
    closed, got = c.raw(head + b'{"model": ', wait=wait)
    shown = got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/") else ("closed" if closed else "still open")
    row("a body that stops mid-way", "408|closed", shown, shown in ("408", "closed"))
    closed, _ = c.raw(b"", wait=wait)
    row("a connection that sends nothing", f"closed within {wait:g}s", "closed" if closed else "still open", closed)
    rows += _idle_crowd(c, 300, wait)
    return rows


def _idle_crowd(c: Client, n: int, wait: float) -> list[Row]:
    socks = [socket.create_connection(("127.0.0.1", c.port), timeout=wait) for _ in range(n)]
    t0 = time.perf_counter()
    ok = c.healthy()
    took = time.perf_counter() - t0
    rows = [
        {
            "case": f"{n} idle connections: /health",
            "expected": "200",
            "got": f"{'200' if ok else 'not 200'} in {took:.2f}s",
            "ok": ok,
        }
    ]
    time.sleep(wait)
    closed = 0
    for s in socks:
        s.settimeout(0.2)
        try:
            closed += s.recv(1) == b""
        except (TimeoutError, ConnectionResetError):
            closed += 0
        s.close()
    rows.append(
        {
            "case": f"{n} idle connections: closed by the server",
            "expected": f"{n} within {wait:g}s",
            "got": str(closed),
            "ok": closed == n,
        }
    )
    return rows


def json_bodies(c: Client) -> list[Row]:
    model = json.dumps(c.model).encode()
    cases = [
        ("malformed JSON", b'{"model": ' + model + b', "prompt": ', "400"),
        ("a JSON list", b"[1, 2]", "400"),
        ("an empty body", b"", "400"),
        (
            "JSON nested 10,000 deep",
            b'{"model": ' + model + b', "prompt": "w5", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
            "400",
        ),
        ("a 5,000-digit integer", b'{"model": ' + model + b', "prompt": "w5", "seed": ' + b"9" * 5000 + b"}", "400"),
        ("a lone surrogate in the prompt", b'{"model": ' + model + b', "prompt": "w5 \\ud800"}', "400"),
        ("NaN", b'{"model": ' + model + b', "prompt": "w5", "temperature": NaN}', "4xx"),
        ("Infinity", b'{"model": ' + model + b', "prompt": "w5", "temperature": Infinity}', "4xx"),
        ("1e999 (an infinite float)", b'{"model": ' + model + b', "prompt": "w5", "temperature": 1e999}', "4xx"),
        ("invalid UTF-8", b'{"model": ' + model + b', "prompt": "\xff\xfe"}', "400"),
    ]
    rows = []
    for case, raw, expected in cases:
        got = status_of(c.http("POST", "/v1/completions", raw))
        rows.append({"case": case, "expected": expected, "got": got, "ok": matches(expected, got)})
    return rows


# bad values: (case, the fields put into a valid body, the status expected)
BAD_COMPLETIONS = [
    ("model unknown", dict(model="gpt-9"), "404"),
    ("model of 10,000 characters", dict(model="m" * 10_000), "404"),
    ("max_tokens 0", dict(max_tokens=0), "400"),
    ("max_tokens -1", dict(max_tokens=-1), "400"),
    ("max_tokens 10**9", dict(max_tokens=10**9), "400"),
    ("max_tokens a string", dict(max_tokens="5"), "4xx"),
    ("max_tokens 2.5", dict(max_tokens=2.5), "4xx"),
    ("temperature -1", dict(temperature=-1), "4xx"),
    ("temperature a string", dict(temperature="hot"), "4xx"),
    ("top_p 0", dict(top_p=0), "4xx"),
    ("top_p 1.5", dict(top_p=1.5), "4xx"),
    ("seed -1", dict(seed=-1), "4xx"),
    ("seed 2**64", dict(seed=2**64), "4xx"),
    ("n 0", dict(n=0), "400"),
    ("n 1000", dict(n=1000), "400"),
    ("stop: 100 strings", dict(stop=[f"w{i}" for i in range(100)]), "400"),
    ("stop: 10,000 characters", dict(stop="x" * 10_000), "400"),
    ("stop: an empty string", dict(stop=[""]), "400"),
    ("stop a number", dict(stop=5), "4xx"),
    ("stop_token_ids [-1]", dict(stop_token_ids=[-1]), "400"),
    ("stop_token_ids [10**6]", dict(stop_token_ids=[10**6]), "400"),
    ("logit_bias key not a token id", dict(logit_bias={"x": 1}), "400"),
    ("logit_bias 200", dict(logit_bias={"5": 200}), "4xx"),
    ("logit_bias token outside the vocabulary", dict(logit_bias={"1000000": 1}), "400"),
    ("logprobs 100", dict(logprobs=100), "4xx"),
    ("top_k -5", dict(top_k=-5), "4xx"),
    ("min_p 2", dict(min_p=2), "4xx"),
    ("presence_penalty 5", dict(presence_penalty=5), "4xx"),
    ("repetition_penalty 0", dict(repetition_penalty=0), "4xx"),
    ("min_tokens > max_tokens", dict(min_tokens=10, max_tokens=2), "400"),
    ("response_format json_object", dict(response_format={"type": "json_object"}), "400"),
    ("prompt empty", dict(prompt=""), "400"),
    ("prompt []", dict(prompt=[]), "400"),
    ("prompt [[]]", dict(prompt=[[]]), "400"),
    ("prompt a token outside the vocabulary", dict(prompt=[5, 10**6]), "400"),
    ("prompt a number", dict(prompt=5), "4xx"),
    ("prompt null", dict(prompt=None), "4xx"),
    ("stream a string", dict(stream="yes"), "4xx"),
    ("stream_options a list", dict(stream_options=[1]), "4xx"),
]
BAD_CHATS = [
    ("messages []", dict(messages=[]), "400"),
    ("messages a string", dict(messages="w5"), "4xx"),
    ("role unknown", dict(messages=[{"role": "x", "content": "w5"}]), "4xx"),
    ("content an image part", dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "400"),
    ("content a number", dict(messages=[{"role": "user", "content": 5}]), "4xx"),
    ("top_logprobs 50", dict(logprobs=True, top_logprobs=50), "4xx"),
    ("tools", dict(tools=[{"type": "function", "function": {"name": "f"}}]), "400"),
    ("max_completion_tokens 0", dict(max_completion_tokens=0), "400"),
]


def fields(c: Client) -> list[Row]:
    rows = []
    for path, make, group in (
        ("/v1/completions", c.body, BAD_COMPLETIONS),
        ("/v1/chat/completions", c.chat, BAD_CHATS),
    ):
        for case, fields, expected in group:
            got = status_of(c.http("POST", path, make(**fields)))
            rows.append({"case": case, "expected": expected, "got": got, "ok": matches(expected, got)})
    return rows


def accepted(c: Client) -> list[Row]:
    """What clients send by default, and the fields real clients use: each should be served."""
    b, ch = c.body, c.chat
    cases = [
        ("logprobs false", "/v1/completions", b(logprobs=False)),
        ("logprobs null", "/v1/completions", b(logprobs=None)),
        ("echo false", "/v1/completions", b(echo=False)),
        ("response_format text", "/v1/chat/completions", ch(response_format={"type": "text"})),
        ("penalties 0", "/v1/completions", b(presence_penalty=0, frequency_penalty=0)),
        ("logit_bias {}", "/v1/completions", b(logit_bias={})),
        ("ignore_eos (GuideLLM)", "/v1/completions", b(ignore_eos=True)),
        (
            "continuous_usage_stats (GuideLLM)",
            "/v1/completions",
            b(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
        ),
        ("top_k, min_p, repetition_penalty", "/v1/completions", b(top_k=5, min_p=0.05, repetition_penalty=1.1)),
        ("an unknown field", "/v1/completions", b(some_new_field=1)),
        ("logprobs 2 and echo", "/v1/completions", b(logprobs=2, echo=True)),
        ("a list of prompts", "/v1/completions", b(prompt=["w5", "w6"])),
        ("n 2", "/v1/completions", b(n=2, temperature=0.8)),
        ("chat logprobs, top_logprobs", "/v1/chat/completions", ch(logprobs=True, top_logprobs=2)),
        (
            "content null, role tool",
            "/v1/chat/completions",
            ch(
                messages=[
                    {"role": "user", "content": "w5"},
                    {"role": "assistant", "content": None},
                    {"role": "tool", "content": "w6", "tool_call_id": "1"},
                ]
            ),
        ),
        (
            "content as text parts",
            "/v1/chat/completions",
            ch(messages=[{"role": "user", "content": [{"type": "text", "text": "w5"}]}]),
        ),
        ("max_completion_tokens", "/v1/chat/completions", ch(max_completion_tokens=3)),
    ]
    rows = []
    for case, path, body in cases:
        got = status_of(c.http("POST", path, body))
        rows.append({"case": case, "expected": "200", "got": got, "ok": got == "200"})
    return rows


def semantic(c: Client) -> list[Row]:
    rows = []

    def row(case, expected, got, ok):
        rows.append({"case": case, "expected": expected, "got": str(got), "ok": bool(ok)})

    status, _, text = c.http("POST", "/v1/completions", c.body(stream=True, stream_options={"include_usage": True}))
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    usages = sum("usage" in e and e["usage"] is not None for e in events)
    row("include_usage: usage chunks in a stream", "1", usages, usages == 1)
    reasons = {ch.get("finish_reason") for e in events for ch in e.get("choices", [])} - {None}
    row("finish reasons are OpenAI's", "stop / length", ",".join(sorted(reasons)), reasons <= {"stop", "length"})
    body = c.body()
    del body["max_tokens"]
    status, _, text = c.http("POST", "/v1/completions", body)
    n = json.loads(text)["usage"]["completion_tokens"] if status == 200 else status
    row("omitted max_tokens (completions)", "16", n, n == 16)
    row(
        "GET /v1/models/{id}",
        "200",
        status_of(c.http("GET", f"/v1/models/{c.model}")),
        c.http("GET", f"/v1/models/{c.model}")[0] == 200,
    )
    row("the model id is not a path", "no /", c.model, "/" not in c.model)
    status, _, text = c.http("POST", "/v1/completions", c.body(model="nope"))
    row(
        "a 404 shows no path",
        "no /",
        "path shown" if "/" in text.replace("not_found", "") else "no path",
        "/" not in json.loads(text)["error"]["message"],
    )
    got = status_of(c.http("POST", "/v1/completions", json.dumps(c.body()), headers={"Content-Type": "text/plain"}))
    row("a text/plain body (a browser form)", "415", got, got == "415")
    got = status_of(c.http("GET", "/health", headers={"Host": "rebound.example"}))
    row("a Host not allowed (DNS rebinding)", "400", got, got == "400")
    for case, key in (("no API key", None), ("a wrong API key", "nope")):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        got = status_of(c.http("POST", "/v1/completions", c.body(), headers=headers, key=key is not None))
        row(f"{case}: a generation", "401", got, got.startswith("401"))
    size0 = len(c.http("GET", "/metrics")[2])
    for i in range(300):
        c.http("GET", f"/{i}-" + "p" * 200)
    grew = len(c.http("GET", "/metrics")[2]) - size0
    row("/metrics after 300 unknown paths", "grows < 5 KB", f"grew {grew / 1024:.1f} KB", grew < 5 * 1024)
    return rows


def queue_and_disconnect(c: Client) -> list[Row]:
    rows = []
    socks = []
    for _ in range(12):  # 4 slots + 8 queued
        s = socket.create_connection(("127.0.0.1", c.port), timeout=WAIT)
        payload = json.dumps(c.body(max_tokens=1500, stream=True)).encode()
        s.sendall(c.head(extra=f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n") + payload)
        socks.append(s)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and c.gauge("peagle_queue_length") < 8:
        time.sleep(0.2)
    status, headers, _ = c.http("POST", "/v1/completions", c.body())
    ok = status == 503 and "retry-after" in headers
    rows.append(
        {
            "case": "a full queue",
            "expected": "503 + Retry-After",
            "got": f"{status} {'+ Retry-After' if 'retry-after' in headers else ''}",
            "ok": ok,
        }
    )
    for s in socks:
        s.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and c.http("POST", "/v1/completions", c.body(max_tokens=1))[0] != 200:
        time.sleep(0.5)
    freed = c.http("POST", "/v1/completions", c.body(max_tokens=1))[0] == 200
    rows.append(
        {
            "case": "12 clients hang up: slots freed",
            "expected": "200 after",
            "got": "200" if freed else "busy",
            "ok": freed,
        }
    )
    before = len(c.log.read_text(errors="replace").splitlines())
    c.raw(c.head(extra="Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n") + b'{"mo', wait=0.3)
    time.sleep(1.0)
    lines = len(c.log.read_text(errors="replace").splitlines()) - before
    rows.append(
        {"case": "a client that drops mid-body: log lines", "expected": "<= 1", "got": str(lines), "ok": lines <= 1}
    )
    return rows


def killer(c: Client, proc: subprocess.Popen) -> list[Row]:
    """Last: what ended the server before (a prompt of no tokens), then a stop with streams in flight."""
    rows = []
    got = status_of(c.http("POST", "/v1/completions", c.body(prompt="   ")))
    rows.append({"case": "a whitespace-only prompt", "expected": "400", "got": got, "ok": got.startswith("400")})
    time.sleep(1)
    ok = c.healthy() and c.http("POST", "/v1/completions", c.body())[0] == 200
    rows.append(
        {
            "case": "after it: /health and a generation",
            "expected": "200, 200",
            "got": "200, 200" if ok else "refused",
            "ok": ok,
        }
    )
    results = []

    def stream():
        results.append(c.http("POST", "/v1/completions", c.body(max_tokens=1500, stream=True), timeout=60))

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "hung"
    took = time.monotonic() - t0
    for t in threads:
        t.join(30)
    rows.append(
        {
            "case": "SIGTERM with 2 streams in flight",
            "expected": "exit 0 < 10 s",
            "got": f"exit {code} in {took:.1f}s",
            "ok": code == 0 and took < 10,
        }
    )
    ends = [_stream_end(text) for _, _, text in results]
    rows.append(
        {
            "case": "those streams end with",
            "expected": "an error event",
            "got": ", ".join(ends) or "nothing",
            "ok": ends and all(e == "error event" for e in ends),
        }
    )
    return rows


def _stream_end(text: str) -> str:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    last = next((json.loads(e) for e in reversed(events) if e != "[DONE]"), None)
    if last is None:
        return "no event"
    if "error" in last:
        return "error event"
    reason = (last.get("choices") or [{}])[0].get("finish_reason")
    return f'finish_reason "{reason}"'


# ---------------------------------------------------------------- the run
