"""What one target family contributes to the registry, and the pieces families share.

A `Family` is: its config.json `model_type`s and architecture names, a parser
(HF config dict -> `TargetConfig`), a writer (`TargetConfig` -> config dict transformers loads
back), and a weight key map. Key-map rows are ``(hf_key, our_path, transform, condition)``
with ``{i}`` standing for the layer index; `transform` is ``"linear"`` (PyTorch ``[out, in]``
<-> NNX kernel ``[in, out]``: a transpose), ``"identity"``, or ``"experts_linear"`` (``{e}`` in
the key runs over the experts: per-expert ``[out, in]`` matrices, transposed and stacked);
`condition` names the `TargetConfig` flag or property the row depends on (``"untied"`` = no
tied embeddings; ``"moe"`` / ``"dense_mlp"`` = that layer's MLP kind; None = always). MXFP4
expert tensors (``<key>_blocks`` + ``<key>_scales``) are read in place of ``<key>`` by
`peagle_jax.sources.weights`.
Adding a family = one module under `peagle_jax/models/` defining a `FAMILY`, plus its name
in `registry.FAMILY_MODULES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from peagle_jax.config.target_config import ConfigError, RopeConfig, TargetConfig

KeyRow = tuple[str, str, str, "str | None"]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # TargetConfig.model_type
    model_types: tuple[str, ...]  # config.json model_type values it reads
    architectures: tuple[str, ...]  # HF architecture names; the first is written on export
    parse: Callable[[dict, str], TargetConfig]  # (config dict, where) -> TargetConfig
    to_hf: Callable[[TargetConfig], dict]
    key_map: tuple[KeyRow, ...]
    # vLLM's native model for this family captures aux hidden states (`SupportsEagle3`);
    # when False, serving a drafter needs `--model-impl transformers`.
    vllm_eagle3: bool = True


# ---------------------------------------------------------------------------------------
# config.json helpers
def require(cfg: dict, key: str, where: str):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{where}: missing key {key!r}")
    return cfg[key]


def eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def common_fields(cfg: dict, family: str, where: str) -> dict[str, Any]:
    """The TargetConfig fields every family reads the same way (their types and ranges were
    checked by `registry.target_config` against `config.TARGET_FIELDS`)."""
    hidden = int(require(cfg, "hidden_size", where))
    heads = int(require(cfg, "num_attention_heads", where))
    return dict(
        model_type=family,
        vocab_size=int(require(cfg, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(require(cfg, "intermediate_size", where)),
        num_layers=int(require(cfg, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos_ids(cfg.get("eos_token_id")),
        pad_token_id=cfg.get("pad_token_id"),
    )


def common_hf(c: TargetConfig) -> dict[str, Any]:
    return {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "attention_bias": c.attention_bias,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_id) if len(c.eos_token_id) != 1 else c.eos_token_id[0],
        "pad_token_id": c.pad_token_id,
    }


def rope_v4_or_v5(cfg: dict, where: str, default_theta: float = 10000.0) -> RopeConfig:
    """A flat rope: v5 `rope_parameters`, else v4 `rope_theta` + `rope_scaling`."""
    params, key = cfg.get("rope_parameters"), "rope_parameters"
    if params is None:
        params, key = (
            {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", default_theta)},
            "rope_scaling",
        )
    return RopeConfig.from_dict(params, default_theta, f"{where} key {key!r}")


LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(types, num_layers: int, where: str) -> tuple[str, ...]:
    if len(types) != num_layers:
        raise ConfigError(f"{where}: key 'layer_types' has {len(types)} entries for {num_layers} layers")
    bad = set(types) - set(LAYER_TYPES)
    if bad:
        raise ConfigError(f"{where}: key 'layer_types' has unsupported entries {sorted(bad)}")
    return tuple(types)


# ---------------------------------------------------------------------------------------
# key-map building blocks
ATTENTION = tuple(
    (f"model.layers.{{i}}.self_attn.{p}_proj.weight", f"layers.{{i}}.self_attn.{p}_proj.kernel", "linear", None)
    for p in "qkvo"
) + tuple(
    (
        f"model.layers.{{i}}.self_attn.{p}_proj.bias",
        f"layers.{{i}}.self_attn.{p}_proj.bias",
        "identity",
        "attention_bias",
    )
    for p in "qkvo"
)
MLP = tuple(
    (f"model.layers.{{i}}.mlp.{p}_proj.weight", f"layers.{{i}}.mlp.{p}_proj.kernel", "linear", None)
    for p in ("gate", "up", "down")
) + tuple(
    (f"model.layers.{{i}}.mlp.{p}_proj.bias", f"layers.{{i}}.mlp.{p}_proj.bias", "identity", "mlp_bias")
    for p in ("gate", "up", "down")
)
NORMS = tuple(
    (f"model.layers.{{i}}.{n}.weight", f"layers.{{i}}.{n}.weight", "identity", None)
    for n in ("input_layernorm", "post_attention_layernorm")
)
QK_NORMS = tuple(
    (f"model.layers.{{i}}.self_attn.{n}.weight", f"layers.{{i}}.self_attn.{n}.weight", "identity", None)
    for n in ("q_norm", "k_norm")
)
TOP = (
    ("model.embed_tokens.weight", "embed_tokens.embedding", "identity", None),
    ("model.norm.weight", "norm.weight", "identity", None),
    ("lm_head.weight", "lm_head.kernel", "linear", "untied"),
)
