"""`DrafterConfig` -> the config.json of a vLLM-native or a speculators head (the reader, with the
semantics both tools give these keys, is `peagle_jax.formats.head_config`). DFlash heads (mode
"dflash") get their own layouts: `DFlashDraftModel` with `dflash_config` (z-lab ids, ours - 1)
for vLLM, `speculators_model_type: "dflash"` for speculators (`peagle_jax.formats.head_config_dflash`)."""

from __future__ import annotations

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.dtypes import EXPORT, dtype_name
from peagle_jax.config.fields import ConfigError
from peagle_jax.config.target_config import RopeConfig
from peagle_jax.formats.dflash_causality import CAUSAL_KEY, causality_keys
from peagle_jax.formats.head_config import (
    AUX_KEY,
    DEFAULT_K_TRAIN,
    EXTRA_KEY,
    MASK_ID_KEYS,
    SPECULATORS_ARCH,
    SPECULATORS_VERSION,
)
from peagle_jax.formats.head_config_dflash import DFLASH_ARCH, DFLASH_SPECULATORS_ARCH, DFLASH_TYPE
from peagle_jax.models.registry import architecture_of

__all__ = ["vllm_config", "speculators_config", "dflash_vllm_config", "dflash_speculators_config"]


def window_fields(c: DrafterConfig) -> dict:
    """The sliding-window keys of a layer config (none for a head without a window)."""
    if c.sliding_window is None and not c.sliding:
        return {}
    return {"layer_types": list(c.layer_types), "sliding_window": c.sliding_window, "use_sliding_window": c.sliding}


def _rope_fields(rope: RopeConfig) -> dict:
    hf = rope.to_hf()
    scaling = None if rope.type == "default" else {k: v for k, v in hf.items() if k != "rope_theta"}
    return {"rope_theta": rope.theta, "rope_scaling": scaling, "rope_parameters": hf}


def _llama_fields(c: DrafterConfig) -> dict:
    return {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        **_rope_fields(c.rope),
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "hidden_act": c.hidden_act,
        "attention_bias": c.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        **window_fields(c),
    }


def vllm_config(c: DrafterConfig, dtype="bfloat16") -> dict:
    """The config.json of the vLLM-native layout (`LlamaForCausalLMEagle3`; DFlash heads:
    `DFlashDraftModel`)."""
    if c.mode == "dflash":
        return dflash_vllm_config(c, dtype)
    if c.qk_norm:
        raise ConfigError(
            "export_vllm: this head has q/k norms (a Qwen3 layer config), which vLLM's "
            "Llama EAGLE-3 layout cannot hold; export the speculators layout instead"
        )
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **_llama_fields(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "eagle_config": {"use_aux_hidden_state": True, "norm_before_fc": c.norm_before_fc},
        "torch_dtype": dtype_name(dtype, EXPORT),
        EXTRA_KEY: dict(mode=c.mode, k_train=c.k_train, target_model_type=c.target_model_type, verifier=c.verifier),
    }
    if c.aux_layer_ids is not None:
        out[AUX_KEY] = list(c.aux_layer_ids)
        out["eagle_config"][AUX_KEY] = list(c.aux_layer_ids)
    if c.mask_token_id is not None:
        out.update({k: c.mask_token_id for k in MASK_ID_KEYS})
    return out


def speculators_config(c: DrafterConfig, dtype="bfloat16", verifier: str | None = None) -> dict:
    """The config.json of the speculators layout; `verifier` overrides the recorded target."""
    if c.mode == "dflash":
        return dflash_speculators_config(c, dtype, verifier)
    kind = "peagle" if c.mode == "parallel" else "eagle3"
    flags = {"fc_norm": c.fc_norm, "norm_output": c.norm_output}
    tl = {"model_type": "qwen3" if c.qk_norm else "llama", **_llama_fields(c), **flags}
    tl.pop("rope_scaling")
    tl.pop("rope_theta")
    k = c.k_train or DEFAULT_K_TRAIN
    out = {
        "architectures": [SPECULATORS_ARCH[kind]],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": tl,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        **flags,
        "embed_requires_grad": True,
        "tie_word_embeddings": False,
        AUX_KEY: None if c.aux_layer_ids is None else list(c.aux_layer_ids),
        "speculators_config": {
            "algorithm": kind,
            **_proposal(c, k, verifier),
        },
        "dtype": dtype_name(dtype, EXPORT),
    }
    if c.mask_token_id is not None:
        out["mask_token_id"] = c.mask_token_id
    return out


def _proposal(c: DrafterConfig, k: int, verifier: str | None) -> dict:
    """speculators_config's proposal method (greedy, K drafts) and verifier."""
    arch = architecture_of(c.target_model_type)
    return {
        "proposal_methods": [
            dict(proposal_type="greedy", speculative_tokens=k, accept_tolerance=0.0, verifier_accept_k=1)
        ],
        "default_proposal_method": "greedy",
        "verifier": {
            "name_or_path": verifier if verifier is not None else c.verifier,
            "architectures": [arch] if arch else [],
        },
    }


def _dflash_causality(c: DrafterConfig, fmt: str) -> dict:
    """The causality keys of a DFlash head (`dflash_causality`): they make vLLM (<= 0.34) run
    each layer as ours does (`DrafterConfig.block_causal`: full layers bidirectionally)."""
    return causality_keys(fmt, c.layer_types, [c.block_causal(i) for i in range(c.num_layers)])


def dflash_vllm_config(c: DrafterConfig, dtype="bfloat16") -> dict:
    """A DFlash head's vLLM-native (z-lab) config.json: a Qwen3 config plus block_size and
    dflash_config (target_layer_ids = our aux ids - 1), and our ids under
    eagle_aux_hidden_state_layer_ids, which vLLM reads first."""
    if min(c.aux_layer_ids) < 1:
        raise ConfigError(
            f"export_vllm: DFlash aux layer id 0 (the embeddings) has no z-lab form (target_layer_ids = ids - 1); "
            f"aux_layer_ids {list(c.aux_layer_ids)}"
        )
    causal = _dflash_causality(c, "vllm")
    inner = {"mask_token_id": c.mask_token_id, "target_layer_ids": [i - 1 for i in c.aux_layer_ids]}
    return {
        "architectures": [DFLASH_ARCH],
        "model_type": "qwen3",
        **_llama_fields(c),
        "layer_types": list(c.layer_types),
        "block_size": c.block_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        AUX_KEY: list(c.aux_layer_ids),
        "dflash_config": {**inner, **({"causal": causal[CAUSAL_KEY]} if causal else {})},
        "torch_dtype": dtype_name(dtype, EXPORT),
        EXTRA_KEY: dict(mode=c.mode, k_train=c.k_train, target_model_type=c.target_model_type, verifier=c.verifier),
    }


def dflash_speculators_config(c: DrafterConfig, dtype="bfloat16", verifier: str | None = None) -> dict:
    """A DFlash head's speculators config.json, as speculators 0.9.0's DFlashSpeculatorConfig
    writes it (aux_hidden_state_layer_ids in our convention, block_size - 1 drafts a pass), but
    with `sliding_window_non_causal` true: speculators' default false makes vLLM (<= 0.34) run
    every layer causally (`dflash_causality`)."""
    tl = {"model_type": "qwen3", **_llama_fields(c), "layer_types": list(c.layer_types)}
    tl.pop("rope_scaling")
    tl.pop("rope_theta")
    return {
        "architectures": [DFLASH_SPECULATORS_ARCH],
        "speculators_model_type": DFLASH_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": tl,
        "draft_vocab_size": c.draft_vocab_size,
        "block_size": c.block_size,
        "target_hidden_size": c.target_hidden_size,
        "aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "mask_token_id": c.mask_token_id,
        **_dflash_causality(c, "speculators"),
        "sample_from_anchor": False,
        "speculators_config": {"algorithm": DFLASH_TYPE, **_proposal(c, c.block_size - 1, verifier)},
        "dtype": dtype_name(dtype, EXPORT),
    }
