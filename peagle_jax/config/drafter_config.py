"""`DrafterConfig`: everything that shapes a drafter head (P-EAGLE, EAGLE-3, DFlash), frozen.

The checks a head's shape must pass live here, per what they concern: the sizes and mode in
`__post_init__`, sliding-window layers in `_check_windows`, DFlash's block in `_check_dflash`.
Reading and writing the config.json files of vLLM and speculators is `peagle_jax.formats`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from peagle_jax.config.fields import ACTIVATION_NAMES, LAYER_TYPES, ConfigError
from peagle_jax.config.target_config import NUM_AUX, RopeConfig, validate_aux_layer_ids

DRAFTER_MODES = ("parallel", "chain", "dflash")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Everything that shapes the drafter network. Hashable (a static jit argument).

    `aux_layer_ids` use the vLLM convention (residual stream entering that target layer).
    `k_train` is the depth the head was trained for (P-EAGLE: COD depths K; EAGLE-3: TTT
    steps); None when unknown. `norm_output` (EAGLE 3.1): chain mode feeds back the
    post-norm state instead of the pre-norm one. `qk_norm`: Qwen3-style per-head q/k
    RMSNorm in every layer (speculators heads built on a Qwen3 layer config).
    `verifier`: the target's name or path as a speculators config records it.
    `layer_types` ("full_attention" | "sliding_attention" per layer; () = all full) and
    `sliding_window` (tokens) as transformers, speculators and vLLM spell them: a sliding layer
    attends to depth-0 rows within `sliding_window` of each row's reference position (the rule:
    `kernels.visible`). `sliding_window` may be set with no sliding layer (speculators writes it
    always); it then changes nothing.
    Mode "dflash" (`peagle_jax.models.dflash`): `block_size` B (the bonus token and B - 1 mask
    slots, drafting B - 1 tokens a pass) and `aux_layer_ids` of any length (one context layer
    each); the other modes have no block size. A DFlash layer attends bidirectionally inside
    its block, a sliding one causally unless `sliding_window_non_causal` (speculators' key, one
    for every sliding layer); `block_causal`.
    """

    hidden_size: int
    target_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    mode: str = "parallel"
    mask_token_id: int | None = None
    aux_layer_ids: tuple[int, int, int] | None = None
    k_train: int | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    target_model_type: str | None = None
    verifier: str | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    block_size: int | None = None
    sliding_window_non_causal: bool = False
    dummy_target: bool = False  # made for a target with dummy weights: its drafts mean nothing

    def __post_init__(self):
        if self.aux_layer_ids is not None:  # None: the default ids of the target it is paired with
            count = None if self.mode == "dflash" else NUM_AUX
            ids = validate_aux_layer_ids(self.aux_layer_ids, where="DrafterConfig.aux_layer_ids", count=count)
            object.__setattr__(self, "aux_layer_ids", ids)
        for name in (
            "hidden_size",
            "target_hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "draft_vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"DrafterConfig: {name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.mode not in DRAFTER_MODES:
            raise ConfigError(f"DrafterConfig: mode must be one of {DRAFTER_MODES}, got {self.mode!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"DrafterConfig: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"DrafterConfig: draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}")
        if self.mask_token_id is not None:
            if not 0 <= int(self.mask_token_id) < self.vocab_size:
                raise ConfigError(
                    f"DrafterConfig: mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})"
                )
            object.__setattr__(self, "mask_token_id", int(self.mask_token_id))
        if self.mode == "parallel" and self.mask_token_id is None:
            raise ConfigError("DrafterConfig: mode 'parallel' needs a mask_token_id")
        if self.norm_before_fc and self.fc_norm:
            raise ConfigError("DrafterConfig: norm_before_fc and fc_norm are mutually exclusive")
        if self.hidden_act not in ACTIVATION_NAMES:
            raise ConfigError(f"DrafterConfig: unsupported hidden_act {self.hidden_act!r}")
        if self.k_train is not None:
            object.__setattr__(self, "k_train", int(self.k_train))
        self._check_windows()
        if self.mode == "dflash":
            self._check_dflash()
        else:
            for name in ("block_size", "sliding_window_non_causal"):
                if getattr(self, name) not in (None, False):
                    raise ConfigError(f"DrafterConfig: {name} is a DFlash setting (mode {self.mode!r} has none)")

    def _check_dflash(self) -> None:
        """DFlash heads: Qwen3 layers (q/k norms), hidden size = the target's, a block of >= 2,
        explicit context layers, a mask token, none of the EAGLE-3 input norms."""
        b = self.block_size
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 2:
            raise ConfigError(f"DrafterConfig: mode 'dflash' needs block_size >= 2, got {b!r}")
        object.__setattr__(self, "block_size", int(b))
        problems = [
            (self.mask_token_id is None, "a mask_token_id"),
            (self.aux_layer_ids is None, "aux_layer_ids (its context layers)"),
            (not self.qk_norm, "qk_norm (Qwen3 layers)"),
            (self.hidden_size != self.target_hidden_size, "hidden_size equal to target_hidden_size"),
            (self.norm_before_residual or self.norm_before_fc or self.fc_norm or self.norm_output, "no EAGLE-3 norms"),
        ]
        for bad, need in problems:
            if bad:
                raise ConfigError(f"DrafterConfig: mode 'dflash' needs {need}")
        if not isinstance(self.sliding_window_non_causal, (bool, np.bool_)):
            raise ConfigError(
                f"DrafterConfig: sliding_window_non_causal must be true or false, got {self.sliding_window_non_causal!r}"
            )
        object.__setattr__(self, "sliding_window_non_causal", bool(self.sliding_window_non_causal))
        if self.k_train is None:
            object.__setattr__(self, "k_train", int(b) - 1)

    def _check_windows(self) -> None:
        types = tuple(self.layer_types) if self.layer_types else ("full_attention",) * self.num_layers
        if len(types) != self.num_layers:
            raise ConfigError(
                f"DrafterConfig: layer_types has {len(types)} entries for num_hidden_layers {self.num_layers}"
            )
        bad = sorted(set(types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"DrafterConfig: unknown layer_types {bad} (known: {', '.join(LAYER_TYPES)})")
        object.__setattr__(self, "layer_types", types)
        w = self.sliding_window
        if w is not None:
            if not isinstance(w, (int, np.integer)) or isinstance(w, bool) or w < 1:
                raise ConfigError(f"DrafterConfig: sliding_window must be an int >= 1, got {w!r}")
            object.__setattr__(self, "sliding_window", int(w))
        elif "sliding_attention" in types:
            raise ConfigError("DrafterConfig: layer_types has sliding_attention layers but sliding_window is not set")

    def window(self, layer: int) -> int | None:
        """The sliding window of drafter layer `layer` (None: full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def block_causal(self, layer: int) -> bool:
        """DFlash layer `layer` attends causally inside its block: a sliding layer unless
        `sliding_window_non_causal` (speculators 0.9.0: full-attention layers never do)."""
        return self.window(layer) is not None and not self.sliding_window_non_causal

    @property
    def sliding(self) -> bool:
        """Some drafter layer has a sliding window."""
        return "sliding_attention" in self.layer_types

    @property
    def context_window(self) -> int | None:
        """DFlash: the context rows before its anchor a block can see when every layer slides (the
        window; the engine's context cache is then a ring of about that size); else None."""
        if self.mode == "dflash" and set(self.layer_types) == {"sliding_attention"}:
            return self.sliding_window
        return None

    @property
    def attn_scale(self) -> float:
        return float(self.head_dim) ** -0.5

    @property
    def num_aux(self) -> int:
        """Aux states concatenated into fc: 3 (EAGLE-3 / P-EAGLE), one per context layer (DFlash)."""
        return len(self.aux_layer_ids) if self.mode == "dflash" else NUM_AUX

    @property
    def fc_in(self) -> int:
        return self.num_aux * self.target_hidden_size

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["rope"] = dataclasses.asdict(self.rope)
        out["aux_layer_ids"] = None if self.aux_layer_ids is None else list(self.aux_layer_ids)
        out["layer_types"] = list(self.layer_types)
        if not self.dummy_target:  # written only when true: every other head's drafter.json is unchanged
            del out["dummy_target"]
        return out

    @classmethod
    def from_dict(cls, data: dict, where: str = "drafter config") -> DrafterConfig:
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}")
        rope = data.get("rope")
        if isinstance(rope, dict):
            rope_known = {f.name for f in dataclasses.fields(RopeConfig)}
            bad = sorted(set(rope) - rope_known)
            if bad:
                raise ConfigError(f"{where}: unknown keys {bad} in 'rope'")
            data["rope"] = RopeConfig(**rope)
        return cls.build(where, **data)

    @classmethod
    def build(cls, where: str, **fields) -> DrafterConfig:
        """`DrafterConfig(**fields)`, its errors (a missing or unknown field, a value its checks
        refuse) one ConfigError naming `where`: the file and key the fields came from."""
        try:
            return cls(**fields)
        except TypeError as err:
            raise ConfigError(f"{where}: {err}") from None
        except ConfigError as err:
            raise ConfigError(f"{where}: {str(err).removeprefix('DrafterConfig: ')}") from None
