"""The server side of learning from traffic, through the real process (`python -m infer serve
--admin-key --log-requests`): swapping the served head without a restart (under 8 concurrent
streams no request is dropped or changed: greedy output is the target's, whoever drafts; no
program compiles again; a head of another network is refused), and the request log (what was
answered, with its acceptance; finished shards intact through a kill -9; a trainer run on it)."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from in_process import run_module
from serve_support import ServerProcess, request, sse_events

import peagle_jax as pj
from infer import SpeculativeDecoder
from peagle_jax.conversations.request_log import read_requests, shard_files
from train.tiny import build_tiny_target

K, SLOTS, MAX_LEN, NEW = 2, 8, 256, 120
ADMIN = "sk-admin"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The trainer's tiny preset target (4 layers, a word tokenizer over w0..w55: what
    `python -m train --preset tiny` trains a head for) and three heads for it."""
    root = tmp_path_factory.mktemp("serve-online")
    target = pj.load_target(build_tiny_target(root / "target"), dtype="float32")
    pj.new_drafter(target, num_layers=1, mode="parallel", seed=1).save(root / "drafter")
    pj.new_drafter(target, num_layers=1, mode="parallel", seed=7).save(root / "other")
    pj.new_drafter(target, num_layers=2, mode="parallel", seed=7).save(root / "deeper")
    return root, target


@pytest.fixture(scope="module")
def server(assets):
    root, _ = assets
    argv = ["--target", root / "target", "--drafter", root / "drafter", "--k", K, "--max-batch", SLOTS]
    argv += ["--max-len", MAX_LEN, "--admin-key", ADMIN, "--log-requests", root / "log", "--log-shard-bytes", "4KB"]
    proc = ServerProcess([str(a) for a in argv], root / "server.log", "tiny", env={"JAX_LOG_COMPILES": "1"})
    yield proc
    if proc.proc.poll() is None:  # the last test kills it (-9)
        assert proc.stop() == 0, proc.stderr()
    assert "Traceback" not in proc.stderr(), proc.stderr()


def swap(server, path, key=ADMIN):
    return request(server, "POST", "/v1/admin/head", {"path": str(path)}, headers={"Authorization": f"Bearer {key}"})


def head_card(server) -> dict:
    return json.loads(request(server, "GET", "/v1/models")[2])["data"][0]["head"]


def compiles(server) -> int:
    return server.stderr().count("Finished XLA compilation")


def test_a_head_swapped_under_8_streams_drops_and_changes_nothing(server, assets):
    root, target = assets
    prompts = [[9 + i, 10 + 2 * i, 11 + 3 * i] for i in range(8)]
    dec = SpeculativeDecoder(target, pj.load_drafter(root / "drafter"), k=K)
    want = [dec.generate([p], NEW, ignore_eos=True).texts[0] for p in prompts]
    first = head_card(server)
    got, errors = [None] * 8, []

    def stream(i):
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": NEW, "temperature": 0, "stream": True}
        status, _, text = request(server, "POST", "/v1/completions", body | {"ignore_eos": True})
        events = sse_events(text)
        if status != 200 or events[-1] != "[DONE]":
            errors.append((i, status, text[-300:]))
        got[i] = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every stream admitted and decoding
    before = compiles(server)
    status, _, text = swap(server, root / "other")
    for t in threads:
        t.join()
    assert status == 200, text
    answer = json.loads(text)
    assert answer["previous"] == first and answer["head"]["name"] == "other"
    assert answer["head"]["fingerprint"] == pj.load_drafter(root / "other").fingerprint() != first["fingerprint"]
    assert not errors, errors
    assert got == want  # lossless across the swap
    assert compiles(server) == before  # the same programs run the new head
    assert head_card(server) == answer["head"]
    assert server.metric(f'peagle_head_info{{fingerprint="{answer["head"]["fingerprint"]}",head="other"}}') == 1


def test_a_head_of_another_network_is_refused_by_name(server, assets):
    root, _ = assets
    served = head_card(server)
    status, _, text = swap(server, root / "deeper")
    assert status == 400 and "num_layers 1 -> 2" in json.loads(text)["error"]["message"]
    assert head_card(server) == served
    assert swap(server, root / "nowhere")[0] == 400


def test_the_admin_route_needs_its_key(server, assets):
    root, _ = assets
    assert swap(server, root / "other", key="wrong")[0] == 401
    assert request(server, "POST", "/v1/admin/head", {"path": str(root / "other")})[0] == 401


def test_sighup_reads_the_drafter_again(server, assets):
    root, _ = assets
    assert swap(server, root / "other")[0] == 200
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while head_card(server)["name"] != "drafter" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert head_card(server)["name"] == "drafter"  # --drafter again


def test_the_request_log_holds_what_was_answered_and_survives_a_kill(server, assets, tmp_path):
    """Every answered choice is a record (prompt as sent, its ids, the completion's text and ids,
    the sampling settings, the head and its acceptance); a kill -9 leaves every finished shard
    whole; `python -m train` trains on the log."""
    root, target = assets
    answers = {}
    for i in range(12):
        prompt = f"w{5 + i} w{6 + i} w7"
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "seed": i, "ignore_eos": True}
        answers[prompt] = json.loads(request(server, "POST", "/v1/completions", body)[2])["choices"][0]["text"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w9 w8"}], "max_tokens": 20, "temperature": 0}
    chat_text = json.loads(request(server, "POST", "/v1/chat/completions", chat)[2])["choices"][0]["message"]["content"]
    time.sleep(1.0)  # the writer thread has appended them
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(30)
    records = read_requests(root / "log")
    mine = [r for r in records if r.kind == "chat" or r.prompt in answers]  # the other tests' requests are in too
    assert len(shard_files(root / "log")) >= 2 and 0 < len(mine) <= 13  # a kill loses the shard being written
    for rec in mine:
        if rec.kind == "completion":
            assert rec.completion == answers[rec.prompt]
            assert rec.completion == target.tokenizer.decode(rec.completion_ids, skip_special_tokens=True)
            assert rec.sampling["temperature"] == 0 and rec.finish_reason == "length"
        else:
            assert rec.messages == chat["messages"] and rec.completion == chat_text
        assert rec.target == "target" and rec.head is not None and rec.acceptance.rounds >= 1
        assert len(rec.acceptance.accepted_per_pos) == K
    out = tmp_path / "run"
    argv = ["--preset", "tiny", "--model.target", str(root / "target"), "--data.source", str(root / "log")]
    argv += ["--out", str(out), "--model.init_head", str(root / "drafter"), "--loop.steps", "2"]
    argv += ["--data.heldout", "1", "--eval.enabled", "false", "--loop.progress", "false"]
    res = run_module("train", argv)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["data"]["request_log"]["regenerated"] is False
