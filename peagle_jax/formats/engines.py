"""Where a head can be served: which engine and which of its releases serves each head kind, the
refusal each release gives, and the lines printed for a head (`serve_lines`: the trainer, the
converter and the lint print the same).

Read from vLLM's released wheels (0.33.0 and 0.34.0, whose own config and loading code
tests/test_vllm_oracle.py runs on this project's exports):
- vLLM 0.16-0.33 serves P-EAGLE heads in both formats (`"method": "eagle3"` with
  `"parallel_drafting": true`; a speculators `peagle` config turns parallel drafting on itself),
  EAGLE-3 heads and DFlash heads (`"method": "dflash"`).
- vLLM 0.34 removed the V1 model runner and P-EAGLE with it: `parallel_drafting` with eagle3
  is refused (`vllm/config/speculative.py`), a speculators `peagle` config is refused
  (`update_peagle`), and a vLLM-native P-EAGLE folder served as plain eagle3 loads with
  `mask_hidden` skipped and drafts one token at a time (EAGLE-3). EAGLE-3 and DFlash are served.
- Every release to date translates a speculators DFlash head's `sliding_window_non_causal`
  into `dflash_config.causal` for every layer (`dflash_causality`; vLLM PR #56692 is open).
- This project's engine (`SpeculativeDecoder`, `python -m infer`) serves every kind, from our
  checkpoint or either exported format.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import NamedTuple

__all__ = [
    "FIRST_PARALLEL",
    "HEAD_KINDS",
    "NEWEST_VLLM",
    "PEAGLE_VLLM_REQUIREMENT",
    "VLLM_RELEASES",
    "VllmRelease",
    "installed_vllm",
    "parse_vllm_version",
    "serving_vllm",
    "version_text",
    "vllm_refusal",
]

HEAD_KINDS = {"parallel": "P-EAGLE", "chain": "EAGLE-3", "dflash": "DFlash"}
FIRST_PARALLEL = (0, 16)  # the first vLLM release with parallel drafting
NEWEST_VLLM = (0, 34)  # the newest release this table was read from
PEAGLE_VLLM_REQUIREMENT = "vllm>=0.16,<0.34"  # the releases that serve a P-EAGLE head

# vLLM 0.34's refusals, word for word (tests/test_vllm_oracle.py checks them against its code)
_NO_PARALLEL_EAGLE3 = "parallel_drafting is only supported by the dflash and dspark methods, not 'eagle3'."
_NO_PEAGLE_CONFIG = "P-EAGLE (parallel drafting EAGLE-3) is not supported."


class VllmRelease(NamedTuple):
    """A run of vLLM releases that serve the same head kinds: `first` .. `last` (None: to date),
    and the error each refused (kind, format) raises."""

    first: tuple[int, int]
    last: tuple[int, int] | None
    serves: frozenset[str]
    refusals: dict[tuple[str, str], str]


VLLM_RELEASES = (
    VllmRelease(FIRST_PARALLEL, (0, 33), frozenset(HEAD_KINDS), {}),
    VllmRelease(
        (0, 34),
        None,
        frozenset({"chain", "dflash"}),
        {
            ("parallel", "vllm"): f"SpeculativeConfig raises ValueError: {_NO_PARALLEL_EAGLE3}",
            ("parallel", "speculators"): f"its speculators translation raises ValueError: {_NO_PEAGLE_CONFIG}",
        },
    ),
)


def parse_vllm_version(text: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version ("0.34", "0.34.0", "0.33.1rc2+cu130"). ValueError when
    it starts with no MAJOR.MINOR."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:[.+\-a-z0-9]*)\s*$", str(text))
    if not m:
        raise ValueError(f"not a vLLM version: {text!r} (expected MAJOR.MINOR, e.g. 0.34)")
    return int(m.group(1)), int(m.group(2))


def version_text(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def installed_vllm() -> tuple[int, int] | None:
    """The vLLM release installed beside this project (None when there is none, or it is unreadable)."""
    try:
        return parse_vllm_version(importlib.metadata.version("vllm"))
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def _release(v: tuple[int, int]) -> VllmRelease | None:
    return next((r for r in VLLM_RELEASES if r.first <= v and (r.last is None or v <= r.last)), None)


def vllm_refusal(v: tuple[int, int], mode: str, fmt: str) -> str | None:
    """Why vLLM release `v` cannot serve a head of this kind and format as trained (None: it can,
    or the table does not know that release)."""
    if mode == "parallel" and v < FIRST_PARALLEL:
        return f"vLLM {version_text(v)} predates parallel drafting (vLLM {version_text(FIRST_PARALLEL)})"
    rel = _release(v)
    if rel is None or mode in rel.serves:
        return None
    return rel.refusals.get((mode, fmt)) or rel.refusals.get((mode, "vllm"))


def serving_vllm(mode: str) -> str:
    """The vLLM releases that serve a head kind, as a pip requirement ("vllm": the current ones)."""
    return PEAGLE_VLLM_REQUIREMENT if mode == "parallel" else "vllm"
