"""Where the shared golden vectors live: `shared/` beside the checkout (as laid out for
sessions and CI), else the workplace copy."""

from pathlib import Path

_CANDIDATES = (Path(__file__).resolve().parents[2] / "shared", Path("/work/shared"))
SHARED = next((p for p in _CANDIDATES if (p / "vectors").is_dir()), _CANDIDATES[0])
VECTORS = SHARED / "vectors" / "peagle-tiny"
