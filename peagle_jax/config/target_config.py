"""Frozen target configurations: `TargetConfig`, `RopeConfig` (a head's: `peagle_jax.config.drafter_config`).

One `TargetConfig` describes every supported decoder family; family differences are
flags (norm offset, q/k norms, embedding scale, sliding layers, softcaps), so the
model code has one path. Reading and writing Hugging Face `config.json` files is the job
of the family registry (`peagle_jax.models.registry`). `RopeConfig` covers default /
linear / llama3 / yarn RoPE in both the transformers v5 `rope_parameters` form and the older
`rope_theta` + `rope_scaling` keys. The aux-layer convention (`default_aux_layer_ids`,
`validate_aux_layer_ids`) lives here because targets, drafters and every reader share it.

The config.json field specs and their checker are `peagle_jax.config.fields` (ConfigError and
read_json are defined there and re-exported here).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from peagle_jax.config.fields import (  # noqa: F401 - ConfigError and read_json are re-exported
    ROPE_FIELDS,
    ConfigError,
    check_fields,
    read_json,
    shown,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
NUM_AUX = 3  # aux hidden states a drafter reads (vLLM's EAGLE-3 heads: exactly 3)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (GPT-OSS): the ramp between interpolated and extrapolated frequencies, and the
    # cos/sin multiplier (`attention_factor`, else derived from factor / mscale / mscale_all_dim)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    @classmethod
    def from_dict(cls, params: dict | None, default_theta: float, where: str) -> RopeConfig:
        """Reads a v5 `rope_parameters` entry or an old `rope_scaling` dict (plus its theta);
        ConfigError naming `where` and the key when a value breaks `ROPE_FIELDS`."""
        if params is not None and not isinstance(params, dict):
            raise ConfigError(f"{where}: expected an object, got {shown(params)}")
        params = dict(params or {})
        check_fields(params, ROPE_FIELDS, where)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"{where}: unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        kw: dict[str, Any] = {"theta": float(params.get("rope_theta", default_theta)), "type": rope_type}
        if rope_type in ("linear", "llama3", "yarn"):
            if params.get("factor") is None:
                raise ConfigError(f"{where}: rope type {rope_type!r} needs key 'factor'")
            kw["factor"] = float(params["factor"])
        if rope_type == "llama3":
            for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if key not in params:
                    raise ConfigError(f"{where}: llama3 rope needs key {key!r}")
                kw[key] = type(getattr(cls, key))(params[key])
        if rope_type == "yarn":
            if "original_max_position_embeddings" not in params:
                raise ConfigError(f"{where}: yarn rope needs key 'original_max_position_embeddings'")
            kw["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
            # transformers: `params.get(key) or default`, so 0 / None mean the default too
            kw["beta_fast"] = float(params.get("beta_fast") or 32.0)
            kw["beta_slow"] = float(params.get("beta_slow") or 1.0)
            kw["truncate"] = bool(params.get("truncate", True))
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if params.get(key) is not None:
                    kw[key] = float(params[key])
        return cls(**kw)

    def to_hf(self) -> dict:
        out: dict[str, Any] = {"rope_type": self.type, "rope_theta": self.theta}
        if self.type in ("linear", "llama3", "yarn"):
            out["factor"] = self.factor
        if self.type == "yarn":
            out.update(
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                truncate=self.truncate,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
            out.update(
                {
                    k: getattr(self, k)
                    for k in ("attention_factor", "mscale", "mscale_all_dim")
                    if getattr(self, k) is not None
                }
            )
        if self.type == "llama3":
            out.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return out

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [head_dim // 2] in float32, as transformers computes them."""
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
        inv = (1.0 / (self.theta**exponent)).astype(np.float32)
        if self.type == "linear":
            inv = inv / np.float32(self.factor)
        elif self.type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        elif self.type == "yarn":  # transformers' _compute_yarn_parameters, in float32
            dim, base = head_dim, self.theta

            def correction_dim(rotations):
                return (
                    dim
                    * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                    / (2 * math.log(base))
                )

            low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
            if self.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001  # transformers: avoids a zero-width ramp
            pos_freqs = (self.theta**exponent).astype(np.float32)
            extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
            interpolation = (np.float32(1.0) / (np.float32(self.factor) * pos_freqs)).astype(np.float32)
            ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
            extra = (np.float32(1.0) - ramp).astype(np.float32)
            inv = (interpolation * (1 - extra) + extrapolation * extra).astype(np.float32)
        return inv

    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos and sin by (yarn's mscale; 1 for the others)."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return float(get_mscale(self.factor))


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A decoder-only target model. Field names follow transformers where they exist."""

    model_type: str  # our family name: llama | qwen3 | gemma3 | qwen3_moe | gpt_oss
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    # Gemma 3: sliding layers use their own rope (local base frequency).
    rope_local: RopeConfig | None = None
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    qk_norm: bool = False  # qwen3, gemma3: per-head RMSNorm on q and k
    norm_offset: float = 0.0  # gemma: RMSNorm scales by (1 + w)
    sandwich_norms: bool = False  # gemma3: post-attention and pre/post-feedforward norms
    embed_scale: float = 1.0  # gemma: embeddings times sqrt(H)
    query_pre_attn_scalar: float | None = None  # gemma: attention scale = scalar**-0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # gpt_oss: a learned per-head logit in every softmax denominator (`self_attn.sinks`)
    attention_sinks: bool = False
    # Mixture of experts (qwen3_moe, gpt_oss): layers whose `mlp_types` entry is "moe" route each
    # token to `num_experts_per_tok` of `num_experts` SwiGLU experts of width `moe_intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    mlp_types: tuple[str, ...] = ()  # "dense" | "moe" per layer; default all "moe" when num_experts > 0
    # "softmax_topk" (qwen3_moe): softmax over all experts, then top-k (renormalised with
    # norm_topk_prob); "topk_softmax" (gpt_oss): top-k logits, softmax over those k
    router: str = "softmax_topk"
    norm_topk_prob: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    # "split": gate and up stacks of their own (qwen3_moe); "interleaved": one [E, H, 2I] stack,
    # gate in the even columns, up in the odd ones (gpt_oss)
    expert_gate_up: str = "split"
    # gpt_oss's clamped SwiGLU: gate <= limit, |up| <= limit, out = (up + 1) * gate * sigmoid(alpha * gate)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if not self.mlp_types:
            kind = "moe" if self.num_experts > 0 else "dense"
            object.__setattr__(self, "mlp_types", (kind,) * self.num_layers)
        where = f"TargetConfig({self.model_type})"
        if len(self.mlp_types) != self.num_layers or set(self.mlp_types) - {"dense", "moe"}:
            raise ConfigError(f"{where}: mlp_types must be 'dense' | 'moe' per layer, got {self.mlp_types!r}")
        if "moe" in self.mlp_types:
            if self.num_experts <= 0 or self.moe_intermediate_size <= 0:
                raise ConfigError(
                    f"{where}: MoE layers need num_experts > 0 and moe_intermediate_size > 0, got "
                    f"{self.num_experts} and {self.moe_intermediate_size}"
                )
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"{where}: num_experts_per_tok {self.num_experts_per_tok} must be in "
                    f"[1, num_experts {self.num_experts}]"
                )
        if self.router not in ("softmax_topk", "topk_softmax"):
            raise ConfigError(f"{where}: router must be 'softmax_topk' or 'topk_softmax', got {self.router!r}")
        if self.expert_gate_up not in ("split", "interleaved"):
            raise ConfigError(f"{where}: expert_gate_up must be 'split' or 'interleaved', got {self.expert_gate_up!r}")

    @property
    def moe(self) -> bool:
        """Some layer routes to experts (key-map condition)."""
        return "moe" in self.mlp_types

    @property
    def dense_mlp(self) -> bool:
        """Some layer has a plain gated MLP (key-map condition)."""
        return "dense" in self.mlp_types

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_types[layer] == "moe"

    @property
    def attn_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        return float(base) ** -0.5

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.layer_types[layer] == "sliding_attention" and self.rope_local is not None:
            return self.rope_local
        return self.rope

    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        return default_aux_layer_ids(self.num_layers)


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default (2, L//2, L-3) for an L-layer target; where those collide (4-6
    layers: tiny test targets), (0, L//2, L-1)."""
    n = int(num_layers)
    ids = (2, n // 2, n - 3)
    return tuple(sorted(ids)) if len(set(ids)) == NUM_AUX and min(ids) >= 0 else (0, n // 2, n - 1)


def validate_aux_layer_ids(
    ids, num_layers: int | None = None, where: str = "aux_layer_ids", count: int | None = NUM_AUX
) -> tuple[int, ...]:
    """`count` (None: one or more) distinct non-negative ints (in [0, num_layers) when it is
    given), vLLM's EAGLE-3 convention: id i = the residual stream entering target layer i.
    ConfigError naming `where` otherwise. Returned in ascending order: vLLM collects the aux
    states while it walks the layers, so they are concatenated in layer order whatever order a
    config lists them in."""
    what = f"{count}" if count is not None else "one or more"
    try:
        ids = tuple(ids)
    except TypeError:
        raise ConfigError(f"{where}: expected {what} layer ids, got {ids!r}") from None
    ok = (
        (len(ids) == count if count is not None else len(ids) >= 1)
        and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids)
        and len(set(int(i) for i in ids)) == len(ids)
        and all(int(i) >= 0 and (num_layers is None or int(i) < num_layers) for i in ids)
    )
    if not ok:
        span = (
            "non-negative ints" if num_layers is None else f"ints in [0, {num_layers}) for a {num_layers}-layer target"
        )
        raise ConfigError(f"{where}: expected {what} distinct {span}, got {ids!r}")
    return tuple(sorted(int(i) for i in ids))


def dflash_aux_layer_ids(num_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default context layers for an L-layer target and an N-layer head, in our
    convention (residual entering layer i). DFlash reads the *output* of layers spread evenly
    from 1 to L-3, one per draft layer (round(1 + j (L-4) / (N-1)); L//2 for N = 1), which is
    the residual entering the next layer: our id = DFlash's id + 1 (speculators' ids are ours).
    Where they collide (tiny targets) the ids are spread over [1, L-1] instead."""
    n, d = int(num_layers), int(num_draft_layers)
    if d == 1:
        native = [n // 2]
    else:
        native = [int(round(1 + j * (n - 4) / (d - 1))) for j in range(d)]
    ids = [i + 1 for i in native]
    if len(set(ids)) == d and min(ids) >= 1 and max(ids) < n:
        return tuple(ids)
    if d > n - 1:
        raise ConfigError(f"a {d}-layer DFlash head needs a target with more than {d} layers (got {n})")
    return tuple(sorted({int(round(1 + j * (n - 2) / max(d - 1, 1))) for j in range(d)}))
