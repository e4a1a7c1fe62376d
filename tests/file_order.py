"""The longest test files first: `make test` runs one file per worker at a time (--dist loadfile),
in the order files are collected, so a long file collected last (the alphabet puts the trainer's
end-to-end files there) would run alone at the end while the other workers sit idle. Each file's
seconds in the last run are kept beside the suite's compilation cache; files not seen yet go
first, then the rest by decreasing time (longest processing time first)."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import xla_env


def record_path() -> Path:
    return xla_env.cache_folder().parent / "test-file-seconds.json"


def read() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(record_path().read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """`items` with whole files reordered (the order inside a file is kept)."""
    return sorted(items, key=lambda item: -seconds.get(item.nodeid.split("::")[0], float("inf")))


class FileSeconds:
    """Sums the reported durations per file (the xdist controller sees every worker's reports)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, report) -> None:
        self.seconds[report.nodeid.split("::")[0]] += report.duration

    def save(self) -> None:
        if not self.seconds:
            return
        merged = {**read(), **self.seconds}  # files this run left out keep their last time
        path = record_path()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(merged, indent=0, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
