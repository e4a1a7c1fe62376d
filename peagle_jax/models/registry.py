"""The target families: config.json <-> `TargetConfig`, architecture names, weight key maps.

Each family is one module of `peagle_jax.models` with a `FAMILY` (see `models.family`).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from peagle_jax.config.fields import TARGET_FIELDS, ConfigError, check_attention, check_fields, read_json
from peagle_jax.config.target_config import TargetConfig
from peagle_jax.models.family import Family

FAMILY_MODULES = ("llama", "qwen3", "gemma3", "qwen3_moe", "gpt_oss")
FAMILIES: dict[str, Family] = {
    f.name: f for f in (importlib.import_module(f"peagle_jax.models.{m}").FAMILY for m in FAMILY_MODULES)
}
# config.json model_type -> family
MODEL_TYPES = {t: f for f in FAMILIES.values() for t in f.model_types}
# HF architecture name -> family name
ARCHITECTURES = {a: f.name for f in FAMILIES.values() for a in f.architectures}
# vLLM's native models (0.33 and 0.34) that capture aux hidden states (SupportsEagle3), by family name
VLLM_EAGLE3_NATIVE = {f.name: f.vllm_eagle3 for f in FAMILIES.values()}


def family(name: str) -> Family:
    """The registered family `name` (TargetConfig.model_type)."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown target family {name!r} (supported: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[name]


def architecture_of(family_name: str | None) -> str | None:
    """The HF architecture name written for a family (None when unknown)."""
    return next((a for a, f in ARCHITECTURES.items() if f == family_name), None)


def target_config(source: str | Path | dict) -> TargetConfig:
    """A `TargetConfig` from a Hugging Face folder, a config.json path, or its parsed dict.
    ConfigError naming the file and the key when a value breaks `config.TARGET_FIELDS` (types,
    ranges, token ids in the vocabulary) or `config.ATTENTION_RULES`."""
    where = "config dict"
    if not isinstance(source, dict):
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        where = str(path)
        source = read_json(path)
    raw_type = source.get("model_type")
    if not isinstance(raw_type, str) or raw_type not in MODEL_TYPES:
        raise ConfigError(f"{where}: unknown model_type {raw_type!r} (supported: {', '.join(sorted(MODEL_TYPES))})")
    body, prefix = source, ""
    if raw_type == "gemma3" and "text_config" in source:  # the multimodal wrapper: its text tower is read
        body, prefix = source["text_config"], "text_config."
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: text_config must be an object, got {body!r}")
    check_fields(body, TARGET_FIELDS, where, prefix=prefix)
    try:
        cfg = MODEL_TYPES[raw_type].parse(dict(source), where)
    except ConfigError as err:  # TargetConfig's own checks name no file
        raise ConfigError(str(err) if str(err).startswith(where) else f"{where}: {err}") from None
    derived = cfg.hidden_size // cfg.num_heads
    check_attention(
        where,
        prefix,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        head_dim_given=body.get("head_dim") is not None or cfg.head_dim != derived,
    )
    return cfg


def hf_config(cfg: TargetConfig) -> dict:
    """A config.json dict that transformers loads back into the same model."""
    return family(cfg.model_type).to_hf(cfg)


def key_map(cfg: TargetConfig) -> list[tuple[str, tuple, str]]:
    """The expanded weight table of `cfg`: (hf_key, our path tuple, transform), one row per tensor."""
    rows = []
    for hf, ours, transform, cond in family(cfg.model_type).key_map:
        if cond == "untied":
            if cfg.tie_word_embeddings:
                continue
        elif cond is not None and not getattr(cfg, cond):
            continue
        for i in range(cfg.num_layers) if "{i}" in hf else [None]:
            h = hf if i is None else hf.format(i=i)
            o = ours if i is None else ours.format(i=i)
            rows.append((h, tuple(int(p) if p.isdigit() else p for p in o.split(".")), transform))
    return rows
