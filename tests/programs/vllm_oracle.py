"""vLLM's own code on this project's exports, on a CPU: run by tests/vllm_oracle.py in .venv-vllm
with one vLLM release on PYTHONPATH (`make vllm-venv`: .vllm/0.33.0, .vllm/0.34.0).

argv: a JSON file of cases, each {"name", "target" (a HF folder), "spec" (the
--speculative-config dict), "load" (bool), "npz" (where the loaded parameters go)}. For each
case, vLLM's SpeculativeConfig is built from the spec beside the target's ModelConfig (its
config translation: speculators configs included), and with "load" the draft model is made and
its weights loaded by vLLM's own loader (`get_model`, as the EAGLE proposer does). Printed last:
one JSON line, per case: {"error"} or {"method", "parallel_drafting", "architectures",
"dflash_config", "params": {name: [shape, dtype]}, "warnings"}.

Two platform calls are stubbed, nothing of the config or loading code: vLLM's x86 CPU platform
asks for triton-cpu in `check_and_update_config`, and the loader empties the accelerator's cache.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.accelerator.empty_cache = lambda: None  # no accelerator here

from vllm.config import (  # noqa: E402
    DeviceConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

current_platform.check_and_update_config = lambda config: None  # asks for triton-cpu on x86
# vLLM's loader runs a full collection per model: kept out of it, the objects of the imports above
# (torch, vLLM) are not walked again each time
gc.freeze()


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record):
        self.seen.append(record.getMessage())


def error_text(err: Exception) -> str:
    """The message vLLM raised (pydantic wraps a validator's ValueError as 'Value error, MSG [...]')."""
    text = str(err)
    if "Value error, " in text:
        text = text.split("Value error, ", 1)[1].rsplit(" [type=", 1)[0]
    return f"{type(err).__name__}: {text}"


def init_distributed() -> None:
    """One process group of one rank (gloo, loopback), made once, inside a vLLM config context."""
    from vllm.distributed import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
    )
    initialize_model_parallel(1, 1)


def load(vc: VllmConfig, sc: SpeculativeConfig, npz: str) -> dict:
    from vllm.model_executor.model_loader import get_model

    dvc = sc.apply_draft_overrides(vc) if hasattr(sc, "apply_draft_overrides") else vc
    with set_current_vllm_config(dvc):
        init_distributed()
        model = get_model(vllm_config=dvc, model_config=sc.draft_model_config)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("mask_hidden"))
    arrays = {
        n: t.detach().to(torch.float32 if t.is_floating_point() else torch.int64).numpy() for n, t in tensors.items()
    }
    np.savez(npz, **arrays)
    return {n: [list(a.shape), str(tensors[n].dtype)] for n, a in arrays.items()}


def run_case(case: dict, models: dict) -> dict:
    target = case["target"]
    if target not in models:
        models[target] = ModelConfig(model=target, skip_tokenizer_init=True, dtype="float32", max_model_len=64)
    mc = models[target]
    seen = Warnings()
    logging.getLogger("vllm").addHandler(seen)
    try:
        sc = SpeculativeConfig(**case["spec"], target_model_config=mc, target_parallel_config=ParallelConfig())
        hf = sc.draft_model_config.hf_config
        out = {
            "method": sc.method,
            "parallel_drafting": getattr(sc, "parallel_drafting", None),
            "architectures": list(getattr(hf, "architectures", None) or []),
            "dflash_config": getattr(hf, "dflash_config", None),
        }
        if case.get("load"):
            vc = VllmConfig(
                model_config=mc, speculative_config=sc, device_config=DeviceConfig("cpu"), load_config=LoadConfig()
            )
            out["params"] = load(vc, sc, case["npz"])
    except Exception as err:  # the refusal is the result
        out = {"error": error_text(err)}
    finally:
        logging.getLogger("vllm").removeHandler(seen)
    out["warnings"] = seen.seen
    return out


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    models: dict = {}
    results = {c["name"]: run_case(c, models) for c in cases}
    print(json.dumps(results, default=str))
    gc.unfreeze()  # collected at exit as usual (nanobind counts what is left as leaked)


if __name__ == "__main__":
    main()
