"""Kernel launches of a compiled program, counted in its optimized HLO text (`compiled.as_text()`).

A batch-1 decode step reads its weights once and does little arithmetic: what keeps it off its HBM
roofline is mostly the fixed cost of each kernel launch, so the number of kernels a step runs is
the first figure to look at. Counted: every instruction of a computation that runs as a kernel of
its own (the entry computation, while-loop bodies and conditions, branches, called computations),
fusions and custom calls (cuBLAS / cuDNN / Pallas) apart; not counted: what fusions contain, and
instructions that launch nothing (parameters, constants, tuples, bitcasts, control flow). A loop
body counts once (a static count: a round that loops K times runs its body's kernels K times).
"""

from __future__ import annotations

import dataclasses
import re

# instructions that launch no kernel of their own
FREE_OPS = frozenset(
    "parameter constant tuple get-tuple-element bitcast while conditional call after-all partition-id "
    "replica-id opt-barrier add-dependency domain copy-done send-done recv-done".split()
)
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_TO_APPLY = re.compile(r"to_apply=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Launches:
    """Kernels of one program: fusions, custom calls, and every other launching instruction."""

    fusions: int
    custom_calls: int
    other: int

    @property
    def total(self) -> int:
        return self.fusions + self.custom_calls + self.other


def _computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("{")[0].split("(")[0]:
            current = header.group(2)
            out[current] = []
        elif line.strip() == "}":
            current = None
        elif current is not None and line.strip():
            out[current].append(line)
    return out


def _inlined(computations: dict[str, list[str]]) -> set[str]:
    """Computations whose instructions do not launch on their own: fusion bodies (`calls=` of a
    fusion) and reducers (`to_apply=`), with whatever they call in turn."""
    inside: set[str] = set()
    for lines in computations.values():
        for line in lines:
            op = _INSTRUCTION.match(line)
            if op and op.group(1) == "fusion":
                inside.update(_CALLS.findall(line))
            inside.update(_TO_APPLY.findall(line))
    todo = list(inside)
    while todo:
        for line in computations.get(todo.pop(), []):
            for name in _CALLS.findall(line) + _TO_APPLY.findall(line):
                if name not in inside:
                    inside.add(name)
                    todo.append(name)
    return inside


def count_launches(hlo: str) -> Launches:
    """The kernel launches of an optimized HLO module's text (see the module docstring)."""
    computations = _computations(hlo)
    inlined = _inlined(computations)
    counts = {"fusion": 0, "custom-call": 0, "other": 0}
    for name, lines in computations.items():
        if name in inlined:
            continue
        for line in lines:
            op = _INSTRUCTION.match(line)
            if op is None or op.group(1) in FREE_OPS:
                continue
            counts[op.group(1) if op.group(1) in counts else "other"] += 1
    return Launches(counts["fusion"], counts["custom-call"], counts["other"])
