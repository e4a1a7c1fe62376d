"""The config.json field specs and their checker: one table per kind of file (`TARGET_FIELDS`,
`ROPE_FIELDS`, `GENERATION_FIELDS`, `HEAD_LAYER_FIELDS`, `HEAD_FIELDS`: key -> `Field`, a kind
and a range) with the attention-shape rules (`ATTENTION_RULES`); the readers call
`check_fields` / `check_attention`, whose ConfigError names the file and the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

ACTIVATION_NAMES = ("silu", "gelu_pytorch_tanh", "gelu_tanh", "gelu")  # models.layers implements them
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' `layer_types` entries


class ConfigError(ValueError):
    """A config file (config.json, generation_config.json, tokenizer files) that cannot be used;
    the message names the file and key."""


def read_json(path: str | Path) -> dict:
    """A JSON object from a config file; ConfigError naming the file when it is missing,
    unreadable or not an object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: unreadable config ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


# ---------------------------------------------------------------------------------------
# config.json field specs: key -> kind and range, checked by `check_fields`
@dataclasses.dataclass(frozen=True)
class Field:
    """What one config.json key may hold. A key that is absent passes unless `required`.

    kind: "int" | "number" (an int or a float, finite) | "bool" | "str" | "dict" | "id" (a token
    id) | "ids" (an id or a list of ids) | "int_list" | "str_list". `lo`: the least value
    (excluded when `open`); ids and list entries are >= 0. `below`: the key (of the same dict, or
    of check_fields' `bounds`) whose int value bounds ids and list entries from above, exclusive.
    `choices`: the strings a "str" / "str_list" may hold. `null`: null is allowed (the reader's
    default), unless `required`."""

    kind: str
    lo: float | None = None
    open: bool = False
    below: str | None = None
    choices: tuple[str, ...] = ()
    required: bool = False
    null: bool = True


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, (float, np.floating))) and math.isfinite(value)


def _in_range(f: Field, x, bound) -> bool:
    lo = 0 if f.lo is None and f.kind in ("id", "ids", "int_list") else f.lo
    return (lo is None or (x > lo if f.open else x >= lo)) and (bound is None or x < bound)


def _valid(f: Field, value, bound) -> bool:
    if f.kind == "bool":
        return isinstance(value, bool)
    if f.kind == "dict":
        return isinstance(value, dict)
    if f.kind in ("str", "str_list"):
        items = value if f.kind == "str_list" and isinstance(value, list) else [value]
        ok = f.kind == "str" or isinstance(value, list)
        return ok and all(isinstance(v, str) and (not f.choices or v in f.choices) for v in items)
    is_list = isinstance(value, list)
    if (f.kind == "int_list") != is_list and not (f.kind == "ids" and is_list):
        return False
    num = _is_number if f.kind == "number" else _is_int
    return all(num(x) and _in_range(f, x, bound) for x in (value if is_list else [value]))


def _describe(f: Field, bound) -> str:
    span = "" if bound is None else f" in [0, {f.below} {bound})"
    if f.kind == "int":
        what = {1: "a positive int", 0: "a non-negative int"}.get(f.lo, "an int")
    elif f.kind == "number":
        what = "a finite number" + ("" if f.lo is None else f" {'>' if f.open else '>='} {f.lo:g}")
        what = "a positive finite number" if (f.lo, f.open) == (0, True) else what
    elif f.kind in ("str", "str_list"):
        one = " | ".join(repr(c) for c in f.choices) if f.choices else "a string"
        what = f"a list of {one}" if f.kind == "str_list" else (f"one of {one}" if f.choices else one)
    else:
        what = {
            "bool": "true or false",
            "dict": "an object",
            "id": f"a token id{span}",
            "ids": f"a token id or a list of token ids{span}",
            "int_list": f"a list of ints{span}",
        }[f.kind]
    return what + (" or null" if f.null and not f.required else "")


def shown(value) -> str:
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


def check_fields(cfg: dict, spec: dict[str, Field], where: str, *, prefix: str = "", bounds: dict | None = None):
    """Checks each key of `spec` in `cfg` (in spec order, so a bound such as vocab_size is
    checked before the ids it bounds). ConfigError naming `where` and the key (written
    `prefix + key`: e.g. "text_config.") at the first violation, e.g.
    `/x/config.json: hidden_size must be a positive int, got '1024' (str)`."""
    scope = {**cfg, **(bounds or {})}
    for key, f in spec.items():
        if key not in cfg:
            if f.required:
                raise ConfigError(f"{where}: missing key {prefix + key!r}")
            continue
        value = cfg[key]
        bound = scope.get(f.below) if f.below and _is_int(scope.get(f.below)) else None
        if value is None and f.null and not f.required:
            continue
        if value is None or not _valid(f, value, bound):
            raise ConfigError(f"{where}: {prefix}{key} must be {_describe(f, bound)}, got {shown(value)}")


# Cross-field rules of the attention shape, on the final sizes (defaults filled in):
# (key, holds(sizes), what it must be). `sizes` has the JSON key names plus head_dim_given.
ATTENTION_RULES = (
    (
        "num_attention_heads",
        lambda s: s["num_attention_heads"] % s["num_key_value_heads"] == 0,
        "must be a multiple of num_key_value_heads {num_key_value_heads}",
    ),
    (
        "hidden_size",
        lambda s: s["head_dim_given"] or s["hidden_size"] % s["num_attention_heads"] == 0,
        "must be a multiple of num_attention_heads {num_attention_heads} (head_dim is not given: "
        "hidden_size // num_attention_heads would drop a remainder)",
    ),
    ("head_dim", lambda s: s["head_dim"] % 2 == 0, "must be even (RoPE rotates the two halves of each head)"),
)


def check_attention(where: str, prefix: str = "", **sizes) -> None:
    """ConfigError naming `where` and the key when the attention sizes (hidden_size,
    num_attention_heads, num_key_value_heads, head_dim, head_dim_given) break `ATTENTION_RULES`."""
    for key, holds, text in ATTENTION_RULES:
        if not holds(sizes):
            raise ConfigError(f"{where}: {prefix}{key} {sizes[key]} {text.format(**sizes)}")


REQUIRED_SIZE = Field("int", lo=1, required=True)
SIZE = Field("int", lo=1, null=False)
OPTIONAL_SIZE = Field("int", lo=1)  # null: the reader's default
POSITIVE = Field("number", lo=0, open=True, null=False)
OPTIONAL_POSITIVE = Field("number", lo=0, open=True)
FLAG = Field("bool")  # null: false
TOKEN = Field("id", below="vocab_size")
TOKENS = Field("ids", below="vocab_size")
ACTIVATION = Field("str", choices=ACTIVATION_NAMES, null=False)
SIZES = {k: REQUIRED_SIZE for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}

# a target's config.json (for Gemma 3's multimodal wrapper: its text_config); keys a family
# does not read are checked too when present
TARGET_FIELDS = {
    **SIZES,
    "num_attention_heads": REQUIRED_SIZE,
    "num_key_value_heads": OPTIONAL_SIZE,
    "head_dim": OPTIONAL_SIZE,
    "max_position_embeddings": SIZE,
    "rms_norm_eps": POSITIVE,
    "rope_theta": POSITIVE,
    "rope_local_base_freq": POSITIVE,
    "rope_parameters": Field("dict"),
    "rope_scaling": Field("dict"),
    "bos_token_id": TOKEN,
    "eos_token_id": TOKENS,
    "pad_token_id": TOKEN,
    "unk_token_id": TOKEN,
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"), FLAG),
    "hidden_act": ACTIVATION,
    "hidden_activation": ACTIVATION,
    "layer_types": Field("str_list", choices=LAYER_TYPES),
    "sliding_window": OPTIONAL_SIZE,
    "max_window_layers": Field("int", lo=0, null=False),
    "sliding_window_pattern": SIZE,
    "_sliding_window_pattern": SIZE,
    "query_pre_attn_scalar": POSITIVE,
    "attn_logit_softcapping": OPTIONAL_POSITIVE,
    "final_logit_softcapping": OPTIONAL_POSITIVE,
    "num_experts": Field("int", lo=0),
    "num_local_experts": Field("int", lo=0),
    "num_experts_per_tok": OPTIONAL_SIZE,
    "moe_intermediate_size": OPTIONAL_SIZE,
    "decoder_sparse_step": OPTIONAL_SIZE,
    "mlp_only_layers": Field("int_list", below="num_hidden_layers"),
    "norm_topk_prob": FLAG,
    "swiglu_limit": POSITIVE,
    "swiglu_alpha": POSITIVE,
}
# generation_config.json (bounded by the target's vocab_size)
GENERATION_FIELDS = {"bos_token_id": TOKEN, "eos_token_id": TOKENS, "pad_token_id": TOKEN}
# a rope dict (`rope_parameters`, `rope_scaling` + `rope_theta`)
ROPE_FIELDS = {
    "rope_theta": POSITIVE,
    "factor": OPTIONAL_POSITIVE,
    "low_freq_factor": POSITIVE,
    "high_freq_factor": POSITIVE,
    "original_max_position_embeddings": SIZE,
    "beta_fast": Field("number", lo=0),
    "beta_slow": Field("number", lo=0),
    "truncate": FLAG,
    "attention_factor": OPTIONAL_POSITIVE,
    "mscale": Field("number"),
    "mscale_all_dim": Field("number"),
}
# a drafter head's layer config (vLLM: the config itself; speculators: transformer_layer_config);
# its window keys are `head_config.layer_windows`'
HEAD_LAYER_FIELDS = {
    **SIZES,
    "num_attention_heads": REQUIRED_SIZE,
    "num_key_value_heads": OPTIONAL_SIZE,
    "head_dim": OPTIONAL_SIZE,
    "max_position_embeddings": OPTIONAL_SIZE,
    "rms_norm_eps": POSITIVE,
    "rope_theta": POSITIVE,
    "rope_parameters": Field("dict"),
    "rope_scaling": Field("dict"),
    "attention_bias": FLAG,
    "mlp_bias": FLAG,
    "hidden_act": ACTIVATION,
    "fc_norm": FLAG,
    "norm_output": FLAG,
}
# a drafter head's own keys, as `head_config.HeadFacts` gathers them (bounded by the layer's vocab_size)
HEAD_FIELDS = {
    "draft_vocab_size": OPTIONAL_SIZE,
    "target_hidden_size": OPTIONAL_SIZE,
    **dict.fromkeys(("mask_token_id", "pard_token", "ptd_token_id"), TOKEN),
    "k_train": OPTIONAL_SIZE,  # the trained depth, checked under its format's key (head_config.K_TRAIN_KEYS)
    **dict.fromkeys(("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), FLAG),
}
