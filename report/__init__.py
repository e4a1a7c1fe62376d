"""`python -m report`: P-EAGLE vs EAGLE-3 vs DFlash vs plain decoding, from one resumable command
(also `make report`, and `python -m infer.report`, its earlier name).

An application beside train/, infer/ and plan/: it runs the trainer and the engine, so it lives in
neither; it may import train, infer and the library, and nothing imports it.

Modules by job: `common` (the heads and their order), `cli` (flags, profiles, the command), `stages`
(the stage records and the trainer subprocess), `evaluate` (every head against plain decoding, and
the results dict), `render` (the Markdown report), `reference` (the paper's published figures
shown beside ours), `plots`.
"""

from report.cli import main

__all__ = ["main"]
