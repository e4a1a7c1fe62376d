"""The one table of floating dtypes the project accepts, by name or dtype object.

Compute (targets, drafters): float32 and bfloat16. Export files may also be float16.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

COMPUTE = ("float32", "bfloat16")
EXPORT = ("bfloat16", "float32", "float16")
_ALIASES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
_NUMPY = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def dtype_name(dtype, allowed: tuple[str, ...] = COMPUTE) -> str:
    """Canonical name ("float32", "bfloat16", "float16") of a name, alias, numpy or jax dtype;
    ValueError listing `allowed` for anything else."""
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
    else:
        try:
            name = str(np.dtype(dtype))
        except TypeError:
            name = str(dtype)
    if name not in allowed:
        raise ValueError(f"unsupported dtype {dtype!r} (supported: {', '.join(allowed)})")
    return name


def numpy_dtype(dtype, allowed: tuple[str, ...] = COMPUTE) -> np.dtype:
    """The numpy dtype (ml_dtypes for bfloat16); jax accepts it everywhere a dtype goes."""
    return _NUMPY[dtype_name(dtype, allowed)]


def is_float(dtype) -> bool:
    """A floating dtype (bfloat16 included, which numpy does not count as 'f')."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype == _NUMPY["bfloat16"]
