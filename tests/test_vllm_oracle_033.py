"""tests/test_vllm_oracle.py's checks on vLLM 0.33.0, the last release that serves P-EAGLE heads (a
module of its own, so that the two releases' vLLM processes run on different test workers)."""

from test_vllm_oracle import *  # noqa: F403 - the same tests and fixtures, another release

RELEASE = "0.33.0"
