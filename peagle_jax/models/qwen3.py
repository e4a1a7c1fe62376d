"""Qwen3 (`Qwen3ForCausalLM`): Llama plus per-head q/k RMSNorm and optional sliding layers."""

from __future__ import annotations

from peagle_jax.config.target_config import TargetConfig
from peagle_jax.models import family as fam
from peagle_jax.models import llama


def _layer_types(cfg: dict, num_layers: int, where: str) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is not None:
        return fam.check_layer_types(types, num_layers, where)
    if cfg.get("use_sliding_window"):  # transformers v4: layers from max_window_layers on slide
        first_sliding = cfg.get("max_window_layers", num_layers)
        return tuple("full_attention" if i < first_sliding else "sliding_attention" for i in range(num_layers))
    return ("full_attention",) * num_layers


def parse(cfg: dict, where: str) -> TargetConfig:
    common = fam.common_fields(cfg, "qwen3", where)
    return TargetConfig(
        **common,
        rope=fam.rope_v4_or_v5(cfg, where),
        hidden_act=cfg.get("hidden_act", "silu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=True,
        layer_types=_layer_types(cfg, common["num_layers"], where),
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
    )


def to_hf(c: TargetConfig) -> dict:
    return {
        **llama.to_hf(c),
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "use_sliding_window": c.sliding_window is not None,
        "sliding_window": c.sliding_window,
        "layer_types": list(c.layer_types),
    }


FAMILY = fam.Family(
    name="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    parse=parse,
    to_hf=to_hf,
    key_map=fam.TOP + fam.NORMS + fam.ATTENTION + fam.QK_NORMS + fam.MLP,
)
