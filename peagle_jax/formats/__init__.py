"""The formats: what vLLM, speculators and this project keep on disk for a head.

Reading and writing heads (`read_drafter`, `write_own`, `export_vllm`, `export_speculators`),
their config.json facts (`read_vllm_config`, `read_speculators_config`), the lint that says
what vLLM would trip on (`inspect_folder`, `format_report`), the serve command
(`serve_command`) and what to run to serve a head (`serve_lines`; which engine release serves
which head kind: `engines`), and the converter command line (`python -m peagle_jax.convert`). Everything
here works on (DrafterConfig, {path: array}); it never runs a head (`peagle_jax.engine`).
"""

from peagle_jax.formats.checkpoints import (
    DrafterIOError,
    detect_format,
    export_speculators,
    export_vllm,
    read_drafter,
)
from peagle_jax.formats.convert import export_drafter
from peagle_jax.formats.head_config import head_kind, read_speculators_config, read_vllm_config, refuse_head
from peagle_jax.formats.inspect import format_report, inspect_folder
from peagle_jax.formats.own import write_own
from peagle_jax.formats.serving import SERVE_K, serve_command, serve_k, serve_lines, serve_note, target_facts

__all__ = [
    "SERVE_K",
    "DrafterIOError",
    "detect_format",
    "export_drafter",
    "export_speculators",
    "export_vllm",
    "format_report",
    "head_kind",
    "refuse_head",
    "inspect_folder",
    "read_drafter",
    "read_speculators_config",
    "read_vllm_config",
    "serve_command",
    "serve_k",
    "serve_lines",
    "serve_note",
    "target_facts",
    "write_own",
]
