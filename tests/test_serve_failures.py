"""Failures a supervisor can act on, through the real `python -m infer serve` process, driven by
the scheduler's test-only fault hook (PEAGLE_SERVE_FAULT): a request whose own work fails gets a
500 and the server goes on; a device failure ends every request with an error, is one log line
and exits 1 (`--on-device-failure exit`), or leaves the server up answering 503 (`stay`, here
over HTTPS with a certificate made for the test, its probes keyed too); a start-up whose slots the device cannot hold
names the flags and the plan command."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import threading
import time

import pytest
from in_process import run_module
from serve_support import ServerProcess, request, sse_events, tiny_assets

openai = pytest.importorskip("openai")

ARGV = ["--k", "2", "--max-batch", "2", "--max-len", "128"]  # tests/test_serve_http.py's shapes: compiled once


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-failures")
    tiny_assets(root)
    return root


def model_argv(root) -> list[str]:
    return ["--target", str(root / "target"), "--drafter", str(root / "drafter"), *ARGV]


def body(**fields) -> dict:
    return {"model": "tiny", "prompt": [5, 6, 7], "temperature": 0, **fields}


def lines(server, text: str) -> list[str]:
    return [line for line in server.stderr().splitlines() if text in line]


# ---------------------------------------------------------------- --on-device-failure exit (the default)


@pytest.fixture(scope="module")
def failing(assets):
    """The 2nd prefill fails (a request's own work), then the 3rd step (the device)."""
    env = {"PEAGLE_SERVE_FAULT": "prefill:2,step:3"}
    proc = ServerProcess(model_argv(assets), assets / "failing.log", "tiny", env=env)
    yield proc
    if proc.proc.poll() is None:
        proc.proc.kill()
    assert "Traceback" not in proc.stderr(), proc.stderr()


def test_a_failed_prefill_is_that_requests_500_and_the_server_goes_on(failing):
    assert request(failing, "POST", "/v1/completions", body(max_tokens=1))[0] == 200  # prefill 1: no step
    status, _, text = request(failing, "POST", "/v1/completions", body(max_tokens=1))  # prefill 2 fails
    error = json.loads(text)["error"]
    assert status == 500 and error["type"] == "server_error"
    assert "failed in its prefill" in error["message"] and "injected fault" in error["message"]
    assert request(failing, "POST", "/v1/completions", body(max_tokens=1))[0] == 200
    assert request(failing, "GET", "/health")[0] == 200
    assert len(lines(failing, "a request failed in its prefill")) == 1
    error_label = 'vllm:request_success_total{engine="0",finished_reason="error",model_name="tiny"}'
    assert failing.metric(error_label) == 1 and failing.metric('peagle_requests_finished_total{reason="failed"}') == 1


def test_a_device_failure_ends_every_request_and_exits_1(failing):
    results = {}

    def stream(name):
        results[name] = request(failing, "POST", "/v1/completions", body(max_tokens=60, stream=True))

    threads = [threading.Thread(target=stream, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    assert failing.proc.wait(timeout=60) == 1  # step 3 fails: within seconds, a supervisor sees it go
    for t in threads:
        t.join(30)
    for name in ("a", "b"):
        status, _, text = results[name]
        events = sse_events(text)
        assert status == 200 and events[-1] == "[DONE]", name
        assert "the device failed" in events[-2]["error"]["message"], name
    cause = lines(failing, "the device loop failed")
    assert len(cause) == 1 and "RuntimeError: injected fault" in cause[0] and "scheduler.py:" in cause[0]
    assert failing.stderr().strip().splitlines()[-1] == "[infer] stopped: the device failed (exit 1)"


# ---------------------------------------------------------------- --on-device-failure stay, over HTTPS


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cmd = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    cmd += ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", folder / "key.pem", "-out", folder / "cert.pem"]
    subprocess.run([str(c) for c in cmd], check=True, capture_output=True)
    return folder / "key.pem", folder / "cert.pem"


@pytest.fixture(scope="module")
def staying(assets, certificate):
    key, cert = certificate
    argv = [*model_argv(assets), "--on-device-failure", "stay", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    argv += ["--api-key", "sk-probes", "--probes-need-key"]
    tls = ssl.create_default_context(cafile=str(cert))
    env, headers = {"PEAGLE_SERVE_FAULT": "step:2"}, {"Authorization": "Bearer sk-probes"}
    proc = ServerProcess(argv, assets / "staying.log", "tiny", env=env, tls=tls, headers=headers)
    yield proc
    assert proc.stop() == 1, proc.stderr()  # a run whose device failed: exit 1 whenever it ends
    assert "Traceback" not in proc.stderr(), proc.stderr()


def test_https_serves_and_plain_http_is_refused(staying):
    http_client = openai.DefaultHttpxClient(verify=staying.tls)
    c = openai.OpenAI(base_url=staying.base_url + "/v1", api_key="sk-probes", max_retries=0, http_client=http_client)
    assert c.completions.create(model="tiny", prompt=[5, 6], max_tokens=1).usage.completion_tokens == 1
    for path in ("/health", "/metrics"):  # --probes-need-key
        assert request(staying, "GET", path, headers={"Authorization": ""})[0] == 401, path
    plain = type("Plain", (), {"port": staying.port})()
    with pytest.raises(OSError):
        request(plain, "GET", "/health", timeout=10)


def test_stay_answers_503_after_a_device_failure(staying):
    status, _, text = request(staying, "POST", "/v1/completions", body(max_tokens=40))  # step 2 fails
    assert status == 503 and "the device failed" in json.loads(text)["error"]["message"]
    time.sleep(1)
    assert staying.proc.poll() is None  # still up
    status, _, text = request(staying, "GET", "/health")
    assert status == 503 and json.loads(text)["status"] == "failed"
    status, headers, text = request(staying, "POST", "/v1/completions", body(max_tokens=1))
    assert status == 503 and headers.get("retry-after") and "restarted" in json.loads(text)["error"]["message"]


# ---------------------------------------------------------------- start-up


def test_slots_the_device_cannot_hold_name_the_flags_and_the_plan(assets):
    argv = ["serve", *model_argv(assets)[:-4], "--max-batch", "100000", "--max-len", "100000"]
    res = run_module("infer", argv)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1, res.stderr
    assert "--max-batch 100000 x --max-len 100000" in last and "python -m peagle_jax.plan" in last
    assert "--job server --batch 100000 --cache-len 100000" in last
