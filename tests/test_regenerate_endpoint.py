"""`--data.regenerate` at scale: through a served target (`--data.regenerate_endpoint`) and in
process (`--data.regenerate_batch`, length-sorted batches, rows over the mesh).

The server is a real HTTP server on 127.0.0.1 (`tests/openai_loopback.py`, a thread) answering the
OpenAI protocol with the project's own engine on the tiny target. Its answers must be the in-process
ones, token for token; its faults (500s, a timeout, death mid-run, nobody listening) are retried,
then one line naming the endpoint and the row, with every answer received kept in the cache and a
rerun asking only for the rest."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xla_env
from in_process import run_module
from limits import HANG_S
from openai_loopback import Faults, LoopbackServer

from peagle_jax.runtime.command_line import UsageError
from train.flags import parse_args
from train.regenerate import Endpoint, EndpointError, regenerate
from train.regenerate_endpoint import base_url

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 6
N = 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from train.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="module")
def target(folder):
    import peagle_jax as pj

    return pj.load_target(folder, dtype="float32")


@pytest.fixture(scope="module")
def records():
    from train.data import synthetic_conversations

    return [(f"row {i}", {"messages": c}) for i, c in enumerate(synthetic_conversations(N, seed=3))]


@pytest.fixture(scope="module")
def reference(target, records, tmp_path_factory):
    """(answers, generated ids by conversation) in process, 3 conversations a batch."""
    cache = tmp_path_factory.mktemp("reference") / "regenerated.jsonl"
    answers = regenerate(records, target, cache, MAX_NEW, batch=3)
    return answers, _lines(cache)


def _lines(cache: Path) -> dict[int, dict]:
    return {rec["i"]: rec for rec in map(json.loads, cache.read_text().splitlines())}


def _through(server, target, records, cache, **settings):
    ep = Endpoint(server.url, **{"concurrency": 4, "backoff": 0.0, **settings})
    return regenerate(records, target, cache, MAX_NEW, endpoint=ep)


@pytest.mark.parametrize("api, token_ids", [("completions", True), ("completions", False), ("chat", True)])
def test_endpoint_answers_equal_the_in_process_ones(api, token_ids, target, records, reference, tmp_path):
    answers, lines = reference
    assert len(answers) == N and all(len(rec["ids"]) >= 1 for rec in lines.values())
    with LoopbackServer(target, Faults(token_ids=token_ids)) as server:
        got = _through(server, target, records, tmp_path / "c.jsonl", api=api)
    assert got == answers
    mine = _lines(tmp_path / "c.jsonl")
    if token_ids:  # the server's own tokens: the in-process ones
        assert {i: rec["ids"] for i, rec in mine.items()} == {i: rec["ids"] for i, rec in lines.items()}
    else:  # text only: kept as the server wrote it, re-tokenised to check it
        assert all("ids" not in rec for rec in mine.values())
    assert server.posts == server.answered == N


def test_a_server_answering_500_is_retried(target, records, reference, tmp_path, capsys):
    with LoopbackServer(target, Faults(fail_first=3)) as server:
        ep = Endpoint(server.url, concurrency=2, retries=3, backoff=0.0)
        got = regenerate(records, target, tmp_path / "c.jsonl", MAX_NEW, endpoint=ep, progress=True)
    assert got == reference[0]
    assert (server.failed, server.answered, server.posts) == (3, N, N + 3)
    assert "conv/s" in capsys.readouterr().err  # the progress bar's rate


def _assert_one_line(err: EndpointError, server, records) -> str:
    msg = str(err)
    assert "\n" not in msg and msg.startswith(f"regeneration through {server.url}: "), msg
    assert any(f"{where} (conversation {i})" in msg for i, (where, _) in enumerate(records)), msg
    return msg


@pytest.mark.parametrize(
    "faults, cause",
    [(Faults(fail_always=True), "HTTP 500"), (Faults(hold=60), "timed out")],
    ids=["always-500", "timeout"],
)
def test_a_server_that_keeps_failing_is_one_line_and_the_cache_is_kept(
    faults, cause, target, records, reference, tmp_path
):
    cache = tmp_path / "c.jsonl"
    with LoopbackServer(target) as server:  # a first run that answered 3 conversations
        _through(server, target, records[:3], cache)
    before = cache.read_text()
    with LoopbackServer(target, faults) as server, pytest.raises(EndpointError) as err:
        _through(server, target, records, cache, retries=2, timeout=0.2)  # the held server never answers in time
    msg = _assert_one_line(err.value, server, records)
    assert cause in msg and "after 3 tries" in msg and f"3 of {N} answers are in {cache}" in msg, msg
    assert cache.read_text() == before
    with LoopbackServer(target) as server:  # the rerun asks only for the rest
        assert _through(server, target, records, cache) == reference[0]
    assert server.posts == N - 3


def test_a_server_that_dies_mid_run_is_one_line_and_the_run_resumes(target, records, reference, tmp_path):
    cache = tmp_path / "c.jsonl"
    with LoopbackServer(target, Faults(die_after=4)) as server, pytest.raises(EndpointError) as err:
        _through(server, target, records, cache, concurrency=2, retries=2)
    msg = _assert_one_line(err.value, server, records)
    assert "connection failed" in msg and f"4 of {N} answers are in" in msg, msg
    kept = _lines(cache)
    assert len(kept) == 4 and all(rec["ids"] == reference[1][i]["ids"] for i, rec in kept.items())
    with LoopbackServer(target) as server:
        assert _through(server, target, records, cache) == reference[0]
    assert server.posts == N - 4
    assert len(cache.read_text().splitlines()) == N


def test_a_refused_request_is_not_retried_and_the_answers_in_flight_are_kept(target, records, tmp_path):
    cache = tmp_path / "c.jsonl"
    with LoopbackServer(target, Faults(refuse_first=1)) as server, pytest.raises(EndpointError) as err:
        _through(server, target, records, cache, retries=3)
    msg = _assert_one_line(err.value, server, records)
    assert "HTTP 400 Bad Request" in msg and "bad request (on purpose)" in msg and "tries" not in msg, msg
    assert server.posts == server.answered + 1  # the 400 once, never again
    assert len(_lines(cache)) == server.answered >= 1  # every answer given, also after the failure


def test_an_endpoint_nobody_serves_is_one_line(target, records, tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago, now closed
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(EndpointError) as err:
        regenerate(
            records,
            target,
            tmp_path / "c.jsonl",
            MAX_NEW,
            endpoint=Endpoint(url, retries=1, backoff=0.0),
        )
    msg = str(err.value)
    assert "\n" not in msg and f"regeneration through {url}: GET {url}/models: connection failed" in msg, msg
    assert "after 2 tries" in msg and msg.endswith("; no answer was regenerated"), msg


def test_endpoint_urls_are_read_as_their_api_root():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1/", "http://h:8000/v1/completions"):
        assert base_url(url) == "http://h:8000/v1", url
    assert base_url("https://h/openai/v1/chat/completions") == "https://h/openai/v1"


@pytest.mark.parametrize(
    "argv, want",
    [
        (
            ["--data.regenerate", "true", "--data.regenerate_endpoint", "ftp://h/v1"],
            "must be an http:// or https:// URL",
        ),
        (["--data.regenerate", "true", "--data.regenerate_endpoint", "http://h:port/v1"], "must be an http://"),
        (["--data.regenerate_endpoint", "http://h:8000/v1"], "data.regenerate is false"),
        (["--data.regenerate_api", "responses"], "data.regenerate_api must be completions or chat"),
        (["--data.regenerate_concurrency", "0"], "data.regenerate_concurrency must lie in [1, 1024]"),
        (["--data.regenerate_timeout", "inf"], "data.regenerate_timeout must be a finite number"),
        (["--data.regenerate_retries", "-1"], "data.regenerate_retries must be >= 0"),
        (["--data.regenerate_batch", "0"], "data.regenerate_batch must be >= 1"),
    ],
)
def test_regeneration_flags_no_run_can_use_are_refused(argv, want):
    with pytest.raises(UsageError) as err:
        parse_args(argv)
    assert want in str(err.value)


def test_a_resume_may_change_how_answers_are_regenerated(tmp_path):
    from train import config as C
    from train.loop import check_resume
    from train.trainer import TrainError

    saved = C.to_dict(parse_args(["--data.regenerate", "true"]))
    for k in C.REGENERATION_TRANSPORT:  # a run saved before these flags existed
        saved["data"].pop(k)
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    url = ["--data.regenerate_endpoint", "http://h:8000/v1", "--data.regenerate_concurrency", "8"]
    check_resume(tmp_path, parse_args(["--data.regenerate", "true", *url, "--data.regenerate_batch", "64"]))
    with pytest.raises(TrainError, match="data.regenerate_tokens"):  # what the answers are still counts
        check_resume(tmp_path, parse_args(["--data.regenerate", "true", "--data.regenerate_tokens", "64"]))


# ---------------------------------------------------------------------------------------
# the command line: one error line, OUT kept, the rerun resumes; an interrupt while requests wait
def _flags(folder, out, url, *extra) -> list[str]:
    return [
        "--preset", "tiny", "--model.target", str(folder), "--out", str(out),
        "--data.max_conversations", "12", "--data.heldout", "2", "--data.regenerate", "true",
        "--data.regenerate_tokens", str(MAX_NEW), "--data.prepare_only", "true", "--loop.progress", "false",
        "--data.regenerate_endpoint", url, "--data.regenerate_concurrency", "2", *extra,
    ]  # fmt: skip


def test_the_command_line_reports_a_dead_server_in_one_line_and_resumes(folder, target, tmp_path):
    out = tmp_path / "run"
    with LoopbackServer(target, Faults(die_after=5)) as server:
        proc = run_module("train", _flags(folder, out, server.url, "--data.regenerate_retries", "1"))
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"regeneration through {server.url}: synthetic row" in errors[0], errors[0]
    assert "holds regenerated answers a rerun with the same --out reuses" in errors[0], errors[0]
    assert len((out / "regenerated.jsonl").read_text().splitlines()) == 5
    with LoopbackServer(target) as server:
        proc = run_module("train", _flags(folder, out, server.url))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert server.posts == 12 - 5
    assert json.loads((out / "summary.json").read_text())["prepared_only"] is True


def test_a_server_dead_from_the_start_says_nothing_was_kept(folder, target, tmp_path):
    """No answer came: the line says so and that OUT, which the run made, is gone (no resume)."""
    out = tmp_path / "run"
    with LoopbackServer(target, Faults(die_after=0)) as server:
        proc = run_module("train", _flags(folder, out, server.url, "--data.regenerate_retries", "0"))
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert "no answer was regenerated" in errors[0] and f"removed {out}, which this run made" in errors[0], errors[0]
    assert "rerun to resume" not in errors[0] and "answers are in" not in errors[0], errors[0]
    assert not out.exists()


def _count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_an_interrupt_while_requests_wait_ends_the_run_and_keeps_the_cache(folder, target, tmp_path):
    out, cache = tmp_path / "run", tmp_path / "run" / "regenerated.jsonl"
    with LoopbackServer(target, Faults(hold=HANG_S, hold_after=3)) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "train", *_flags(folder, out, server.url)],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        while proc.poll() is None and not (server.posts > 3 and _count(cache) == 3):  # 3 answers in, the rest held
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in err, err[-3000:]
    assert len((out / "regenerated.jsonl").read_text().splitlines()) == 3


def test_in_process_regeneration_splits_its_batch_over_the_mesh(folder, tmp_path):
    got = xla_env.run_program(ROOT / "tests" / "programs" / "regenerate_mesh.py", folder, tmp_path, devices=4)
    assert got == {"same": True, "answered": N, "row_shards": 4}
