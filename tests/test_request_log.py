"""The request log's format (`peagle_jax.conversations.request_log`): records checked field by field, the
writer's shards read back in time order, malformed lines named by file and line, the shard being
written never read, and what a writer killed with SIGKILL or stopped by a full disk leaves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from limits import HANG_S

from peagle_jax.conversations.request_log import (
    INFO_FILE,
    Acceptance,
    Head,
    Request,
    RequestLogError,
    read_info,
    read_requests,
    shard_files,
)
from peagle_jax.conversations.request_log_writer import RequestLog

ROOT = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000.0


def chat(i: int, t: float | None = None, **kw) -> Request:
    fields = dict(
        id=f"chat-{i}",
        time=T0 + i if t is None else t,
        model="served",
        target="org/target",
        head=Head("heads/a", "ab" * 8),
        kind="chat",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {i} é"}],
        prompt=None,
        prompt_ids=[2, 10 + i, 11],
        completion=f"answer {i}",
        completion_ids=[20 + i, 1],
        sampling={"temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 5, "max_tokens": 64},
        finish_reason="stop",
        acceptance=Acceptance(rounds=2, accepted_per_pos=[2, 1, 0], tokens_per_round=1.5),
        seconds=0.25,
    )
    return Request(**{**fields, **kw})


def completion(i: int, prompt: str | None = "once upon", **kw) -> Request:
    base = chat(i, kind="completion", messages=None, prompt=prompt, head=None, acceptance=None)
    return Request(**{**base.__dict__, "id": f"completion-{i}", **kw})


def write_log(folder: Path, records, **kw) -> None:
    with RequestLog(folder, kw.pop("max_shard_bytes", 10**6), target="org/target", **kw) as log:
        for r in records:
            log.append(r)


# ---------------------------------------------------------------------------------------
# records
def test_a_record_round_trips_through_its_json_line():
    for rec in (chat(1), completion(2), completion(3, prompt=None)):
        line = json.dumps(rec.to_json())
        assert Request.from_json(json.loads(line)) == rec
    assert "prompt" not in chat(1).to_json() and "messages" not in completion(2).to_json()
    assert chat(1).conversation()[-1] == {"role": "assistant", "content": "answer 1"}
    assert completion(2).conversation() is None


@pytest.mark.parametrize(
    "change,field",
    [
        ({"time": -1}, "'time'"),
        ({"time": float("nan")}, "'time'"),
        ({"kind": "embedding"}, "'kind'"),
        ({"messages": []}, "'messages'"),
        ({"messages": [{"role": "user", "content": 3}]}, "message 0"),
        ({"prompt_ids": [1, -2]}, "'prompt_ids'"),
        ({"completion_ids": [1.5]}, "'completion_ids'"),
        ({"sampling": {"temperature": "hot"}}, "'sampling.temperature'"),
        ({"sampling": {"top_k": 0.5}}, "'sampling.top_k'"),
        ({"acceptance": {"rounds": 1, "accepted_per_pos": [1], "tokens_per_round": -1}}, "tokens_per_round"),
        ({"head": {"name": "h"}}, "'head'"),
        ({"id": ""}, "'id'"),
    ],
)
def test_a_bad_field_is_named(change, field):
    obj = {**chat(1).to_json(), **change}
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        Request.from_json(obj)


def test_a_missing_field_and_a_kind_with_the_other_kinds_prompt_are_refused():
    obj = chat(1).to_json()
    del obj["finish_reason"]
    with pytest.raises(ValueError, match="missing field 'finish_reason'"):
        Request.from_json(obj)
    with pytest.raises(ValueError, match="a chat has 'messages' and no 'prompt'"):
        Request.from_json({**chat(1).to_json(), "prompt": "text"})
    with pytest.raises(ValueError, match="no 'messages'"):
        Request.from_json({**completion(1).to_json(), "messages": [{"role": "user", "content": "x"}]})


# ---------------------------------------------------------------------------------------
# the writer and the reader
def test_shards_rotate_at_their_bound_and_read_back_in_time_order(tmp_path):
    records = [chat(i) for i in range(12)] + [completion(12), completion(13, prompt=None)]
    late_first = [records[5], *records[:5], *records[6:]]  # appended out of time order
    write_log(tmp_path, late_first, max_shard_bytes=1200)
    shards = shard_files(tmp_path)
    assert len(shards) > 3, shards
    assert all(p.stat().st_size < 1200 + 1000 for p in shards)  # finished once over the bound
    assert [p.name.split("-")[-1] for p in shards] == [f"{i:06d}.jsonl" for i in range(1, len(shards) + 1)]
    assert read_requests(tmp_path) == records  # every record, in time order
    info = read_info(tmp_path)
    assert info["target"] == "org/target" and info["version"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".writing")]


def test_the_log_is_private_and_one_writers(tmp_path):
    folder = tmp_path / "log"
    with RequestLog(folder, target="org/target") as log:
        log.append(chat(0))
        with pytest.raises(RequestLogError, match="another process writes this request log"):
            RequestLog(folder, target="org/target")  # a second writer (a lock per open file)
        with pytest.raises(ValueError, match="a record of the target 'other'"):
            log.append(chat(1, target="other"))
    assert folder.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in shard_files(folder)} == {0o600}
    with pytest.raises(RequestLogError, match="holds requests of the target 'org/target', not 'other'"):
        RequestLog(folder, target="other")
    with pytest.raises(ValueError, match="closed"):
        log.append(chat(2))
    write_log(folder, [chat(3)])  # the next writer appends beside the finished shards
    assert [r.id for r in read_requests(folder)] == ["chat-0", "chat-3"]


def test_a_shard_is_finished_when_its_first_record_is_old_or_on_rotate(tmp_path):
    with RequestLog(tmp_path, target="org/target", max_shard_seconds=0.0) as log:
        log.append(chat(0))  # as old as allowed at once: finished
        assert len(shard_files(tmp_path)) == 1
    with RequestLog(tmp_path, target="org/target", max_shard_seconds=None) as log:
        log.append(chat(1))
        log.append(chat(2))
        assert len(shard_files(tmp_path)) == 1  # the second shard is still being written
        log.rotate()
        assert [r.id for r in read_requests(tmp_path)] == ["chat-0", "chat-1", "chat-2"]
        log.rotate()  # nothing being written: nothing to do
    assert len(shard_files(tmp_path)) == 2


def test_a_malformed_line_is_named_by_file_and_line(tmp_path):
    write_log(tmp_path, [chat(0), chat(1)])
    shard = shard_files(tmp_path)[0]
    lines = shard.read_text().splitlines(keepends=True)
    shard.write_text(lines[0] + '{"id": "cut"\n' + lines[1] + json.dumps({**chat(2).to_json(), "seconds": -3}) + "\n")
    with pytest.raises(RequestLogError) as err:
        read_requests(tmp_path)
    assert str(err.value).startswith(f"{shard}: line 2: ") and err.value.line == 2
    bad = []
    assert [r.id for r in read_requests(tmp_path, on_error=bad.append)] == ["chat-0", "chat-1"]
    assert [(e.file, e.line) for e in bad] == [(shard, 2), (shard, 4)]
    assert "'seconds'" in bad[1].reason
    (tmp_path / INFO_FILE).unlink()
    with pytest.raises(RequestLogError, match="not a request log"):
        read_requests(tmp_path)


def test_the_shard_being_written_is_ignored_and_its_complete_lines_kept_by_the_next_writer(tmp_path):
    write_log(tmp_path, [chat(0)])
    line = json.dumps(chat(1).to_json()) + "\n"
    (tmp_path / ".writing-000002.jsonl").write_text(line + line[:40])  # a writer's shard, its last line cut
    assert [r.id for r in read_requests(tmp_path)] == ["chat-0"]
    with RequestLog(tmp_path, target="org/target") as log:  # the next writer on the folder
        assert [r.id for r in read_requests(tmp_path)] == ["chat-0", "chat-1"]
        log.append(chat(2))
    assert [r.id for r in read_requests(tmp_path)] == ["chat-0", "chat-1", "chat-2"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".writing")]


WRITER = textwrap.dedent(
    """
    import sys
    from test_request_log import chat
    from peagle_jax.conversations.request_log_writer import RequestLog

    log = RequestLog(sys.argv[1], 2000, target="org/target", max_shard_seconds=None)
    i = 0
    while True:
        log.append(chat(i))
        i += 1
        if i == 40:
            print("going", flush=True)
    """
)


def test_a_writer_killed_mid_write_loses_only_the_shard_being_written(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "going"
        deadline = time.monotonic() + HANG_S
        while len(shard_files(tmp_path)) < 30 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=HANG_S)
    assert child.returncode == -signal.SIGKILL
    finished = read_requests(tmp_path)  # every finished shard whole, the one being written left out
    assert [r.id for r in finished] == [f"chat-{i}" for i in range(len(finished))]
    assert finished == [chat(i) for i in range(len(finished))]
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".writing-")]
    assert len(partial) <= 1
    with RequestLog(tmp_path, target="org/target"):  # a restarted server keeps what the killed one had written
        recovered = read_requests(tmp_path)
    assert len(recovered) >= len(finished)
    assert [r.id for r in recovered] == [f"chat-{i}" for i in range(len(recovered))]


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from test_request_log import chat
    from peagle_jax.conversations.request_log_writer import RequestLog

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    log = RequestLog(sys.argv[1], 10**6, target="org/target")
    resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500))  # no file may pass 1500 bytes: a full disk
    failed = 0
    for i in range(8):
        try:
            log.append(chat(i))
        except OSError:
            failed += 1
    log.close()
    print(failed)
    """
)


def test_a_full_disk_fails_the_append_and_leaves_the_shard_whole(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True, env=env, timeout=HANG_S
    )
    assert proc.returncode == 0, proc.stderr
    failed = int(proc.stdout)
    kept = read_requests(tmp_path)  # the line cut by the limit was taken back: every line whole
    assert failed >= 1 and len(kept) + failed == 8
    assert kept == [chat(i) for i in range(len(kept))]
