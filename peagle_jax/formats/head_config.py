"""config.json of vLLM-native and speculators drafter heads <-> `DrafterConfig` (docs/method.md section 6).

`head_facts` reads a head's config.json once, leniently: what it says and where it says it (the
layer config's location, mask-id keys, aux ids at the top level or in `eagle_config`, K hints,
verifier, norm flags). The strict reader (`drafter_config`, `read_vllm_config`,
`read_speculators_config`) validates those facts into a DrafterConfig and raises ConfigError
naming the file and key; the checkpoint lint (`peagle_jax.formats.inspect`) turns the same facts into
problems and warnings; `peagle_jax.formats.head_config_write` writes them back. Constants: the
vLLM architectures of heads, speculators types, MASK_ID_KEYS, AUX_KEY, LAYER_FLAGS.

Semantics taken from vLLM (the serving contract) where the tools differ:
- `norm_before_residual` missing from a speculators config defaults to True for "eagle3" and
  False for "peagle" (vLLM's speculators config translation); missing from a vLLM-native config it is False.
- `norm_before_fc` is read from `eagle_config` first, then the top level (vLLM).
- speculators `fc_norm` / `norm_output`: vLLM builds the head from `transformer_layer_config`, and
  its peagle translation does not forward these top-level keys, so they are written in both places
  and read from the layer config first (the two must agree).
- Sliding-window layers: the layer config's `layer_types` ("full_attention" |
  "sliding_attention" per drafter layer) and `sliding_window`, the keys vLLM's Llama attention
  reads per draft layer (`layer_types[layer_idx - target_layer_count]`); speculators 0.9.0 writes
  them with `use_sliding_window`, which must agree with them (`layer_windows`).
- DFlash heads (speculators_model_type "dflash", vLLM architecture `DFlashDraftModel`): the same
  facts plus `HeadFacts.dflash` (block size, mask id and context-layer keys as written), read
  and checked by `peagle_jax.formats.head_config_dflash` (z-lab's target_layer_ids are ours - 1).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.fields import (
    HEAD_FIELDS,
    HEAD_LAYER_FIELDS,
    LAYER_TYPES,
    ConfigError,
    check_attention,
    check_fields,
    read_json,
)
from peagle_jax.config.target_config import NUM_AUX, RopeConfig, validate_aux_layer_ids
from peagle_jax.formats.dflash_causality import SLIDING, head_causality
from peagle_jax.formats.head_config_dflash import (
    DFLASH_ARCH,
    DFLASH_TYPE,
    dflash_aux,
    dflash_conflicts,
    dflash_fields,
    dflash_settings,
)
from peagle_jax.formats.own import OWN_CONFIG_FILE
from peagle_jax.models.registry import ARCHITECTURES
from peagle_jax.runtime.folders import CONFIG_FILE

__all__ = [
    "HeadFacts",
    "head_facts",
    "head_kind",
    "refuse_head",
    "drafter_config",
    "read_vllm_config",
    "read_speculators_config",
    "rope_params",
    "layer_windows",
]

# vLLM registry names of EAGLE-3 style heads -> whether the layers are Qwen3 (q/k norms)
VLLM_ARCHITECTURES = {
    **dict.fromkeys(("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "PeagleLlamaForCausalLM"), False),
    **dict.fromkeys(("Eagle3Qwen3ForCausalLM", "PeagleQwen3ForCausalLM"), True),
}
SPECULATORS_TYPES = {"peagle": "parallel", "eagle3": "chain"}
SPECULATORS_ARCH = {"peagle": "PEagleSpeculator", "eagle3": "Eagle3Speculator"}
SPECULATORS_VERSION = "0.9.0"
MASK_ID_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")  # vLLM releases read different ones
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
AUX_INNER = f"eagle_config.{AUX_KEY}"
LAYER_FLAGS = ("fc_norm", "norm_output")  # speculators: top level and inside transformer_layer_config
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
EXTRA_KEY = "peagle_jax"  # our own fields in a vLLM config.json (mode, k_train, ...)
DEFAULT_K_TRAIN = 8  # COD depth of the reference recipe, recorded when a head names none


@dataclasses.dataclass(frozen=True)
class HeadFacts:
    """What a vLLM / speculators config.json says, as written (absent keys left out or None)."""

    where: str  # the config file, for messages
    fmt: str  # "vllm" | "speculators"
    kind: str  # the vLLM architecture name, or the speculators_model_type
    layer: dict  # the Llama layer fields: the config itself (vLLM) or transformer_layer_config
    layer_where: str
    sizes: dict  # SIZE_KEYS -> positive int (checked: without them a config is no head)
    mode: str | None  # when the config says (speculators type, our extra); None: by the mask id
    mask_ids: dict  # mask-id key -> value, over the keys this format reads
    aux_ids: dict  # AUX_KEY / AUX_INNER -> value
    draft_vocab_size: object
    target_hidden_size: object
    k_hints: dict  # every recorded depth: speculative_tokens, k_train, num_speculative_tokens, ...
    k_train: object  # the trained depth the strict reader records
    verifier: object  # the target's name or path
    target_family: str | None
    norm_before_residual: object  # as written, else vLLM's default for this format and kind
    norm_before_fc: object
    layer_flags: dict  # LAYER_FLAGS name -> {"top": value, "layer": value}, places present only
    use_aux_hidden_state: object
    dflash: dict | None = None  # a DFlash head's keys as written (`head_config_dflash.dflash_fields`)

    @property
    def mask_id(self):
        return next(iter(self.mask_ids.values()), None)

    @property
    def block_size(self):
        """A DFlash head's block size as written (None: not a DFlash head, or none written)."""
        return next(iter(self.dflash["block_sizes"].values()), None) if self.dflash else None

    @property
    def aux(self):
        """The aux ids vLLM uses: the top-level key, else the one inside eagle_config (DFlash:
        `head_config_dflash.dflash_aux`, in our convention)."""
        if self.dflash is not None:
            return dflash_aux(self.aux_ids)
        return self.aux_ids.get(AUX_KEY, self.aux_ids.get(AUX_INNER))

    def flag(self, name: str):
        """A layer flag's value as vLLM builds the head: the layer config's, else the top level's."""
        places = self.layer_flags.get(name, {})
        return places.get("layer", places.get("top", False))

    def conflicts(self) -> list[str]:
        """Facts the config states twice, differently (the strict reader raises on the first)."""
        out = []
        if len({str(v) for v in self.mask_ids.values()}) > 1:
            out.append(f"the mask token keys disagree: {self.mask_ids}")
        if self.dflash is not None:
            return out + dflash_conflicts(self.dflash)
        if len(self.aux_ids) == 2 and self.aux_ids[AUX_KEY] != self.aux_ids[AUX_INNER]:
            out.append(f"{AUX_KEY!r} {self.aux_ids[AUX_KEY]} differs from {AUX_INNER!r} {self.aux_ids[AUX_INNER]}")
        for name, places in self.layer_flags.items():
            if len(places) == 2 and places["top"] != places["layer"]:
                out.append(
                    f"key {name!r} is {places['top']!r} at the top level but {places['layer']!r} in "
                    "'transformer_layer_config'"
                )
        return out


def head_kind(folder: str | os.PathLike) -> str | None:
    """What drafter head a folder holds, in words ("a drafter head in this project's format
    (drafter.json)", "a vLLM drafter head (architectures [...])", "a speculators drafter head
    (speculators_model_type ...)"), None when it holds none."""
    p = Path(folder)
    if (p / OWN_CONFIG_FILE).is_file():
        return f"a drafter head in this project's format ({OWN_CONFIG_FILE})"
    try:
        raw = read_json(p / CONFIG_FILE)
    except (ConfigError, OSError):
        return None
    if "speculators_model_type" in raw:
        return f"a speculators drafter head (speculators_model_type {raw['speculators_model_type']!r})"
    arch = raw.get("architectures")
    heads = [a for a in arch if a in VLLM_ARCHITECTURES or a == DFLASH_ARCH] if isinstance(arch, list) else []
    return f"a vLLM drafter head (architectures {heads})" if heads else None


RUN_SECTIONS = ("model", "data", "optim", "loop")  # a training run's config.json (`python -m train`'s OUT)


def is_run_config(raw) -> bool:
    """`raw` (a config.json's content) is a training run's settings, not a model's."""
    return isinstance(raw, dict) and all(isinstance(raw.get(s), dict) for s in RUN_SECTIONS)


def run_folder_of(folder: str | os.PathLike) -> str | None:
    """The words for a training run's folder (`python -m train`'s --out), None for any other."""
    p = Path(folder)
    try:
        raw = read_json(p / CONFIG_FILE)
    except (ConfigError, OSError):
        return None
    if not is_run_config(raw):
        return None
    return f"a training run's folder (python -m train --out: its head is {p / 'head'}, its vLLM export {p / 'vllm'})"


def refuse_head(folder: str | os.PathLike) -> None:
    """ConfigError naming a drafter head's folder, or a training run's, given where a target model
    is expected."""
    kind = head_kind(folder)
    if kind is not None:
        raise ConfigError(f"{folder}: {kind}, not a target model (a head is given as the drafter)")
    run = run_folder_of(folder)
    if run is not None:
        raise ConfigError(f"{folder}: {run}, not a target model")


def head_facts(raw: dict, where: str) -> HeadFacts:
    """The facts of a head's config.json. ConfigError naming `where` when it is no head at all:
    an unknown architecture or speculators type, no layer config, or a missing layer size."""
    if "speculators_model_type" in raw:
        kind = raw["speculators_model_type"]
        if kind not in SPECULATORS_TYPES and kind != DFLASH_TYPE:
            raise ConfigError(
                f"{where}: key 'speculators_model_type' is {kind!r} "
                f"(supported: {', '.join(SPECULATORS_TYPES)}, {DFLASH_TYPE})"
            )
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ConfigError(f"{where}: missing key 'transformer_layer_config'")
        facts = _speculators_facts(raw, where, kind, layer)
        return _as_dflash(facts, raw) if kind == DFLASH_TYPE else facts
    arch = raw.get("architectures") or []
    known = [a for a in arch if a in VLLM_ARCHITECTURES or a == DFLASH_ARCH] if isinstance(arch, list) else []
    if not known and is_run_config(raw):
        run = Path(where).parent
        raise ConfigError(f"{run}: a training run's folder, not a drafter head (its head is {run / 'head'})")
    if not known:
        raise ConfigError(
            f"{where}: key 'architectures' is {arch!r}, not a drafter head "
            f"(known: {', '.join(VLLM_ARCHITECTURES)}, {DFLASH_ARCH}, or a speculators config)"
        )
    facts = _vllm_facts(raw, where, known[0])
    return _as_dflash(facts, raw) if known[0] == DFLASH_ARCH else facts


def _as_dflash(f: HeadFacts, raw: dict) -> HeadFacts:
    """A DFlash head's facts: its own mask-id, context-layer and block-size keys, no EAGLE-3 norms."""
    fields = dflash_fields(raw, f.fmt)
    hints = dict(f.k_hints)
    block = next(iter(fields["block_sizes"].values()), None)
    if isinstance(block, int) and not isinstance(block, bool):
        hints["drafts_per_pass"] = block - 1
    return dataclasses.replace(
        f,
        mode="dflash",
        mask_ids=fields["mask_ids"],
        aux_ids=fields["aux_ids"],
        k_hints=hints,
        norm_before_residual=False,
        norm_before_fc=False,
        layer_flags={},
        use_aux_hidden_state=None,
        dflash=fields,
    )


def _sizes(layer: dict, where: str) -> dict:
    check_fields(layer, {k: HEAD_LAYER_FIELDS[k] for k in SIZE_KEYS}, where)
    return {k: layer[k] for k in SIZE_KEYS}


def _dict(raw: dict, key: str, where: str) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: key {key!r} must be a dict")
    return value


def _present(cfg: dict, keys) -> dict:
    return {k: cfg[k] for k in keys if cfg.get(k) is not None}


def _k_hints(raw: dict, extra: dict, first_method: dict) -> dict:
    hints = {}
    if first_method.get("speculative_tokens") is not None:
        hints["speculative_tokens"] = first_method["speculative_tokens"]
    if extra.get("k_train") is not None:
        hints["k_train"] = extra["k_train"]
    hints.update(_present(raw, ("num_speculative_tokens", "parallel_drafting_k", "k_train")))
    return hints


def _vllm_facts(raw: dict, where: str, arch: str) -> HeadFacts:
    eagle = _dict(raw, "eagle_config", where)
    extra = _dict(raw, EXTRA_KEY, where)
    aux = {k: v for k, v in ((AUX_KEY, raw.get(AUX_KEY)), (AUX_INNER, eagle.get(AUX_KEY))) if v is not None}
    return HeadFacts(
        where=where,
        fmt="vllm",
        kind=arch,
        layer=raw,
        layer_where=where,
        sizes=_sizes(raw, where),
        mode=extra.get("mode"),
        mask_ids=_present(raw, MASK_ID_KEYS),
        aux_ids=aux,
        draft_vocab_size=raw.get("draft_vocab_size"),
        target_hidden_size=raw.get("target_hidden_size"),
        k_hints=_k_hints(raw, extra, {}),
        k_train=extra.get("k_train"),
        verifier=extra.get("verifier"),
        target_family=extra.get("target_model_type"),
        norm_before_residual=raw.get("norm_before_residual", False),
        norm_before_fc=eagle.get("norm_before_fc", raw.get("norm_before_fc", False)),
        layer_flags={n: {"top": raw[n]} for n in LAYER_FLAGS if n in raw},
        use_aux_hidden_state=eagle.get("use_aux_hidden_state"),
    )


def _speculators_facts(raw: dict, where: str, kind: str, layer: dict) -> HeadFacts:
    layer_where = f"{where} key 'transformer_layer_config'"
    spec = _dict(raw, "speculators_config", where)
    methods = spec.get("proposal_methods") or [{}]
    first = methods[0] if isinstance(methods, list) and isinstance(methods[0], dict) else {}
    verifier = spec.get("verifier") if isinstance(spec.get("verifier"), dict) else {}
    archs = verifier.get("architectures") or []
    flags = {}
    for name in LAYER_FLAGS:
        places = {p: cfg[name] for p, cfg in (("top", raw), ("layer", layer)) if cfg.get(name) is not None}
        if places:
            flags[name] = places
    nbr = raw.get("norm_before_residual")
    return HeadFacts(
        where=where,
        fmt="speculators",
        kind=kind,
        layer=layer,
        layer_where=layer_where,
        sizes=_sizes(layer, layer_where),
        mode=SPECULATORS_TYPES.get(kind),
        mask_ids=_present(raw, ("mask_token_id",)),
        aux_ids=_present(raw, (AUX_KEY,)),
        draft_vocab_size=raw.get("draft_vocab_size"),
        target_hidden_size=raw.get("target_hidden_size"),
        k_hints=_k_hints(raw, {}, first),
        k_train=first.get("speculative_tokens"),
        verifier=verifier.get("name_or_path"),
        target_family=next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None),
        norm_before_residual=(kind == "eagle3") if nbr is None else nbr,
        norm_before_fc=raw.get("norm_before_fc", False),
        layer_flags=flags,
        use_aux_hidden_state=None,
    )


# ---------------------------------------------------------------------------------------
# strict: facts -> DrafterConfig
K_TRAIN_KEYS = {
    "vllm": f"{EXTRA_KEY}.k_train",
    "speculators": "speculators_config.proposal_methods[0].speculative_tokens",
}


def _or(value, default):
    return default if value is None else value


def _check_head_fields(f: HeadFacts) -> None:
    """The layer config against `config.HEAD_LAYER_FIELDS`, the head's own keys against
    `config.HEAD_FIELDS` (ids bounded by the vocabulary), the attention shape against
    `config.ATTENTION_RULES`: ConfigError naming the file and the key."""
    check_fields(f.layer, HEAD_LAYER_FIELDS, f.layer_where)
    own = {
        "draft_vocab_size": f.draft_vocab_size,
        "target_hidden_size": f.target_hidden_size,
        **f.mask_ids,
        K_TRAIN_KEYS[f.fmt]: f.k_train,
        "norm_before_residual": f.norm_before_residual,
        "norm_before_fc": f.norm_before_fc,
        **{n: places["top"] for n, places in f.layer_flags.items() if "top" in places},
    }
    spec = {**HEAD_FIELDS, K_TRAIN_KEYS[f.fmt]: HEAD_FIELDS["k_train"]}
    check_fields(own, spec, f.where, bounds={"vocab_size": f.sizes["vocab_size"]})
    hidden, heads = f.sizes["hidden_size"], f.sizes["num_attention_heads"]
    check_attention(
        f.layer_where,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=f.layer.get("num_key_value_heads") or heads,
        head_dim=f.layer.get("head_dim") or hidden // heads,
        head_dim_given=f.layer.get("head_dim") is not None,
    )


def rope_params(cfg: dict, where: str, *, flat: bool = False) -> dict:
    """The one rope dict of a config: v5 `rope_parameters` (for a per-layer-type dict, its
    `full_attention` entry, unless `flat` refuses those) or the older `rope_scaling` + `rope_theta`."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or (flat and "full_attention" in params):
            raise ConfigError(f"{where}: key 'rope_parameters' must be one flat rope dict")
        params = params.get("full_attention", params)
        return {"rope_theta": cfg.get("rope_theta", 10000.0), **params}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: key 'rope_scaling' must be a dict or null")
    return {**scaling, "rope_theta": cfg.get("rope_theta", 10000.0)}


def _layer_fields(f: HeadFacts) -> dict:
    """The Llama-layer fields of DrafterConfig, shared by both layouts."""
    tl, where, s = f.layer, f.layer_where, f.sizes
    if tl.get("mlp_bias"):
        raise ConfigError(f"{where}: key 'mlp_bias' is true; drafter MLPs have no bias (vLLM Llama heads)")
    layer_types, window = layer_windows(tl, where, s["num_hidden_layers"])
    rope_key = "rope_parameters" if tl.get("rope_parameters") is not None else "rope_scaling"
    hidden, heads = s["hidden_size"], s["num_attention_heads"]
    return dict(
        hidden_size=hidden,
        num_layers=s["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=_or(tl.get("num_key_value_heads"), heads),
        head_dim=_or(tl.get("head_dim"), hidden // heads),
        intermediate_size=s["intermediate_size"],
        vocab_size=s["vocab_size"],
        rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
        rope=RopeConfig.from_dict(rope_params(tl, where, flat=True), 10000.0, f"{where} key {rope_key!r}"),
        max_position_embeddings=_or(tl.get("max_position_embeddings"), 2048),
        attention_bias=bool(tl.get("attention_bias")),
        hidden_act=tl.get("hidden_act", "silu"),
        layer_types=layer_types,
        sliding_window=window,
    )


def layer_windows(layer: dict, where: str, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) of a head's layer config, checked: one known type per
    drafter layer, a window (an int >= 1) for sliding layers, and `use_sliding_window`, when
    written, true exactly when some layer slides. ConfigError naming `where` and the key."""
    types = layer.get("layer_types")
    if types is None:
        types = ()
    elif not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"{where}: key 'layer_types' must be a list of strings, got {types!r}")
    elif len(types) != num_layers:
        raise ConfigError(f"{where}: key 'layer_types' has {len(types)} entries, but num_hidden_layers is {num_layers}")
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise ConfigError(f"{where}: key 'layer_types' has unknown entries {bad} (known: {', '.join(LAYER_TYPES)})")
    sliding = "sliding_attention" in types
    window = layer.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ConfigError(f"{where}: key 'sliding_window' has invalid value {window!r} (an int >= 1)")
    if sliding and window is None:
        raise ConfigError(f"{where}: key 'layer_types' names sliding_attention layers but 'sliding_window' is not set")
    use = layer.get("use_sliding_window")
    if use is not None and (not isinstance(use, bool) or use != sliding):
        raise ConfigError(
            f"{where}: key 'use_sliding_window' is {use!r} but 'layer_types' "
            + ("names sliding_attention layers" if sliding else "names none (vLLM reads the window per layer from it)")
        )
    return tuple(types), window


def _qk_norm(f: HeadFacts) -> bool:
    if f.fmt == "vllm":
        return VLLM_ARCHITECTURES[f.kind]
    tl_type = f.layer.get("model_type", "llama")
    if tl_type not in ("llama", "qwen3"):
        raise ConfigError(f"{f.layer_where}: model_type {tl_type!r} unsupported (llama, qwen3)")
    return tl_type == "qwen3"


def _aux(f: HeadFacts):
    for key, value in f.aux_ids.items():
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{f.where}: key {key!r} must list {NUM_AUX} layer ids, got {value!r}")
        validate_aux_layer_ids(value, where=f"{f.where} key {key!r}")
    return None if f.aux is None else tuple(f.aux)


def drafter_config(f: HeadFacts) -> DrafterConfig:
    """The DrafterConfig of a head's facts; ConfigError naming the file and key on anything
    invalid. aux_layer_ids stay None when the config names none (see `checkpoints.read_drafter`)."""
    conflicts = f.conflicts()
    if conflicts:
        raise ConfigError(f"{f.where}: {conflicts[0]}")
    if f.use_aux_hidden_state is False:
        raise ConfigError(
            f"{f.where}: key 'eagle_config.use_aux_hidden_state' is false (EAGLE-1 heads are unsupported)"
        )
    _check_head_fields(f)
    layer = _layer_fields(f)
    if f.dflash is not None:
        return _dflash_config(f, layer)
    mask_id = f.mask_id
    if f.fmt == "speculators" and f.mode == "parallel" and mask_id is None:
        raise ConfigError(f"{f.where}: missing key 'mask_token_id' (required for a peagle head)")
    flags = {n: bool(f.flag(n)) for n in LAYER_FLAGS}
    aux, qk_norm = _aux(f), _qk_norm(f)  # their errors name the file already
    return DrafterConfig.build(
        f.where,
        **layer,
        target_hidden_size=_or(f.target_hidden_size, layer["hidden_size"]),
        draft_vocab_size=_or(f.draft_vocab_size, layer["vocab_size"]),
        mode=f.mode or ("parallel" if mask_id is not None else "chain"),
        mask_token_id=mask_id,
        aux_layer_ids=aux,
        k_train=f.k_train,
        norm_before_residual=bool(f.norm_before_residual),
        norm_before_fc=bool(f.norm_before_fc),
        qk_norm=qk_norm,
        target_model_type=f.target_family,
        verifier=f.verifier,
        **flags,
    )


def _dflash_config(f: HeadFacts, layer: dict) -> DrafterConfig:
    """The DrafterConfig of a DFlash head's facts (Qwen3 layers, hidden size = the target's)."""
    settings = dflash_settings(f.dflash, f.fmt, f.where, layer["vocab_size"])
    hidden = layer["hidden_size"]
    target_hidden = _or(f.target_hidden_size, hidden)
    if target_hidden != hidden:
        raise ConfigError(
            f"{f.where}: key 'target_hidden_size' is {target_hidden}, but a DFlash head's hidden_size "
            f"({hidden}) must equal the target's (its layers read the target's embeddings)"
        )
    return DrafterConfig.build(
        f.where,
        **layer,
        **settings,
        target_hidden_size=target_hidden,
        draft_vocab_size=_or(f.draft_vocab_size, layer["vocab_size"]),
        mode="dflash",
        k_train=f.k_train,
        qk_norm=True,
        sliding_window_non_causal=_non_causal(f, layer["layer_types"]),
        target_model_type=f.target_family,
        verifier=f.verifier,
    )


def _non_causal(f: HeadFacts, layer_types) -> bool:
    """A DFlash head's `sliding_window_non_causal`: its sliding layers were trained bidirectionally
    (`dflash_causality`'s `meant`, per format); False, the default, without a sliding layer."""
    if SLIDING not in layer_types:
        return False
    rows = head_causality(f.fmt, layer_types, f.dflash["causality"])
    return not rows[layer_types.index(SLIDING)].meant


def read_vllm_config(raw: dict, where: str) -> DrafterConfig:
    """DrafterConfig of a vLLM-native head's config.json (ConfigError naming `where` and the key)."""
    facts = head_facts(raw, where)
    if facts.fmt != "vllm":
        raise ConfigError(f"{where}: a speculators config, not a vLLM-native one")
    return drafter_config(facts)


def read_speculators_config(raw: dict, where: str) -> DrafterConfig:
    """DrafterConfig of a speculators config.json (ConfigError naming `where` and the key)."""
    if "speculators_model_type" not in raw:
        raise ConfigError(f"{where}: missing key 'speculators_model_type'")
    return drafter_config(head_facts(raw, where))
