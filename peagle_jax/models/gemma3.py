"""Gemma 3 text (`Gemma3ForCausalLM`; the text tower of `Gemma3ForConditionalGeneration`):
(1 + w) RMSNorms, sandwich norms, q/k norms, sqrt(H) embedding scale, interleaved sliding
and full layers with their own rope bases, final-logit softcapping.

vLLM's native `gemma3` model (0.33, 0.34) does not capture aux hidden states (no `SupportsEagle3`):
a drafter for a Gemma 3 target is served with `--model-impl transformers`.
"""

from __future__ import annotations

import numpy as np

from peagle_jax.config.target_config import RopeConfig, TargetConfig
from peagle_jax.models import family as fam


def parse(cfg: dict, where: str) -> TargetConfig:
    if cfg.get("model_type") == "gemma3" and "text_config" in cfg:  # multimodal wrapper: its text tower
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
    common = fam.common_fields(cfg, "gemma3", where)
    num_layers = common["num_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    key = f"{where} key 'rope_parameters'"
    rope_params = cfg.get("rope_parameters")
    if rope_params is not None and "full_attention" in rope_params:
        rope = RopeConfig.from_dict(rope_params["full_attention"], 1e6, key + "['full_attention']")
        local = RopeConfig.from_dict(rope_params.get("sliding_attention"), 1e4, key + "['sliding_attention']")
    else:  # transformers v4 keys
        scaling = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e6)}
        rope = RopeConfig.from_dict(scaling, 1e6, f"{where} key 'rope_scaling'")
        local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 1e4)))
    return TargetConfig(
        **common,
        rope=rope,
        rope_local=local,
        layer_types=fam.check_layer_types(types, num_layers, where),
        sliding_window=int(cfg.get("sliding_window") or 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        hidden_act=cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh")),
        qk_norm=True,
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=float(np.float32(common["hidden_size"] ** 0.5)),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", common["head_dim"])),
        # Gemma 3 replaced attention-logit softcapping by q/k norms: transformers 5.x never passes
        # `attn_logit_softcapping` to its Gemma 3 attention, so a non-null value is ignored here too
        # (the released checkpoints have null; tests/test_target.py sets 3.0 to pin this down).
        attn_logit_softcapping=None,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


def _int_if_integral(x):
    return int(x) if isinstance(x, float) and x.is_integer() else x


def to_hf(c: TargetConfig) -> dict:
    return {
        **fam.common_hf(c),
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_activation": c.hidden_act,
        "rope_parameters": {
            "full_attention": c.rope.to_hf(),
            "sliding_attention": (c.rope_local or RopeConfig(theta=1e4)).to_hf(),
        },
        "layer_types": list(c.layer_types),
        "sliding_window": c.sliding_window,
        "query_pre_attn_scalar": _int_if_integral(c.query_pre_attn_scalar),  # transformers wants an int
        "attn_logit_softcapping": c.attn_logit_softcapping,
        "final_logit_softcapping": c.final_logit_softcapping,
    }


SANDWICH = tuple(
    (f"model.layers.{{i}}.{n}.weight", f"layers.{{i}}.{n}.weight", "identity", None)
    for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
)

FAMILY = fam.Family(
    name="gemma3",
    model_types=("gemma3_text", "gemma3"),
    architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    parse=parse,
    to_hf=to_hf,
    key_map=fam.TOP + fam.NORMS + SANDWICH + fam.ATTENTION + fam.QK_NORMS + fam.MLP,
    vllm_eagle3=False,
)
