"""NaN / Inf in a head's weights, the one definition: the lint (`inspect`) reports each such
tensor as a problem, `export` and `import` refuse the head unless `--force`, and `write_own`
(`Drafter.save`) unless told (`allow_non_finite=True`): vLLM would load them and draft from NaN
logits, and our engine likewise."""

from __future__ import annotations

import numpy as np

__all__ = ["non_finite", "non_finite_tensors"]


def non_finite(arr) -> str | None:
    """None when every value of `arr` is finite, else how many are not, e.g. "3 non-finite
    values (2 NaN, 1 Inf) of 4096"."""
    arr = np.asarray(arr)
    if arr.dtype.kind in "iub":
        return None
    nan = int(np.count_nonzero(np.isnan(arr)))
    bad = arr.size - int(np.count_nonzero(np.isfinite(arr)))
    if not bad:
        return None
    return f"{bad} non-finite value{'s' if bad > 1 else ''} ({nan} NaN, {bad - nan} Inf) of {arr.size}"


def non_finite_tensors(arrays: dict) -> list[tuple[str, str]]:
    """[(dotted name, `non_finite` text)] of every array of {path tuple: array} holding NaN / Inf,
    in name order."""
    named = sorted(((".".join(map(str, path)), arr) for path, arr in arrays.items()), key=lambda x: x[0])
    return [(name, found) for name, arr in named if (found := non_finite(arr))]
