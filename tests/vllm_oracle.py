"""Run vLLM's own code on exports (tests/programs/vllm_oracle.py) in .venv-vllm, one release at a
time (`make vllm-venv` installs 0.33.0 and 0.34.0), and map the parameters it loaded back to the
tensors of the exported folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PROGRAM = ROOT / "tests" / "programs" / "vllm_oracle.py"
RELEASES = ("0.33.0", "0.34.0")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# parameters vLLM makes and never reads here: a hidden_norm in every EAGLE-3 layer (only layer 0's
# forward reads it, llama_eagle3.py), DFlash's mask_embedding (read only with a mask_embedding.pt)
UNREAD = re.compile(r"model\.layers\.[1-9]\d*\.hidden_norm\.weight|model\.mask_embedding")
# a head folder without these gets the target's (vLLM's maybe_share_target_embed / share_target_lm_head)
SHARED = ("model.embed_tokens.weight", "lm_head.weight")
# vLLM pads vocabulary rows (VocabParallelEmbedding, ParallelLMHead) to a multiple of 64
PADDED_ROWS = ("embed_tokens.weight", "lm_head.weight")


def run_oracle(release: str, cases: list[dict], work: Path) -> dict:
    """{case name: what vLLM `release` made of it}; skipped when the oracle is not installed."""
    code = ROOT / ".vllm" / release
    if not PYTHON.exists() or not code.is_dir():
        pytest.skip(f"vLLM {release} oracle not installed (make vllm-venv)")
    work.mkdir(parents=True, exist_ok=True)
    spec = work / f"cases-{release}.json"
    spec.write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(PYTHONPATH=str(code), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    proc = subprocess.run(
        [str(PYTHON), str(PROGRAM), str(spec)], env=env, cwd=work, capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise AssertionError(f"the vLLM {release} oracle failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def source_of(param: str, keys: set[str]) -> list[str]:
    """The exported tensors vLLM's parameter `param` was loaded from: the `model.` prefix off,
    `draft_id_to_target_id` from d2t, fused q/k/v and gate/up projections from their parts, and
    layer 0 from `midlayer.*` in a vLLM-native EAGLE-3 folder."""
    name = "d2t" if param == "draft_id_to_target_id" else re.sub(r"^model\.", "", param)
    fused = next((f for f in FUSED if f".{f}." in name), None)
    names = [name.replace(fused, p) for p in FUSED[fused]] if fused else [name]
    native = [re.sub(r"^layers\.0\.", "midlayer.", n) for n in names]
    return native if set(native) <= keys and not set(names) <= keys else names


def loaded_as_exported(npz: str, tensors: dict[str, np.ndarray]) -> tuple[set[str], list[str], set[str]]:
    """(the exported tensors vLLM loaded, the parameters that differ from them bit for bit or keep
    their init, the parameters vLLM takes from the target because the folder has none)."""
    used, wrong, shared = set(), [], set()
    with np.load(npz) as got:
        for param in got.files:
            names = source_of(param, set(tensors))
            if not set(names) <= set(tensors):
                if param in SHARED:
                    shared.add(param)
                elif not UNREAD.fullmatch(param):
                    wrong.append(f"{param} (no tensor {names} in the folder: vLLM keeps its init)")
                continue
            have = got[param]
            want = np.concatenate([tensors[n].astype(have.dtype) for n in names]).reshape(-1, *have.shape[1:])
            if param.endswith(PADDED_ROWS) and have.shape[0] > want.shape[0]:
                have = have[: want.shape[0]]
            used.update(names)
            if not np.array_equal(have, want):
                wrong.append(param)
    return used, wrong, shared
