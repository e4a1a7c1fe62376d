"""GPT-OSS (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): q/k/v/o biases, a learned attention
sink per head, sliding-window (128) and full layers alternating (`layer_types`), YaRN RoPE, and a
mixture-of-experts feed-forward in every layer (`models.moe`): a router with bias, top-4 of 32 /
128 experts, softmax over the selected logits, experts with interleaved gate/up columns, biases,
and the clamped SwiGLU `(up + 1) * gate * sigmoid(1.702 * gate)` (gate <= 7, |up| <= 7).

Expert stacks are stored [E, in, out] (`mlp.experts.gate_up_proj` [E, H, 2I], `down_proj`
[E, I, H]); the released checkpoints hold them as MXFP4 (`*_blocks` + `*_scales`), which
`peagle_jax.sources.weights` dequantises at load.
"""

from __future__ import annotations

from peagle_jax.config.target_config import ConfigError, RopeConfig, TargetConfig
from peagle_jax.models import family as fam
from peagle_jax.models.qwen3_moe import DENSE_MLP, QK_NORMS

# transformers' GptOssConfig defaults (a config.json may leave them out)
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
DEFAULT_THETA = 150000.0


def parse(cfg: dict, where: str) -> TargetConfig:
    cfg = {"head_dim": 64, "rms_norm_eps": 1e-5, "attention_bias": True, **cfg}
    common = fam.common_fields(cfg, "gpt_oss", where)
    n = common["num_layers"]
    if cfg.get("rope_parameters") is None and cfg.get("rope_scaling") is None:
        rope = RopeConfig.from_dict(
            {**DEFAULT_ROPE, "rope_theta": cfg.get("rope_theta", DEFAULT_THETA)},
            DEFAULT_THETA,
            f"{where} key 'rope_parameters'",
        )
    else:
        rope = fam.rope_v4_or_v5(cfg, where, DEFAULT_THETA)
    types = cfg.get("layer_types")
    if types is None:  # transformers: sliding on even layers, full on odd ones
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts is None:
        raise ConfigError(f"{where}: missing key 'num_local_experts'")
    return TargetConfig(
        **common,
        rope=rope,
        layer_types=fam.check_layer_types(types, n, where),
        sliding_window=int(cfg.get("sliding_window") or 128),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=cfg.get("hidden_act", "silu"),
        attention_sinks=True,
        num_experts=int(experts),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 4)),
        moe_intermediate_size=common["intermediate_size"],
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        expert_gate_up="interleaved",
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )


def to_hf(c: TargetConfig) -> dict:
    return {
        **fam.common_hf(c),
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "hidden_act": c.hidden_act,
        "intermediate_size": c.moe_intermediate_size,
        "num_local_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "layer_types": list(c.layer_types),
        "sliding_window": c.sliding_window,
        "rope_parameters": c.rope.to_hf(),
        "swiglu_limit": c.swiglu_limit,
        "swiglu_alpha": c.swiglu_alpha,
    }


SINKS = (("model.layers.{i}.self_attn.sinks", "layers.{i}.self_attn.sinks", "identity", "attention_sinks"),)
EXPERTS = (
    ("model.layers.{i}.mlp.router.weight", "layers.{i}.mlp.router.kernel", "linear", "moe"),
    ("model.layers.{i}.mlp.router.bias", "layers.{i}.mlp.router.bias", "identity", "router_bias"),
    # already [E, in, out]; MXFP4 checkpoints hold `<key>_blocks` + `<key>_scales` instead
    ("model.layers.{i}.mlp.experts.gate_up_proj", "layers.{i}.mlp.experts.gate_up_proj", "identity", "moe"),
    (
        "model.layers.{i}.mlp.experts.gate_up_proj_bias",
        "layers.{i}.mlp.experts.gate_up_proj_bias",
        "identity",
        "expert_bias",
    ),
    ("model.layers.{i}.mlp.experts.down_proj", "layers.{i}.mlp.experts.down_proj", "identity", "moe"),
    ("model.layers.{i}.mlp.experts.down_proj_bias", "layers.{i}.mlp.experts.down_proj_bias", "identity", "expert_bias"),
)

FAMILY = fam.Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    architectures=("GptOssForCausalLM",),
    parse=parse,
    to_hf=to_hf,
    key_map=fam.TOP + fam.NORMS + fam.ATTENTION + QK_NORMS + SINKS + DENSE_MLP + EXPERTS,
)
