"""`python -m infer.report`: the earlier name of `python -m report` (the report pipeline), kept working."""
