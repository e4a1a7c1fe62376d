"""The P-EAGLE paper's published figures, shown in the report as reference columns beside our
measurements. They come from a different target (GPT-OSS-20B) on different hardware (one B200),
so they are a reference for scale, not a comparison of like with like."""

from __future__ import annotations

SOURCE = "P-EAGLE paper (GPT-OSS-20B target on one B200)"
K = 7  # the K of the published acceptance lengths

# acceptance length at K=7 per benchmark: (P-EAGLE, EAGLE-3); the sets we evaluate by our names
ACCEPTANCE = {
    "humaneval": (3.94, 3.03),
    "speed-bench": (3.38, 2.59),
    "mtbench": (3.70, 3.27),
}
NAMES = {"humaneval": "HumanEval", "speed-bench": "SPEED-Bench", "mtbench": "MT-Bench"}

BEST_K = {"P-EAGLE": 7, "EAGLE-3": 3}  # the K of each head's highest throughput
THROUGHPUT_RATIO = (1.05, 1.69)  # P-EAGLE at its best K over EAGLE-3 at its best K


def acceptance(dataset: str, k: int) -> tuple[float, float] | None:
    """The paper's (P-EAGLE, EAGLE-3) acceptance length on `dataset` at `k` (None: not published)."""
    return ACCEPTANCE.get(dataset) if k == K else None


def throughput_ratio() -> str:
    low, high = THROUGHPUT_RATIO
    return f"{low:.2f}-{high:.2f}x"
