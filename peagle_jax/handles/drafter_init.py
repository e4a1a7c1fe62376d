"""A head's first layer started from one of the target's decoder layers (`new_drafter(init_layer=N)`).

The head's layer 0 reads concat(input_layernorm(embedding), hidden_norm(g)) where g is the fused
target state; a target layer reads its own normed residual. What carries over, layer 0 <- target
layer N:
- q / k / v kernels: the rows that read hidden_norm(g) (the second H rows); the rows that read
  the embedding keep their random start;
- o_proj, the MLP's gate / up / down kernels, and q / k norms when both layers have them;
- hidden_norm <- the target's input norm, post_attention_layernorm (the head's pre-MLP norm) <- the
  target's pre-MLP norm (Gemma 3: pre_feedforward_layernorm), both as effective scales (Gemma's
  (1 + w) becomes w + 1: the head's RMSNorm scales by w).
What does not: Gemma's post-attention and post-feedforward norms (a Llama layer has none), the
activation (the head's is SiLU, the only one vLLM's Llama layer serves; Gemma's is gelu-tanh),
attention biases. The layer is a warm start, not the target layer's function.
"""

from __future__ import annotations

import numpy as np

from peagle_jax.config.drafter_config import DrafterConfig

__all__ = ["target_layer_arrays"]

KERNELS = (("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _host(variable) -> np.ndarray:
    return np.asarray(variable[...], np.float32)


def target_layer_arrays(target, layer: int, arrays: dict, config: DrafterConfig) -> dict[tuple, np.ndarray]:
    """{path: array} of head layer 0 from target layer `layer` (negative counts from the end),
    given the head's fresh `arrays` (their embedding rows of q / k / v are kept). ValueError when
    the target has no such dense layer or the shapes differ."""
    n = target.config.num_layers
    if config.mode == "dflash":
        raise ValueError("init_layer: a DFlash head's layers read the target's context, not a fused state")
    if not -n <= layer < n:
        raise ValueError(f"init_layer={layer}: the target has {n} layers (valid: {-n} .. {n - 1})")
    src = target.state["layers"][layer % n]
    if "mlp" not in src or "gate_proj" not in src["mlp"]:
        raise ValueError(f"init_layer={layer}: target layer {layer % n} has no dense MLP (a mixture of experts)")
    offset = float(target.config.norm_offset)
    h = config.hidden_size
    out: dict[tuple, np.ndarray] = {}

    def put(path: tuple, value: np.ndarray) -> None:
        want = arrays[path].shape
        if value.shape != want:
            raise ValueError(f"init_layer={layer}: {'.'.join(map(str, path))} is {want}, the target's {value.shape}")
        out[path] = value

    for proj in ("q_proj", "k_proj", "v_proj"):
        path = ("layers", 0, "self_attn", proj, "kernel")
        fused = arrays[path].copy()
        tk = _host(src["self_attn"][proj]["kernel"])
        if fused.shape != (2 * h, tk.shape[1]) or tk.shape[0] != h:
            raise ValueError(f"init_layer={layer}: {proj} is {fused.shape}, the target's {tk.shape}")
        fused[h:] = tk
        put(path, fused)
    for group, name in KERNELS:
        put(("layers", 0, group, name, "kernel"), _host(src[group][name]["kernel"]))
    for name in ("q_norm", "k_norm"):
        path = ("layers", 0, "self_attn", name, "weight")
        if path in arrays and name in src["self_attn"]:
            put(path, _host(src["self_attn"][name]["weight"]) + offset)
    pre_mlp = "pre_feedforward_layernorm" if "pre_feedforward_layernorm" in src else "post_attention_layernorm"
    put(("layers", 0, "hidden_norm", "weight"), _host(src["input_layernorm"]["weight"]) + offset)
    put(("layers", 0, "post_attention_layernorm", "weight"), _host(src[pre_mlp]["weight"]) + offset)
    return out
