"""Measurement: one script per benchmark or device check, each run from the repository root as
`python -m bench.NAME` (`--help` says what it measures and writes). bench may import anything of
the project; nothing of the project imports bench (pyproject.toml's import contracts). Its timers
are the library's (`peagle_jax.runtime.timing`), shared with `infer bench`, `infer cost` and the report;
the kernel checks' cases are `kernels.cases`, shared with the kernel tests.

The published results are bench/results/*.json, rendered into docs/benchmarks.md by
`python -m bench.render_results`; `python -m bench.device` is the device playbook (docs/device.md).
"""
