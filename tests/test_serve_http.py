"""`python -m infer serve` on 127.0.0.1 as a hostile or careless client meets it: API keys, the Host
allow-list, CORS, the Content-Type, the body, head and connection limits, slow and vanishing
clients, unknown fields under --strict, bounded metric labels, the model id.

One server (tiny random target, word tokenizer, random head, 2 slots) with three keys (a flag, a
file, the environment), small limits and a short client timeout serves every test."""

from __future__ import annotations

import json
import socket
import time

import pytest
from serve_support import ServerProcess, request, tiny_assets

from bench.probe_client import closed_within
from infer.serve.server import open_warning

openai = pytest.importorskip("openai")

KEYS = ("sk-flag", "sk-file", "sk-env")
BODY_LIMIT, HEAD_LIMIT, CLIENT_TIMEOUT, CONNECTIONS = 4096, 4096, 1.5, 24
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-http")
    tiny_assets(root)
    (root / "keys.txt").write_text(f"# one key a line\n\n{KEYS[1]}\n")
    argv = ["--target", root / "target", "--drafter", root / "drafter", "--k", 2, "--max-batch", 2, "--max-len", 128]
    argv += ["--api-key", KEYS[0], "--api-key-file", root / "keys.txt", "--allowed-hosts", "127.0.0.1"]
    argv += ["--allowed-hosts", "localhost", "--allowed-origins", ORIGIN, "--strict"]
    argv += ["--max-body-bytes", BODY_LIMIT, "--max-header-bytes", HEAD_LIMIT]
    argv += ["--client-timeout", CLIENT_TIMEOUT, "--max-connections", CONNECTIONS]
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    env = {"PEAGLE_API_KEY": KEYS[2]}
    proc = ServerProcess([str(a) for a in argv], root / "server.log", None, env=env, headers=headers)
    yield proc
    assert proc.stop() == 0, proc.stderr()
    assert "Traceback" not in proc.stderr(), proc.stderr()


def client(server, key=KEYS[0]):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def body(**fields) -> dict:
    return {"model": "target", "prompt": "w5 w6", "max_tokens": 3, "temperature": 0, **fields}


def raw_socket(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def log_lines(server, text: str) -> list[str]:
    return [line for line in server.stderr().splitlines() if text in line]


# ---------------------------------------------------------------- keys


def test_every_key_generates_and_no_key_does_not(server):
    for key in KEYS:  # --api-key, --api-key-file, PEAGLE_API_KEY
        assert client(server, key).completions.create(**body()).usage.completion_tokens == 3
    before = server.metric("peagle_generation_tokens_total")
    for key in ("wrong", KEYS[0] + "x", KEYS[0][:-1]):
        with pytest.raises(openai.AuthenticationError):
            client(server, key).completions.create(**body())
    for headers in ({"Authorization": ""}, {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": KEYS[0]}):
        status, got, text = request(server, "POST", "/v1/chat/completions", body(), headers=headers)
        error = json.loads(text)["error"]
        assert status == 401 and got["www-authenticate"] == "Bearer" and error["code"] == "invalid_api_key"
        assert set(error) == {"message", "type", "param", "code"}
    for path in ("/v1/models", "/v1/models/target", "/v1/embeddings"):  # every /v1 route, known or not
        assert request(server, "GET", path, headers={"Authorization": ""})[0] == 401, path
    assert server.metric("peagle_generation_tokens_total") == before  # zero unauthenticated generations
    for path in ("/health", "/metrics"):  # open by default
        assert request(server, "GET", path, headers={"Authorization": ""})[0] == 200


def test_the_model_id_is_the_folder_name_never_a_path(server):
    assert [m.id for m in client(server).models.list().data] == ["target"]
    assert client(server).models.retrieve("target").id == "target"
    with pytest.raises(openai.NotFoundError) as err:
        client(server).completions.create(**body(model="other"))
    assert "/" not in err.value.message and "'target'" in err.value.message


def test_open_warning_names_the_address_only_beyond_loopback():
    assert "0.0.0.0 without an API key" in open_warning("0.0.0.0", ())
    assert "10.1.2.3" in open_warning("10.1.2.3", ())
    for host, keys in (("127.0.0.1", ()), ("::1", ()), ("localhost", ()), ("0.0.0.0", (b"k",))):
        assert open_warning(host, keys) is None, host


# ---------------------------------------------------------------- hosts, CORS, content type


def test_a_host_not_allowed_is_refused(server):
    status, _, text = request(server, "GET", "/health", headers={"Host": "rebound.example:80"})
    assert status == 400 and json.loads(text)["error"]["code"] == "invalid_host"
    assert request(server, "POST", "/v1/completions", body(), headers={"Host": "localhost"})[0] == 200


def test_cors_only_for_the_allowed_origin(server):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    status, headers, _ = request(server, "OPTIONS", "/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = request(
        server, "OPTIONS", "/v1/completions", headers={"Origin": "https://evil.example", **preflight}
    )
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = request(server, "POST", "/v1/completions", body(), headers={"Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""])
def test_a_body_that_is_not_json_by_its_content_type_is_415(server, content_type):
    before = server.metric("peagle_prompt_tokens_total")
    status, _, text = request(
        server, "POST", "/v1/completions", json.dumps(body()), headers={"Content-Type": content_type}
    )
    assert status == 415 and json.loads(text)["error"]["code"] == "unsupported_media_type"
    assert server.metric("peagle_prompt_tokens_total") == before  # nothing ran
    json_charset = {"Content-Type": "application/json; charset=utf-8"}
    assert request(server, "POST", "/v1/completions", json.dumps(body()), headers=json_charset)[0] == 200


# ---------------------------------------------------------------- limits


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    big = json.dumps(body(prompt="w5 " * BODY_LIMIT))
    status, headers, text = request(server, "POST", "/v1/completions", big)
    assert status == 413 and json.loads(text)["error"]["code"] == "body_too_large"
    # refused from the Content-Length alone: the server answers before any body byte is sent
    sock = raw_socket(server)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
    sock.sendall(f"{head}Content-Type: application/json\r\nContent-Length: {10 * BODY_LIMIT}\r\n\r\n".encode())
    closed, got = closed_within(sock, 10)
    assert closed and got.startswith(b"HTTP/1.1 413")
    # a chunked body (no Content-Length) is cut where it passes the limit
    sock = raw_socket(server)
    sock.sendall(f"{head}Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    for _ in range(3):
        sock.sendall(f"{BODY_LIMIT // 2:x}\r\n".encode() + b" " * (BODY_LIMIT // 2) + b"\r\n")
    closed, got = closed_within(sock, 10)
    assert closed and got.startswith(b"HTTP/1.1 413")


def test_a_head_over_the_limit_is_refused(server):
    status, _, text = request(server, "GET", "/health", headers={"X-Big": "a" * (2 * HEAD_LIMIT)})
    assert status == 431 and json.loads(text)["error"]["code"] == "headers_too_large"
    sock = raw_socket(server)  # a head that arrives in pieces is cut where it passes the limit (h11)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    try:
        for _ in range(4):
            sock.sendall(b"X-Big: " + b"a" * (HEAD_LIMIT // 2) + b"\r\n")
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server closed it already
    closed, got = closed_within(sock, 10)
    assert closed and got[:12] in (b"HTTP/1.1 400", b"")
    assert request(server, "GET", "/health")[0] == 200


def test_a_slow_body_is_408_and_a_vanishing_one_one_log_line(server):
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
    head += "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    sock = raw_socket(server)
    sock.sendall(head.encode() + b'{"model": ')
    closed, got = closed_within(sock, 10 * CLIENT_TIMEOUT)
    assert closed and got.startswith(b"HTTP/1.1 408"), got
    sock = raw_socket(server)
    sock.sendall(head.encode() + b'{"model": ')
    time.sleep(0.3)
    sock.close()
    deadline = time.monotonic() + 10
    while not log_lines(server, "went away before its request body was complete") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(log_lines(server, "went away before its request body was complete")) == 1
    assert len(log_lines(server, "sent its request body too slowly")) == 1
    assert "Traceback" not in server.stderr()


def test_idle_and_slow_heads_are_closed_and_the_connection_limit_holds(server):
    # the lines this test makes: a head cut in pieces above may have ended by the timeout too
    logged = len(log_lines(server, "sent no complete request head"))
    idle = [raw_socket(server) for _ in range(CONNECTIONS + 10)]
    slow = raw_socket(server)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head that never ends
    time.sleep(0.3)
    status, _, _ = request(server, "GET", "/health")
    assert status == 503  # more connections than --max-connections: refused, not queued
    assert all(closed_within(s, 10 * CLIENT_TIMEOUT)[0] for s in [*idle, slow])
    assert request(server, "GET", "/health")[0] == 200
    new = log_lines(server, "sent no complete request head")[logged:]
    assert len(new) == 1, new  # the slow one; idle ones are silent


# ---------------------------------------------------------------- strict fields, metric labels


def test_strict_refuses_an_unknown_field_with_422(server):
    status, _, text = request(server, "POST", "/v1/completions", body(bogus_field=3))
    error = json.loads(text)["error"]
    assert status == 422 and error["param"] == "bogus_field" and "unknown field" in error["message"]


def test_metric_labels_stay_bounded_whatever_the_paths(server):
    for i in range(60):
        request(server, "GET", f"/probe-{i}-{'x' * 50}")
    text = request(server, "GET", "/metrics")[2]
    endpoints = {line.split('endpoint="')[1].split('"')[0] for line in text.splitlines() if 'endpoint="' in line}
    assert endpoints <= {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/models/{model:path}",
        "/v1/completions",
        "/v1/chat/completions",
        "other",
    }
    assert server.metric('peagle_requests_total{endpoint="other",status="404"}') >= 60
