"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): Qwen3
attention (q/k norms) with a mixture-of-experts feed-forward (`models.moe`): softmax router over
`num_experts`, top `num_experts_per_tok` (renormalised with `norm_topk_prob`), SwiGLU experts of
width `moe_intermediate_size`. Layers in `mlp_only_layers`, or off the `decoder_sparse_step`
grid, keep a dense MLP of width `intermediate_size`.

Checkpoints store each expert on its own (`mlp.experts.{e}.gate_proj.weight` [I, H], ...) and the
router as `mlp.gate.weight` [E, H]; the loader stacks the experts into [E, in, out].
"""

from __future__ import annotations

from peagle_jax.config.target_config import TargetConfig
from peagle_jax.models import family as fam


def mlp_types(cfg: dict, num_layers: int) -> tuple[str, ...]:
    """transformers' rule: a layer is sparse when it is not in `mlp_only_layers`, num_experts > 0 and
    (layer + 1) % decoder_sparse_step == 0."""
    only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    return tuple("moe" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense" for i in range(num_layers))


def parse(cfg: dict, where: str) -> TargetConfig:
    common = fam.common_fields(cfg, "qwen3_moe", where)
    n = common["num_layers"]
    types = mlp_types(cfg, n)
    moe = "moe" in types
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # released: num_experts; v5 saves both
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return TargetConfig(
        **common,
        rope=fam.rope_v4_or_v5(cfg, where),
        hidden_act=cfg.get("hidden_act", "silu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=True,
        layer_types=("sliding_attention" if sliding else "full_attention",) * n,
        sliding_window=sliding,
        num_experts=experts if moe else 0,
        num_experts_per_tok=int(fam.require(cfg, "num_experts_per_tok", where)) if moe else 0,
        moe_intermediate_size=int(fam.require(cfg, "moe_intermediate_size", where)) if moe else 0,
        mlp_types=types,
        router="softmax_topk",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


def to_hf(c: TargetConfig) -> dict:
    return {
        **fam.common_hf(c),
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_act": c.hidden_act,
        "rope_parameters": c.rope.to_hf(),
        "use_sliding_window": c.sliding_window is not None,
        "sliding_window": c.sliding_window,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size,
        "norm_topk_prob": c.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, t in enumerate(c.mlp_types) if t == "dense"],
    }


# Rows for layers of either kind: `weights` keeps, per layer, the ones of that layer's kind
# (a dense MLP or router + experts), so one table serves mixed configs.
DENSE_MLP = tuple(
    (f"model.layers.{{i}}.mlp.{p}_proj.weight", f"layers.{{i}}.mlp.{p}_proj.kernel", "linear", "dense_mlp")
    for p in ("gate", "up", "down")
) + tuple(
    (f"model.layers.{{i}}.mlp.{p}_proj.bias", f"layers.{{i}}.mlp.{p}_proj.bias", "identity", "mlp_bias")
    for p in ("gate", "up", "down")
)
QK_NORMS = tuple((hf, ours, t, "qk_norm") for hf, ours, t, _ in fam.QK_NORMS)
# "experts_linear": {e} runs over the experts; each [out, in] matrix is transposed and stacked
EXPERTS = (("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.kernel", "linear", "moe"),) + tuple(
    (
        f"model.layers.{{i}}.mlp.experts.{{{{e}}}}.{p}_proj.weight",
        f"layers.{{i}}.mlp.experts.{p}_proj",
        "experts_linear",
        "moe",
    )
    for p in ("gate", "up", "down")
)

FAMILY = fam.Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    parse=parse,
    to_hf=to_hf,
    key_map=fam.TOP + fam.NORMS + fam.ATTENTION + QK_NORMS + DENSE_MLP + EXPERTS,
)
