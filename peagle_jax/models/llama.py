"""Llama (`LlamaForCausalLM`): the plain pre-norm decoder every other family varies."""

from __future__ import annotations

from peagle_jax.config.target_config import TargetConfig
from peagle_jax.models import family as fam


def parse(cfg: dict, where: str) -> TargetConfig:
    return TargetConfig(
        **fam.common_fields(cfg, "llama", where),
        rope=fam.rope_v4_or_v5(cfg, where),
        hidden_act=cfg.get("hidden_act", "silu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def to_hf(c: TargetConfig) -> dict:
    return {
        **fam.common_hf(c),
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": c.hidden_act,
        "mlp_bias": c.mlp_bias,
        "rope_parameters": c.rope.to_hf(),
    }


FAMILY = fam.Family(
    name="llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    parse=parse,
    to_hf=to_hf,
    key_map=fam.TOP + fam.NORMS + fam.ATTENTION + fam.MLP,
)
