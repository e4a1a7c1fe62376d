"""`python -m infer.report`: P-EAGLE vs EAGLE-3 vs DFlash vs plain decoding, from one resumable command.

Modules by job: `common` (the heads and their order), `cli` (flags, profiles, the command), `stages`
(the stage records and the trainer subprocess), `evaluate` (every head against plain decoding, and
the results dict), `render` (the Markdown report), `reference` (the paper's published figures
shown beside ours), `plots`.
"""

from infer.report.cli import main

__all__ = ["main"]
