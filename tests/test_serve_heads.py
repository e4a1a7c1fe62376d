"""Swapping the served head without a restart (`python -m infer serve --admin-key`), through the
real process: under 8 concurrent streams no request is dropped or changed (greedy output is the
target's, whoever drafts), no program compiles again, and a head of another network is refused."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from serve_support import ServerProcess, request, shown, sse_events, tiny_assets, words_to_ids

import peagle_jax as pj
from infer import SpeculativeDecoder

K, SLOTS, MAX_LEN, NEW = 2, 8, 256, 120
ADMIN = "sk-admin"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-heads")
    target = tiny_assets(root, max_position_embeddings=2048)
    pj.new_drafter(target, num_layers=1, mode="parallel", seed=7).save(root / "other")
    pj.new_drafter(target, num_layers=2, mode="parallel", seed=7).save(root / "deeper")
    return root, target


@pytest.fixture(scope="module")
def server(assets):
    root, _ = assets
    argv = ["--target", root / "target", "--drafter", root / "drafter", "--k", K, "--max-batch", SLOTS]
    argv += ["--max-len", MAX_LEN, "--admin-key", ADMIN]
    proc = ServerProcess([str(a) for a in argv], root / "server.log", "tiny", env={"JAX_LOG_COMPILES": "1"})
    yield proc
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
    prompts = [[5 + i, 6 + 2 * i, 7 + 3 * i] for i in range(8)]
    want = [SpeculativeDecoder(target, pj.load_drafter(root / "drafter"), k=K).generate([p], NEW).tokens[0] for p in prompts]
    first = head_card(server)
    got, errors = [None] * 8, []

    def stream(i):
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": NEW, "temperature": 0, "stream": True}
        status, _, text = request(server, "POST", "/v1/completions", body)
        events = sse_events(text)
        if status != 200 or events[-1] != "[DONE]":
            errors.append((i, status, text[-300:]))
        got[i] = words_to_ids("".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]))

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
    assert got == [shown(w) for w in want]  # lossless across the swap
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
