"""What every part of the report shares: the heads, the prompt sets, the log line."""

from __future__ import annotations

import sys

HEADS = {"parallel": "P-EAGLE", "chain": "EAGLE-3"}  # trainer mode -> label in the report
PROMPT_SETS = ("mtbench", "humaneval")


def log(message: str) -> None:
    print(f"[report] {message}", file=sys.stderr, flush=True)
