"""`python -m infer serve` as a process on 127.0.0.1, driven by the `openai` client and plain HTTP.

One server (tiny random target with a word tokenizer, random P-EAGLE head, K=3, 8 slots) serves
every test of the module; the shutdown and queue tests start their own small one. Outputs are
checked against `SpeculativeDecoder.generate` of each prompt alone."""

from __future__ import annotations

import http.client
import json
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import hf_tiny
import numpy as np
import pytest
from in_process import run_module
from serve_support import ServerProcess, request, shown, sse_events, tiny_assets, words_to_ids

import peagle_jax as pj
from infer import SpeculativeDecoder

openai = pytest.importorskip("openai")

K, SLOTS, MAX_LEN, MAX_NEW = 3, 8, 256, 40
CHAT = [{"role": "user", "content": "w5 w6 w7"}]
CHAT_IDS = [2, 5, 6, 7, 3, 4]  # the word tokenizer's template: w2 <content> w3 w4


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target = tiny_assets(root, max_position_embeddings=2048)  # room for long generations (the shutdown test)
    return root, target


@pytest.fixture(scope="module")
def server(assets):
    root, _ = assets
    argv = ["--target", root / "target", "--drafter", root / "drafter", "--k", K]
    argv += ["--max-batch", SLOTS, "--max-len", MAX_LEN, "--max-queue", 256]
    proc = ServerProcess([str(a) for a in argv], root / "server.log", "tiny")
    yield proc
    assert proc.stop() == 0, proc.stderr()
    assert "Traceback" not in proc.stderr(), proc.stderr()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(5, hf_tiny.VOCAB, size=int(n)).tolist() for n in rng.integers(2, 60, size=24)] + [CHAT_IDS]


@pytest.fixture(scope="module")
def reference(assets, prompts):
    """Each prompt's greedy tokens, decoded alone (MAX_NEW of them; fewer asked = a prefix)."""
    root, target = assets
    dec = SpeculativeDecoder(target, pj.load_drafter(root / "drafter"), k=K, mode="parallel")
    return [dec.generate([p], max_new_tokens=MAX_NEW).tokens[0] for p in prompts]


def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def complete(server, prompt, max_tokens, **kw):
    return client(server).completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, **kw)


# ---------------------------------------------------------------- outputs


def test_greedy_equals_generate_alone_under_16_concurrent_clients(server, prompts, reference):
    rng = random.Random(0)
    jobs = [(i, rng.randint(1, MAX_NEW)) for i in range(16)]

    def one(job):
        i, n = job
        res = complete(server, prompts[i], n, temperature=0)
        return words_to_ids(res.choices[0].text), res.choices[0].finish_reason, res.usage

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, jobs))
    for (i, n), (ids, reason, usage) in zip(jobs, results):
        assert ids == shown(reference[i][:n]), i
        assert reason == "length"
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompts[i]), n)


def test_chat_uses_the_template_and_equals_generate(server, reference):
    res = client(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert words_to_ids(res.choices[0].message.content) == shown(reference[-1][:12])
    assert res.choices[0].message.role == "assistant"
    assert res.usage.prompt_tokens == len(CHAT_IDS)


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_equals_non_streaming(server, prompts, chat):
    c = client(server)
    if chat:
        kw = dict(model="tiny", messages=CHAT, max_tokens=20, temperature=0)
        whole = c.chat.completions.create(**kw).choices[0].message.content
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        parts = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    else:
        kw = dict(model="tiny", prompt=prompts[3], max_tokens=20, temperature=0)
        whole = c.completions.create(**kw).choices[0].text
        chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        parts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(parts) == whole
    assert len([p for p in parts if p]) > 1  # it did stream
    last_choice = [ch for ch in chunks if ch.choices][-1]
    assert last_choice.choices[0].finish_reason == "length"
    # usage once: in its own last chunk (clients that add it up must not count it twice)
    assert [ch.usage is not None for ch in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 20


def test_stream_ends_with_done(server, prompts):
    body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 5, "temperature": 0, "stream": True}
    status, headers, text = request(server, "POST", "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert not any("usage" in e for e in events[:-1])  # not asked for: OpenAI sends none
    body["stream_options"] = {"include_usage": True}
    events = sse_events(request(server, "POST", "/v1/completions", body)[2])
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 5
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert [("usage" in e) for e in events[:-1]] == [False] * (len(events) - 2) + [True]


def test_seeded_sampling_is_reproducible_whatever_runs_beside(server, prompts):
    def sample(seed, i=1):
        return complete(server, prompts[i], 24, temperature=0.9, top_p=0.95, seed=seed).choices[0].text

    alone = sample(11)
    with ThreadPoolExecutor(6) as pool:
        crowd = list(pool.map(lambda j: sample(11) if j == 0 else sample(100 + j, j), range(6)))
    assert crowd[0] == alone
    assert len({sample(s) for s in (1, 2, 3)}) > 1  # the seed is used


def test_stop_token_ids_and_stop_strings(server, prompts, reference):
    ref = reference[2]
    j = next(j for j in range(3, MAX_NEW) if ref[j] not in ref[:j])
    res = complete(server, prompts[2], MAX_NEW, temperature=0, extra_body={"stop_token_ids": [ref[j]]})
    assert words_to_ids(res.choices[0].text) == shown(ref[:j])
    assert res.choices[0].finish_reason == "stop" and res.usage.completion_tokens == j + 1

    full = " ".join(f"w{t}" for t in shown(ref))
    stop = f"w{ref[j]} w{ref[j + 1]}"
    for stream in (False, True):
        res = complete(server, prompts[2], MAX_NEW, temperature=0, stop=[stop, "never"], stream=stream)
        if stream:
            chunks = list(res)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = res.choices[0].text, res.choices[0].finish_reason
        assert text == full[: full.find(stop)] and reason == "stop"


def test_models_and_health(server):
    assert [m.id for m in client(server).models.list().data] == ["tiny"]
    status, _, text = request(server, "GET", "/health")
    assert status == 200 and json.loads(text)["status"] == "ok"


def test_metrics_count_what_was_served(server, prompts):
    before = server.metric("peagle_generation_tokens_total")
    complete(server, prompts[5], 9, temperature=0)
    assert server.metric("peagle_generation_tokens_total") == before + 9
    text = request(server, "GET", "/metrics")[2]
    for name in (
        'peagle_requests_total{endpoint="/v1/completions",status="200"}',
        "peagle_prompt_tokens_total",
        "peagle_rounds_total",
        "peagle_acceptance_length_count",
        "peagle_tokens_per_round_count",
        "peagle_time_to_first_token_seconds_count",
    ):
        assert server.metric(name) > 0, name
    assert server.metric("peagle_slots") == SLOTS
    assert "peagle_queue_length" in text and "peagle_slots_in_use" in text


# ---------------------------------------------------------------- bad input


BAD = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "w1"}, 404, "model"),
    ("wrong type", "/v1/completions", {"model": "tiny", "prompt": "w1", "max_tokens": "5"}, 422, "max_tokens"),
    ("no prompt", "/v1/completions", {"model": "tiny"}, 422, "prompt"),
    ("negative max_tokens", "/v1/completions", {"model": "tiny", "prompt": "w1", "max_tokens": -1}, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {"model": "tiny", "prompt": "w1", "max_tokens": 10**9}, 400, "max_tokens"),
    ("prompt beyond the cache", "/v1/completions", {"model": "tiny", "prompt": [5] * MAX_LEN}, 413, "prompt"),
    ("empty prompt", "/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("token outside the vocabulary", "/v1/completions", {"model": "tiny", "prompt": [5, 10**6]}, 400, "prompt"),
    ("n = 0", "/v1/completions", {"model": "tiny", "prompt": "w1", "n": 0}, 400, "n"),
    ("n beyond the cap", "/v1/completions", {"model": "tiny", "prompt": "w1", "n": 1000}, 400, "n"),
    ("whitespace prompt", "/v1/completions", {"model": "tiny", "prompt": "   "}, 400, "prompt"),
    (
        "negative temperature",
        "/v1/completions",
        {"model": "tiny", "prompt": "w1", "temperature": -1},
        422,
        "temperature",
    ),
    ("top_p 0", "/v1/completions", {"model": "tiny", "prompt": "w1", "top_p": 0}, 422, "top_p"),
    ("empty stop string", "/v1/completions", {"model": "tiny", "prompt": "w1", "stop": [""]}, 400, "stop"),
    (
        "stop id outside",
        "/v1/completions",
        {"model": "tiny", "prompt": "w1", "stop_token_ids": [-1]},
        400,
        "stop_token_ids",
    ),
    ("empty messages", "/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    (
        "unknown role",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "x", "content": "w1"}]},
        422,
        None,
    ),
    ("unknown route", "/v1/embeddings", {"model": "tiny", "input": "w1"}, 404, None),
]


@pytest.mark.parametrize("what, path, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error(server, what, path, body, status, param):
    got, _, text = request(server, "POST", path, body)
    assert got == status, text
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "\n" not in error["message"]
    assert error["param"] == param or (param is None and status in (400, 404, 422))
    if param:
        assert param in error["message"]


def test_bad_input_through_the_openai_client(server):
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="other", prompt="w1", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(server).completions.create(model="tiny", prompt="w1", max_tokens=10**6)


# ---------------------------------------------------------------- disconnects and load


def _stream_then_hang_up(server, prompt, chunks=2) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 150, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < chunks:
        seen += resp.readline().startswith(b"data: ")
    conn.sock.shutdown(2)
    conn.close()


def _wait_idle(server, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric("peagle_slots_in_use") == 0 and server.metric("peagle_queue_length") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"slots still in use: {server.metric('peagle_slots_in_use')}")


def test_a_client_that_hangs_up_frees_its_slot(server, prompts, reference):
    _stream_then_hang_up(server, prompts[4])
    _wait_idle(server)
    # a non-streaming client too: its request is cancelled once the server sees it gone
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": "tiny", "prompt": prompts[4], "max_tokens": 180, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    time.sleep(0.3)
    conn.close()
    _wait_idle(server)
    assert words_to_ids(complete(server, prompts[4], 10, temperature=0).choices[0].text) == shown(reference[4][:10])


def test_load_run_200_requests_32_clients_ends_with_no_slot_in_use(server, prompts, reference):
    rng = random.Random(1)
    plan = [(rng.randrange(len(prompts) - 1), rng.randint(1, MAX_NEW), rng.random()) for _ in range(200)]

    def one(job):
        i, n, r = job
        if r < 0.1:
            _stream_then_hang_up(server, prompts[i], chunks=1)
            return None
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": n, "temperature": 0, "stream": r < 0.55}
        status, _, text = request(server, "POST", "/v1/completions", body)
        assert status == 200, text
        if body["stream"]:
            events = sse_events(text)
            assert events[-1] == "[DONE]"
            return words_to_ids("".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]))
        return words_to_ids(json.loads(text)["choices"][0]["text"])

    start = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, plan))
    seconds = time.perf_counter() - start
    wrong = [
        k for k, ((i, n, _), got) in enumerate(zip(plan, results)) if got is not None and got != shown(reference[i][:n])
    ]
    served = sum(got is not None for got in results)
    assert not wrong, wrong
    _wait_idle(server)
    tokens = sum(n for (_, n, _), got in zip(plan, results) if got is not None)
    print(
        f"load run: {served} served + {200 - served} hung up, 0 wrong, {tokens} tokens in {seconds:.1f}s, 0 slots in use"
    )


# ---------------------------------------------------------------- the command line


@pytest.mark.filterwarnings("ignore:k=40 exceeds the drafter's trained depth")
def test_bad_flags_and_folders_are_one_line(assets, tmp_path):
    root, _ = assets
    res = run_module("infer", ["serve", "--target", root / "target"])
    assert res.returncode == 2 and "--drafter" in res.stderr
    argv = ["serve", "--target", root / "target", "--drafter", root / "drafter", "--k", 40, "--deep-k", "warn"]
    res = run_module("infer", [*argv, "--max-len", 64])
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and last.startswith("error: --max-len 64"), res.stderr
    hf_tiny.build("llama-gqa2-tied-llama3", tmp_path / "bare")  # no tokenizer files
    res = run_module("infer", ["serve", "--target", tmp_path / "bare", "--drafter", root / "drafter"])
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and last.endswith("serving needs the target's tokenizer files beside its weights")


# ---------------------------------------------------------------- a full queue and a stop


def test_full_queue_is_503_and_sigterm_ends_streams_and_exits_0(assets, tmp_path):
    root, _ = assets
    argv = ["--target", root / "target", "--drafter", root / "drafter", "--k", K]
    argv += ["--max-batch", 1, "--max-len", 2048, "--max-queue", 1]
    proc = ServerProcess([str(a) for a in argv], tmp_path / "server.log", "tiny")
    streams = {}

    def stream(name):
        body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2000, "temperature": 0, "stream": True}
        streams[name] = request(proc, "POST", "/v1/completions", body)

    try:
        threads = [threading.Thread(target=stream, args=(n,)) for n in ("running", "waiting")]
        threads[0].start()
        while proc.metric("peagle_slots_in_use") < 1:
            time.sleep(0.05)
        threads[1].start()
        while proc.metric("peagle_queue_length") < 1:
            time.sleep(0.05)
        status, headers, text = request(proc, "POST", "/v1/completions", {"model": "tiny", "prompt": "w1"})
        assert status == 503 and headers.get("retry-after") == "1", text
        assert json.loads(text)["error"]["code"] == "queue_full"
        stopped = time.monotonic()
        assert proc.stop(signal.SIGTERM) == 0, proc.stderr()
        assert time.monotonic() - stopped < 15
        for t in threads:
            t.join(30)
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
    for name in ("running", "waiting"):
        status, _, text = streams[name]
        events = sse_events(text)
        assert status == 200 and events[-1] == "[DONE]", name
        # ended with an error event (OpenAI's finish reasons have no "abort")
        assert events[-2]["error"]["message"] == "the server is shutting down", name
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2] if e.get("choices")), name
    assert "Traceback" not in proc.stderr(), proc.stderr()
