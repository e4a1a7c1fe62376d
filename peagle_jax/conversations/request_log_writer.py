"""The request log's writer (the format, the record and the reader: `request_log`): `RequestLog`
appends finished requests to the shard being written and renames it into place when it is done,
one writer process per folder. A crash loses at most the shard being written."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from peagle_jax.conversations.request_log import (
    FORMAT,
    INFO_FILE,
    LOCK_FILE,
    SHARD_NAME,
    VERSION,
    WRITING_NAME,
    Request,
    RequestLogError,
    is_request_log,
    read_info,
)

DEFAULT_SHARD_BYTES = 64 * 10**6
DEFAULT_SHARD_SECONDS = 600.0


def _fsync_folder(folder: Path) -> None:
    """The folder's entries (a rename) on disk; where a folder cannot be opened, as good as it gets."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _shard_name(begun: float, seq: int) -> str:
    return f"requests-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(begun))}-{seq:06d}.jsonl"


def _complete_lines(data: bytes) -> int:
    """The bytes of the leading lines of `data` that are whole records."""
    kept = 0
    for line in data.splitlines(keepends=True):
        try:
            if not line.endswith(b"\n"):
                break
            Request.from_json(json.loads(line.decode("utf-8")))
        except ValueError:
            break
        kept += len(line)
    return kept


class RequestLog:
    """Appends finished requests to the log in `folder` (made when missing): see the module
    docstring for the shards. `target`: the target's id (its folder name or Hub id), recorded
    in request-log.json; a folder that holds another target's log is refused, as is a record of
    another target. A shard is finished at the append that brings it to `max_shard_bytes` (an
    int or "64MB"), or at the first append `max_shard_seconds` after it was begun (None: no
    limit; `rotate` finishes it at any time). Errors of the disk (a full one) come out of `append` as OSError with the shard left as
    it was before the call: the caller may log them and go on.

        log = RequestLog("logs/requests", target="google/gemma-3-270m")
        log.append(request)   # a Request (or its JSON object)
        log.close()           # the last shard finished; also `with RequestLog(...) as log:`
    """

    def __init__(
        self,
        folder,
        max_shard_bytes: int | str = DEFAULT_SHARD_BYTES,
        *,
        target: str,
        max_shard_seconds: float | None = DEFAULT_SHARD_SECONDS,
    ):
        from peagle_jax.runtime.folders import parse_size

        self.folder = Path(folder).absolute()
        self.target = target
        self.max_shard_bytes = parse_size(max_shard_bytes)
        self.max_shard_seconds = max_shard_seconds
        self._lock = threading.Lock()
        self._fd: int | None = None  # the shard being written
        self._size, self._begun, self._opened = 0, 0.0, 0.0
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = self._take_folder()
        try:
            self._write_info()
            self._seq = self._next_seq()
            self._recover()
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _take_folder(self) -> int:
        fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RequestLogError(
                "another process writes this request log (one writer per folder)", self.folder
            ) from None
        return fd

    def _write_info(self) -> None:
        if is_request_log(self.folder):
            info = read_info(self.folder)
            if info["target"] != self.target:
                raise RequestLogError(
                    f"holds requests of the target {info['target']!r}, not {self.target!r}: give another folder",
                    self.folder,
                )
            return
        text = json.dumps({"format": FORMAT, "version": VERSION, "target": self.target, "created": time.time()})
        tmp = self.folder / f".{INFO_FILE}.tmp"
        self._write_durably(tmp, (text + "\n").encode())
        os.replace(tmp, self.folder / INFO_FILE)
        _fsync_folder(self.folder)

    @staticmethod
    def _write_durably(path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _next_seq(self) -> int:
        """One past the largest seq of the folder's shards, finished or left behind."""
        matches = (SHARD_NAME.match(p.name) or WRITING_NAME.match(p.name) for p in self.folder.iterdir())
        return max((int(m.group("seq")) for m in matches if m), default=0) + 1

    def _recover(self) -> None:
        """The complete records of shards a writer left behind (killed while writing) kept as
        finished shards; a leftover with none is removed."""
        for path in sorted(p for p in self.folder.iterdir() if WRITING_NAME.match(p.name)):
            kept = _complete_lines(path.read_bytes())
            if not kept:
                path.unlink()
                continue
            name = _shard_name(path.stat().st_mtime, self._seq)  # its last write: before the shards begun after
            with open(path, "r+b") as f:
                f.truncate(kept)
                os.fsync(f.fileno())
            os.replace(path, self.folder / name)
            self._seq += 1
        _fsync_folder(self.folder)

    # --- the writer's verbs
    def append(self, record: Request | Mapping) -> None:
        """One finished request appended (a JSON object is checked as `Request.from_json`)."""
        if not isinstance(record, Request):
            record = Request.from_json(record)
        if record.target != self.target:
            raise ValueError(f"a record of the target {record.target!r} in the log of {self.target!r}")
        line = (json.dumps(record.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._lock_fd is None:
                raise ValueError(f"{self.folder}: the request log is closed")
            if self._fd is None:
                self._open_shard()
            self._write(line)
            age = time.monotonic() - self._opened
            if self._size >= self.max_shard_bytes or (
                self.max_shard_seconds is not None and age >= self.max_shard_seconds
            ):
                self._finish()

    def rotate(self) -> None:
        """The shard being written finished now (when it holds a record): what a timer calls so
        that a quiet server's records become readable."""
        with self._lock:
            if self._fd is not None:
                self._finish()

    def close(self) -> None:
        """The last shard finished and the folder let go; appending after it is an error."""
        with self._lock:
            if self._fd is not None:
                self._finish()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> RequestLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the shard being written
    def _writing(self) -> Path:
        return self.folder / f".writing-{self._seq:06d}.jsonl"

    def _open_shard(self) -> None:
        self._fd = os.open(self._writing(), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        self._size, self._begun, self._opened = 0, time.time(), time.monotonic()

    def _write(self, line: bytes) -> None:
        """The whole line, or nothing: a failed write (a full disk) is cut off again; a shard
        that cannot be cut is left to the next writer's recovery (its complete lines kept)."""
        done = 0
        try:
            while done < len(line):
                done += os.write(self._fd, line[done:])
        except OSError:
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                self._leave_shard()
            raise
        self._size += len(line)

    def _leave_shard(self) -> None:
        """The shard being written let go as it is: the next one takes a new name."""
        fd, self._fd = self._fd, None
        self._seq += 1
        with contextlib.suppress(OSError):
            os.close(fd)

    def _finish(self) -> None:
        writing, name = self._writing(), self.folder / _shard_name(self._begun, self._seq)
        fd, self._fd = self._fd, None
        self._seq += 1  # the next shard takes a new name, whatever becomes of this one
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(writing, name)
        _fsync_folder(self.folder)
