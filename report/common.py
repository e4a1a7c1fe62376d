"""What every part of the report shares: the heads, the prompt sets, the log line."""

from __future__ import annotations

import sys

# trainer mode -> label in the report; this order is the column order of every table
HEADS = {"parallel": "P-EAGLE", "chain": "EAGLE-3", "dflash": "DFlash"}
SHORT = {"P-EAGLE": "P", "EAGLE-3": "E", "DFlash": "D"}  # a head in the headers of ratio columns
# the ratio columns, (numerator, denominator): P-EAGLE over EAGLE-3, DFlash over P-EAGLE (the two one-pass heads)
RATIOS = (("P-EAGLE", "EAGLE-3"), ("DFlash", "P-EAGLE"))
PROMPT_SETS = ("mtbench", "humaneval")


def dflash_block_size(ks: list[int]) -> int:
    """DFlash drafts block_size - 1 tokens a pass: one block serves every K of the report."""
    return max(ks) + 1


def heads_in(results: dict) -> list[str]:
    """The heads a results dict holds, in column order (a two-head run predates DFlash)."""
    return [label for label in HEADS.values() if label in results["training"]]


def ratios_for(heads: list[str]) -> list[tuple[str, str]]:
    """The ratio columns whose two heads are both there."""
    return [(a, b) for a, b in RATIOS if a in heads and b in heads]


def ratio_name(pair: tuple[str, str]) -> str:
    return f"{SHORT[pair[0]]}/{SHORT[pair[1]]}"


def short_names(heads: list[str]) -> str:
    """'P / E / D': the heads of a cell that lists one value per head."""
    return " / ".join(SHORT[h] for h in heads)


def log(message: str) -> None:
    print(f"[report] {message}", file=sys.stderr, flush=True)
