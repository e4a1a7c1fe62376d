"""A server's request log: every finished request, one JSON line each, in a folder of shards.

A server writes it with `request_log_writer.RequestLog`, off its device loop; the trainer (`python -m train
--data.source DIR`) reads it with `read_requests`. The folder holds:

- `request-log.json`: {"format": "peagle-jax request log", "version": 1, "target", "created"};
- finished shards `requests-<UTC time the shard was begun>-<seq>.jsonl` (seq: 6 digits, counting
  on across writers), each line one `Request`;
- at most one shard being written, under a hidden name (`.writing-<seq>.jsonl`): readers never
  open it. It is renamed into place (after an fsync of the file, then of the folder) when it
  reaches `max_shard_bytes`, at the first append `max_shard_seconds` after it was begun, on
  `rotate()`, and on `close()`. A crash therefore loses at most the shard being written, never
  a finished one; the next writer on the folder keeps that shard's complete lines as a finished
  shard (`RequestLog` on open).

The records hold what users sent and what the target answered: the folder and its files are made
readable by the server's user only (0700 / 0600). One writer process per folder (an exclusive
lock on `.lock`); in that process `append`, `rotate` and `close` are thread-safe.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = [
    "FORMAT",
    "VERSION",
    "INFO_FILE",
    "SAMPLING_FIELDS",
    "RequestLogError",
    "Head",
    "Acceptance",
    "Request",
    "is_request_log",
    "read_info",
    "shard_files",
    "located_requests",
    "read_requests",
]

FORMAT = "peagle-jax request log"
VERSION = 1
INFO_FILE = "request-log.json"
LOCK_FILE = ".lock"
KINDS = ("chat", "completion")
# the SamplingParams fields that say how an answer was drawn (null: the server's default)
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
)
_WHOLE_SAMPLING = ("top_k", "seed", "max_tokens")
SHARD_NAME = re.compile(r"^requests-\d{8}T\d{6}Z-(?P<seq>\d{6,})\.jsonl$")
WRITING_NAME = re.compile(r"^\.writing-(?P<seq>\d{6,})\.jsonl$")


class RequestLogError(ValueError):
    """A request log that cannot be read or written. `file` and `line` (1-based) name a bad
    record's place when there is one; `reason` is the message without them."""

    def __init__(self, reason: str, file: Path | None = None, line: int | None = None):
        self.reason, self.file, self.line = reason, file, line
        where = "" if file is None else f"{file}: " if line is None else f"{file}: line {line}: "
        super().__init__(where + reason)


# ---------------------------------------------------------------------------------------
# the record
def _whole(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _ids(x) -> bool:
    return isinstance(x, list) and all(_whole(t) and t >= 0 for t in x)


@dataclasses.dataclass(frozen=True)
class Head:
    """The head that drafted the request: its name (a folder or Hub id) and a hash of its content."""

    name: str
    hash: str

    def __post_init__(self):
        if not isinstance(self.name, str) or not isinstance(self.hash, str):
            raise ValueError(f"field 'head': expected {{name: str, hash: str}}, got {self.name!r}, {self.hash!r}")


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """The request's speculative rounds: how many, how often each draft position was accepted
    (`accepted_per_pos[i]`: rounds whose draft i was accepted; K entries), new tokens per round."""

    rounds: int
    accepted_per_pos: list[int]
    tokens_per_round: float

    def __post_init__(self):
        if not _whole(self.rounds) or self.rounds < 0:
            raise ValueError(f"field 'acceptance.rounds': expected an integer >= 0, got {self.rounds!r}")
        if not _ids(self.accepted_per_pos):
            raise ValueError("field 'acceptance.accepted_per_pos': expected a list of integers >= 0")
        if not _number(self.tokens_per_round) or self.tokens_per_round < 0:
            raise ValueError(
                f"field 'acceptance.tokens_per_round': expected a number >= 0, got {self.tokens_per_round!r}"
            )


@dataclasses.dataclass(frozen=True)
class Request:
    """One finished request. `kind` "chat": `messages` is the conversation as sent ({role,
    content} strings) and `prompt` None; "completion": `prompt` is the prompt's text, or None when
    it was sent as token ids, and `messages` None. `prompt_ids`: what the target read;
    `completion` / `completion_ids`: what it answered. `time`: unix seconds when it finished;
    `seconds`: from its arrival to then. `head` and `acceptance` are None when no head drafted."""

    id: str
    time: float
    model: str
    target: str
    head: Head | None
    kind: str
    messages: list[dict] | None
    prompt: str | None
    prompt_ids: list[int]
    completion: str
    completion_ids: list[int]
    sampling: dict
    finish_reason: str
    acceptance: Acceptance | None
    seconds: float

    def __post_init__(self):
        problem = next(self._problems(), None)
        if problem is not None:
            raise ValueError(problem)

    def _problems(self):
        for name in ("id", "model", "target", "completion", "finish_reason"):
            if not isinstance(getattr(self, name), str):
                yield f"field {name!r}: expected a string, got {getattr(self, name)!r}"
        if not self.id or not self.target:
            yield f"field {'id' if not self.id else 'target'!r}: must not be empty"
        for name in ("time", "seconds"):
            if not _number(getattr(self, name)) or getattr(self, name) < 0:
                yield f"field {name!r}: expected a number >= 0, got {getattr(self, name)!r}"
        if self.kind not in KINDS:
            yield f"field 'kind': expected chat or completion, got {self.kind!r}"
        elif self.kind == "chat":
            yield from _chat_problems(self.messages, self.prompt)
        elif self.messages is not None or not (self.prompt is None or isinstance(self.prompt, str)):
            yield "a completion has a 'prompt' (its text, or null for token ids) and no 'messages'"
        for name in ("prompt_ids", "completion_ids"):
            if not _ids(getattr(self, name)):
                yield f"field {name!r}: expected a list of token ids (integers >= 0)"
        if not self.prompt_ids:
            yield "field 'prompt_ids': empty"
        yield from _sampling_problems(self.sampling)
        if self.head is not None and not isinstance(self.head, Head):
            yield "field 'head': expected {name, hash} or null"
        if self.acceptance is not None and not isinstance(self.acceptance, Acceptance):
            yield "field 'acceptance': expected {rounds, accepted_per_pos, tokens_per_round} or null"

    def conversation(self) -> list[dict] | None:
        """A chat request as a training conversation: its messages, then the target's answer as
        the assistant's turn; None for a completion."""
        if self.kind != "chat":
            return None
        return [*self.messages, {"role": "assistant", "content": self.completion}]

    def to_json(self) -> dict:
        """The record as its JSON line holds it."""
        out = dataclasses.asdict(self)
        if self.kind == "chat":
            del out["prompt"]
        else:
            del out["messages"]
        return out

    @classmethod
    def from_json(cls, obj) -> Request:
        """The record of a JSON line's object; ValueError naming the field that is wrong. Keys
        this version does not know are ignored."""
        if not isinstance(obj, Mapping):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        optional = {"messages": None, "prompt": None}  # one of them, by kind
        missing = [n for n in fields if n not in obj and n not in optional]
        if missing:
            raise ValueError(f"missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
        values = {n: obj.get(n, optional.get(n)) for n in fields}
        values["head"] = _part(Head, values["head"], "head")
        values["acceptance"] = _part(Acceptance, values["acceptance"], "acceptance")
        return cls(**values)


def _chat_problems(messages, prompt):
    if prompt is not None:
        yield "a chat has 'messages' and no 'prompt'"
    if not isinstance(messages, list) or not messages:
        yield "field 'messages': expected a non-empty list of {role, content}"
        return
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            yield f"field 'messages': message {i} is not {{role: str, content: str}}"


def _sampling_problems(sampling):
    if not isinstance(sampling, dict):
        yield "field 'sampling': expected an object of the sampling settings"
        return
    for name in SAMPLING_FIELDS:
        value = sampling.get(name)
        ok = value is None or (_whole(value) if name in _WHOLE_SAMPLING else _number(value))
        if not ok:
            yield f"field 'sampling.{name}': expected {'an integer' if name in _WHOLE_SAMPLING else 'a number'} or null, got {value!r}"


def _part(cls, value, name: str):
    """A nested record (Head, Acceptance) of its JSON object, None for null."""
    if value is None:
        return None
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(value, Mapping) or any(n not in value for n in names):
        raise ValueError(f"field {name!r}: expected {{{', '.join(names)}}} or null, got {value!r}")
    return cls(**{n: value[n] for n in names})


# ---------------------------------------------------------------------------------------
# reading
def is_request_log(path) -> bool:
    """`path` is a request log's folder (it holds request-log.json)."""
    try:
        return (Path(path) / INFO_FILE).is_file()
    except (OSError, ValueError):
        return False


def read_info(folder) -> dict:
    """The folder's request-log.json, checked: {"format", "version", "target", "created"}."""
    path = Path(folder) / INFO_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RequestLogError(f"no {INFO_FILE}: not a request log", Path(folder)) from None
    except (OSError, ValueError) as err:
        raise RequestLogError(f"cannot read it ({err})", path) from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise RequestLogError(f"key 'format' is not {FORMAT!r}", path)
    if info.get("version") != VERSION:
        raise RequestLogError(f"version {info.get('version')!r}: this build reads version {VERSION}", path)
    if not isinstance(info.get("target"), str) or not _number(info.get("created")):
        raise RequestLogError("expected a string 'target' and a number 'created'", path)
    return info


def shard_files(folder) -> list[Path]:
    """The finished shards of a log, in the order they were written (names sort by time, seq)."""
    return sorted(p for p in Path(folder).iterdir() if SHARD_NAME.match(p.name) and p.is_file())


def _shard_records(path: Path, on_error: Callable | None):
    """(line number, Request) of a finished shard; a bad line raises RequestLogError, or is
    handed to `on_error` and skipped."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                if not raw.endswith(b"\n"):
                    raise ValueError("cut short (no newline at its end)")
                yield n, Request.from_json(json.loads(raw.decode("utf-8")))
            except ValueError as err:  # JSONDecodeError, UnicodeDecodeError and the record's own
                bad = RequestLogError(str(err).splitlines()[0] if str(err) else type(err).__name__, path, n)
                if on_error is None:
                    raise bad from None
                on_error(bad)


def located_requests(folder, on_error: Callable[[RequestLogError], None] | None = None) -> list[tuple[str, Request]]:
    """("FILE: line N", Request) of every finished shard's records, in time order (a record's
    `time`; ties in the order written). The shard being written is never read. A malformed
    line is a RequestLogError naming the file and line, or, with `on_error`, handed to it and
    skipped."""
    read_info(folder)
    found = [(f"{p}: line {n}", r) for p in shard_files(folder) for n, r in _shard_records(p, on_error)]
    return sorted(found, key=lambda item: item[1].time)  # stable: equal times keep the written order


def read_requests(folder, on_error: Callable[[RequestLogError], None] | None = None) -> list[Request]:
    """Every finished request of the log, in time order (`located_requests`)."""
    return [r for _, r in located_requests(folder, on_error)]


# ---------------------------------------------------------------------------------------
# writing
