"""Where the tests find their golden vectors: tests/golden (shipped with the repository;
`tests/golden/regenerate.py` makes them again from speculators)."""

from pathlib import Path

VECTORS = Path(__file__).resolve().parent / "golden" / "peagle-tiny"
