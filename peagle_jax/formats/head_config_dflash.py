"""The DFlash keys of a head's config.json, in both layouts (docs/method.md, "DFlash"):

- speculators (`speculators_model_type: "dflash"`, `architectures: ["DFlashSpeculator"]`):
  `block_size`, `mask_token_id`, `aux_hidden_state_layer_ids` (our convention: the residual
  entering target layer i), `sample_from_anchor`, `sliding_window_non_causal`; the layer
  shape in `transformer_layer_config`.
- the causality keys (`sliding_window_non_causal`, `dflash_config.causal`) are gathered under
  `causality`, as written; what they make of each layer is `peagle_jax.formats.dflash_causality`.
- vLLM native / z-lab (`architectures: ["DFlashDraftModel"]`): a Qwen3 config at the top level
  plus `block_size` (top level, or inside `dflash_config` in newer z-lab heads) and
  `dflash_config: {"mask_token_id", "target_layer_ids"}`. z-lab's `target_layer_ids` name the
  *output* of layer i, which is the residual entering layer i + 1: ours = theirs + 1. vLLM reads
  `eagle_aux_hidden_state_layer_ids` (ours) first and `target_layer_ids` + 1 otherwise; we write
  both, and a config holding both must have them agree.

`dflash_fields` gathers these keys leniently (the facts `head_config.head_facts` records);
`dflash_settings` checks them strictly (ConfigError naming the file and the key).
"""

from __future__ import annotations

from peagle_jax.config.fields import TOKEN, ConfigError, Field, check_fields
from peagle_jax.config.target_config import validate_aux_layer_ids
from peagle_jax.formats.dflash_causality import CAUSAL_KEY, SWNC_KEY

__all__ = [
    "DFLASH_ARCH",
    "DFLASH_SPECULATORS_ARCH",
    "DFLASH_TYPE",
    "TARGET_IDS_KEY",
    "SPEC_AUX_KEY",
    "EAGLE_AUX_KEY",
    "dflash_fields",
    "dflash_aux",
    "dflash_conflicts",
    "dflash_settings",
    "is_int_list",
]

DFLASH_ARCH = "DFlashDraftModel"  # vLLM's registry name (and z-lab's)
DFLASH_SPECULATORS_ARCH = "DFlashSpeculator"
DFLASH_TYPE = "dflash"  # speculators_model_type
TARGET_IDS_KEY = "dflash_config.target_layer_ids"  # z-lab / vLLM: ours - 1
SPEC_AUX_KEY = "aux_hidden_state_layer_ids"  # speculators: ours
EAGLE_AUX_KEY = "eagle_aux_hidden_state_layer_ids"  # what vLLM reads first: ours
FLAG_KEYS = ("sample_from_anchor",)


def is_int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _present(pairs) -> dict:
    return {k: v for k, v in pairs if v is not None}


def dflash_fields(raw: dict, fmt: str) -> dict:
    """The DFlash keys of a config as written: mask_ids, aux_ids, block_sizes, causality (key ->
    value, the keys present only) and flags (sample_from_anchor; use_swa)."""
    swnc = {SWNC_KEY: raw[SWNC_KEY]} if SWNC_KEY in raw else {}  # null included: vLLM reads it so
    if fmt == "speculators":
        return {
            "mask_ids": _present([("mask_token_id", raw.get("mask_token_id"))]),
            "aux_ids": _present([(SPEC_AUX_KEY, raw.get(SPEC_AUX_KEY))]),
            "block_sizes": _present([("block_size", raw.get("block_size"))]),
            "flags": _present((k, raw.get(k)) for k in FLAG_KEYS),
            "causality": swnc,  # vLLM's translation writes dflash_config anew
        }
    inner = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    return {  # vLLM: dflash_config's mask id first, then the top-level one
        "mask_ids": _present(
            [("dflash_config.mask_token_id", inner.get("mask_token_id")), ("mask_token_id", raw.get("mask_token_id"))]
        ),
        "aux_ids": _present([(EAGLE_AUX_KEY, raw.get(EAGLE_AUX_KEY)), (TARGET_IDS_KEY, inner.get("target_layer_ids"))]),
        "block_sizes": _present(
            [("block_size", raw.get("block_size")), ("dflash_config.block_size", inner.get("block_size"))]
        ),
        "flags": _present([("use_swa", inner.get("use_swa"))]),
        "causality": {**swnc, **({CAUSAL_KEY: inner["causal"]} if "causal" in inner else {})},
    }


def dflash_aux(aux_ids: dict):
    """The context layer ids vLLM uses, in our convention: eagle_aux_hidden_state_layer_ids /
    aux_hidden_state_layer_ids as written, else z-lab's target_layer_ids + 1. None when absent;
    a malformed value is returned as written (the checks report it)."""
    for key in (EAGLE_AUX_KEY, SPEC_AUX_KEY):
        if key in aux_ids:
            return aux_ids[key]
    native = aux_ids.get(TARGET_IDS_KEY)
    return [i + 1 for i in native] if is_int_list(native) else native


def dflash_conflicts(fields: dict) -> list[str]:
    """Facts a DFlash config states twice, differently."""
    out = []
    blocks = fields["block_sizes"]
    if len({str(v) for v in blocks.values()}) > 1:
        out.append(f"the block size keys disagree: {blocks}")
    aux = fields["aux_ids"]
    if EAGLE_AUX_KEY in aux and TARGET_IDS_KEY in aux and is_int_list(aux[TARGET_IDS_KEY]):
        if aux[EAGLE_AUX_KEY] != [i + 1 for i in aux[TARGET_IDS_KEY]]:
            out.append(
                f"{EAGLE_AUX_KEY!r} {aux[EAGLE_AUX_KEY]} is not {TARGET_IDS_KEY!r} {aux[TARGET_IDS_KEY]} + 1 "
                "(z-lab ids name a layer's output, the residual entering the next layer)"
            )
    return out


def _block_size(blocks: dict, where: str) -> int:
    if not blocks:
        raise ConfigError(f"{where}: missing key 'block_size' (a DFlash head drafts block_size - 1 tokens a pass)")
    key, value = next(iter(blocks.items()))
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise ConfigError(
            f"{where}: key {key!r} must be an int >= 2 (the bonus token and at least one mask slot), got {value!r}"
        )
    return value


def _aux_ids(aux: dict, fmt: str, where: str) -> tuple[int, ...]:
    if not aux:
        key = SPEC_AUX_KEY if fmt == "speculators" else TARGET_IDS_KEY
        raise ConfigError(f"{where}: missing key {key!r} (the target layers a DFlash head reads)")
    for key, value in aux.items():
        check_fields({key: value}, {key: Field("int_list", required=True)}, where)
        validate_aux_layer_ids(value, where=f"{where} key {key!r}", count=None)
    return tuple(dflash_aux(aux))


def dflash_settings(fields: dict, fmt: str, where: str, vocab_size: int) -> dict:
    """block_size, mask_token_id and aux_layer_ids (ours) of a DFlash config, checked;
    ConfigError naming `where` and the key."""
    conflicts = dflash_conflicts(fields)
    if conflicts:
        raise ConfigError(f"{where}: {conflicts[0]}")
    block = _block_size(fields["block_sizes"], where)
    masks = fields["mask_ids"]
    if not masks:
        key = "mask_token_id" if fmt == "speculators" else "dflash_config.mask_token_id"
        raise ConfigError(f"{where}: missing key {key!r} (the token of a block's mask slots)")
    if len({str(v) for v in masks.values()}) > 1:
        raise ConfigError(f"{where}: the mask token keys disagree: {masks}")
    key, mask = next(iter(masks.items()))
    check_fields({key: mask}, {key: TOKEN}, where, bounds={"vocab_size": vocab_size})
    if fields["flags"].get("sample_from_anchor"):
        raise ConfigError(
            f"{where}: key 'sample_from_anchor' is true; this project's DFlash heads draft from the mask "
            "slots only (the anchor is the bonus token, as vLLM serves DFlash)"
        )
    for key, value in fields["causality"].items():
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: key {key!r} must be true or false, got {value!r}")
    return {"block_size": block, "mask_token_id": mask, "aux_layer_ids": _aux_ids(fields["aux_ids"], fmt, where)}
