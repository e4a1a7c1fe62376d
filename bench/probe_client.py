"""The hostile probe's client (`bench.serve_probe`): raw HTTP to the server under test, every
answer as (status, headers, text) or "closed", and how an answer is classified."""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path

KEY = "probe-key"
CLIENT_TIMEOUT = 3.0  # --client-timeout, when the server has it
WAIT = 10.0  # how long a case waits for an answer
Row = dict  # {"case", "expected", "got", "ok"}


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(whether the server closed the connection within `seconds`, what it sent first)."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
        return True, got
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got


# ---------------------------------------------------------------- talking to it


class Client:
    def __init__(self, port: int, model: str, log: Path | None = None):
        self.port, self.model, self.log = port, model, log

    def http(self, method, path, body=None, headers=None, timeout=WAIT, key=True):
        """(status, headers, text), or ("closed", {}, "") when no answer came. The body is sent
        whole even if the server answers first; a response cut short keeps what came."""
        data = json.dumps(body).encode() if isinstance(body, dict | list) else (body or b"")
        data = data.encode() if isinstance(data, str) else data
        sent = {"Host": "127.0.0.1", "Content-Type": "application/json", "Connection": "close"}
        if key:
            sent["Authorization"] = f"Bearer {KEY}"
        sent.update(headers or {})
        sent["Content-Length"] = str(len(data))
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in sent.items()) + "\r\n"
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        try:
            try:
                sock.sendall(head.encode() + data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # answered (and closed) before the body was sent: read the answer
            resp = http.client.HTTPResponse(sock, method=method)
            try:
                resp.begin()
            except (OSError, http.client.HTTPException):
                return "closed", {}, ""
            try:
                text = resp.read()
            except http.client.IncompleteRead as err:
                text = err.partial
            except OSError:
                text = b""
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, text.decode(errors="replace")
        finally:
            sock.close()

    def raw(self, data: bytes, wait: float = WAIT, pieces: int = 1, gap: float = 0.0) -> tuple[bool, bytes]:
        """(whether the server closed the connection within `wait` s, what it sent)."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=wait)
        try:
            step = max(1, len(data) // pieces)
            for i in range(0, len(data), step):
                sock.sendall(data[i : i + step])
                time.sleep(gap)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading: what did it answer?
        try:
            return closed_within(sock, wait)
        finally:
            sock.close()

    def head(self, method="POST", path="/v1/completions", extra="") -> bytes:
        key = f"Authorization: Bearer {KEY}\r\n"
        return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{key}{extra}".encode()

    def body(self, **fields) -> dict:
        return {"model": self.model, "prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0, **fields}

    def chat(self, **fields) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 4, **fields}

    def gauge(self, name: str) -> float:
        for line in self.http("GET", "/metrics")[2].splitlines():
            if line.startswith(name + " "):
                return float(line.split(" ")[1])
        return float("nan")

    def healthy(self) -> bool:
        return self.http("GET", "/health", timeout=5)[0] == 200


def status_of(answer) -> str:
    status, _, text = answer
    if not isinstance(status, int):
        return status
    if status >= 400:
        try:
            error = json.loads(text)["error"]
            param = error.get("param") if isinstance(error, dict) else None
            return f"{status}" + (f" ({param})" if param else "")
        except (ValueError, KeyError, TypeError):
            return f"{status} (not OpenAI's error body)"
    return str(status)


def matches(expected: str, got: str) -> bool:
    """`expected`: a status ("400"), a class ("4xx"), or alternatives ("413|closed")."""
    for want in expected.split("|"):
        if want.endswith("xx") and got[:1] == want[0] and got[1:3].isdigit():
            return True
        if got == want or got.split(" ")[0] == want:
            return True
    return False
