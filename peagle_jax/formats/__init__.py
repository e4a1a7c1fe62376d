"""The formats: what vLLM, speculators and this project keep on disk for a head.

Reading and writing heads (`read_drafter`, its config alone `read_drafter_config`, `write_own`, `export_vllm`, `export_speculators`),
their config.json facts (`read_vllm_config`, `read_speculators_config`), the lint that says
what vLLM would trip on (`inspect_folder`, `format_report`), the serve command
(`serve_command`) and what to run to serve a head (`serve_lines`; which engine release serves
which head kind: `engines`), and the converter command line (`python -m peagle_jax.convert`). Everything
here works on (DrafterConfig, {path: array}); it never runs a head (`peagle_jax.engine`).
"""

_LAZY = {  # every name loads on first use: `python -m peagle_jax.formats.convert` installs its handlers first
    "DrafterIOError": "checkpoints",
    "detect_format": "checkpoints",
    "export_speculators": "checkpoints",
    "export_vllm": "checkpoints",
    "read_drafter": "checkpoints",
    "read_drafter_config": "checkpoints",
    "export_drafter": "conversion",
    "head_kind": "head_config",
    "read_speculators_config": "head_config",
    "read_vllm_config": "head_config",
    "refuse_head": "head_config",
    "format_report": "inspect",
    "inspect_folder": "inspect",
    "write_own": "own",
    "SERVE_K": "serving",
    "serve_command": "serving",
    "serve_k": "serving",
    "serve_lines": "serving",
    "serve_note": "serving",
    "target_facts": "serving",
}

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
    "read_drafter_config",
    "read_speculators_config",
    "read_vllm_config",
    "serve_command",
    "serve_k",
    "serve_lines",
    "serve_note",
    "target_facts",
    "write_own",
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"peagle_jax.formats.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'peagle_jax.formats' has no attribute {name!r}")
