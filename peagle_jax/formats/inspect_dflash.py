"""The lint's DFlash rules (`peagle_jax.formats.inspect` calls them for a head whose mode is "dflash"):
what vLLM's `DFlashDraftModel` needs of a head folder beyond the shared checks.

- `block_size` an int >= 2 (vLLM drafts block_size - 1 tokens a pass), `sample_from_anchor` off.
- A mask token id inside the vocabulary (the token of every mask slot).
- Context layers: distinct non-negative ids in layer order (fc reads one target state each);
  a vLLM-native head without `eagle_aux_hidden_state_layer_ids` relies on vLLM's
  `dflash_config.target_layer_ids` + 1 fallback (a note).
- Causality: a layer vLLM (<= 0.34) runs causally where the head was trained bidirectionally, or
  the other way round (`dflash_causality.CAUSALITY`: speculators' `sliding_window_non_causal:
  false`, its own default, makes vLLM run full-attention layers causally).
- embed_tokens / a full-vocabulary lm_head may be absent: vLLM shares the target's (notes). The
  tensor table itself (every layer tensor, fc [H, n*Ht], d2t against the vocabulary) is the
  importer's `checkpoints.check_tensors`, as for every head.

`fnd`: the lint's findings (problem / warn / note methods).
"""

from __future__ import annotations

import dataclasses
import json

from peagle_jax.config.fields import ConfigError
from peagle_jax.formats.dflash_causality import CAUSAL_KEY, FULL, SWNC_KEY, causality_keys, head_causality
from peagle_jax.formats.head_config import HeadFacts, layer_windows
from peagle_jax.formats.head_config_dflash import (
    EAGLE_AUX_KEY,
    SPEC_AUX_KEY,
    TARGET_IDS_KEY,
    dflash_conflicts,
    is_int_list,
)

__all__ = ["check_dflash", "dflash_tensor_findings", "settled_dflash", "serve_depth"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def serve_depth(f: HeadFacts):
    """num_speculative_tokens of a DFlash head: block_size - 1 (None when the block is unusable)."""
    b = f.block_size
    return b - 1 if _is_int(b) and b >= 2 else None


def check_dflash(f: HeadFacts, fnd) -> bool:
    """The DFlash config rules; True when the context-layer ids are usable (checked against the
    target then)."""
    d = f.dflash
    b = f.block_size
    if not d["block_sizes"]:
        fnd.problem("no block_size: vLLM's DFlash proposer needs it (block_size - 1 drafts a pass)")
    elif serve_depth(f) is None:
        fnd.problem(f"block_size {b!r} must be an int >= 2 (the bonus token and at least one mask slot)")
    if d["flags"].get("sample_from_anchor"):
        fnd.problem(
            "sample_from_anchor is true: vLLM's DFlash proposer drafts from the mask slots only "
            "(the anchor is the bonus token)"
        )
    _check_mask(f, fnd)
    _check_causality(f, fnd)
    return _check_context_layers(f, fnd)


def _check_causality(f: HeadFacts, fnd) -> None:
    """Layers vLLM (<= 0.34) runs with another causality than the head was trained with: one
    problem per disagreeing row of `dflash_causality.CAUSALITY`, naming the key and the fix."""
    keys = f.dflash["causality"]
    bad = {k: v for k, v in keys.items() if not isinstance(v, bool)}
    if bad:
        return fnd.problem(f"causality key(s) {bad} must be true or false")
    try:
        types, _ = layer_windows(f.layer, f.layer_where, f.sizes["num_hidden_layers"])
    except ConfigError:
        return  # reported with the windows
    types = types or (FULL,) * f.sizes["num_hidden_layers"]
    rows = head_causality(f.fmt, types, keys)
    for row in dict.fromkeys(r for r in rows if r.vllm != r.meant):
        fnd.problem(_causality_message(f, row, [i for i, r in enumerate(rows) if r == row], types, rows))


def _causality_message(f: HeadFacts, row, layers: list, types, rows) -> str:
    key = SWNC_KEY if f.fmt == "speculators" or CAUSAL_KEY not in f.dflash["causality"] else CAUSAL_KEY
    value = json.dumps(f.dflash["causality"][key]) if key in f.dflash["causality"] else "absent"
    how = {True: "causally", False: "bidirectionally"}
    try:
        fix = causality_keys(f.fmt, types, [r.meant for r in rows])
        fix_text = f"write {json.dumps(fix)}" if fix else f"remove {CAUSAL_KEY!r}"
        if all(t == FULL for t in types):
            fix_text += " (`peagle-convert export` rewrites it so)"
    except ConfigError as err:
        fix_text = str(err)
    return (
        f"{key} {value}: vLLM (<= 0.34) runs {row.layer} layers {layers} {how[row.vllm]} inside the block, "
        f"but the head was trained {how[row.meant]} there ({row.why}); fix: {fix_text}"
    )


def _check_mask(f: HeadFacts, fnd) -> None:
    v, mask = f.sizes["vocab_size"], f.mask_id
    if mask is None:
        key = "mask_token_id" if f.fmt == "speculators" else "dflash_config.mask_token_id"
        fnd.problem(f"no mask token id ({key}): a DFlash head fills its blocks' mask slots with it")
    elif len({str(x) for x in f.mask_ids.values()}) > 1:
        return  # a conflict, reported
    elif not _is_int(mask) or not 0 <= mask < v:
        fnd.problem(f"mask token id {mask!r} ({', '.join(sorted(f.mask_ids))}) outside the vocabulary [0, {v})")


def _check_context_layers(f: HeadFacts, fnd) -> bool:
    if dflash_conflicts(f.dflash):
        return False  # reported with the config's conflicts
    if not f.aux_ids:
        key = SPEC_AUX_KEY if f.fmt == "speculators" else TARGET_IDS_KEY
        fnd.problem(f"no {key}: the target layers a DFlash head reads (fc takes one state per layer)")
        return False
    aux = f.aux
    if not is_int_list(aux) or len(set(aux)) != len(aux) or aux != sorted(aux) or min(aux, default=0) < 0:
        shown = ", ".join(f"{k} {v!r}" for k, v in f.aux_ids.items())
        fnd.problem(f"context layers ({shown}) must be distinct non-negative layer ids in layer order")
        return False
    if f.fmt == "vllm" and EAGLE_AUX_KEY not in f.aux_ids:
        fnd.note(
            f"no {EAGLE_AUX_KEY}: vLLM reads {TARGET_IDS_KEY} + 1 = {aux} (releases without that fallback "
            "would use the target's default EAGLE-3 layers)"
        )
    return True


def dflash_tensor_findings(keys: set, full_vocab: bool, fnd) -> None:
    """Notes on the target-shared tensors a DFlash folder leaves out (a reduced vocabulary's
    missing lm_head is the tensor table's problem)."""
    if "embed_tokens.weight" not in keys:
        fnd.note("no 'embed_tokens.weight': vLLM shares the target's embeddings (DFlash trains with them frozen)")
    if "lm_head.weight" not in keys and full_vocab:
        fnd.note("no 'lm_head.weight': vLLM shares the target's lm_head (a full-vocabulary DFlash head)")


def settled_dflash(f: HeadFacts) -> HeadFacts | None:
    """`f` with a reported bad block size, mask id or set of context layers replaced by a valid
    one, so the tensor table can still be checked without reporting them again (the context
    layers keep their count: it sets fc's width). None when the count is unknown (no usable list:
    reported, and the table cannot be checked)."""
    v = f.sizes["vocab_size"]
    mask = f.mask_id if _is_int(f.mask_id) and 0 <= f.mask_id < v else 0
    block = f.block_size if serve_depth(f) is not None else 2
    aux_ids = f.aux_ids
    if not _usable_context_layers(f):
        if not isinstance(f.aux, list) or not f.aux:
            return None
        aux_ids = {EAGLE_AUX_KEY if f.fmt == "vllm" else SPEC_AUX_KEY: list(range(1, len(f.aux) + 1))}
    fields = {
        **f.dflash,
        "mask_ids": {"mask_token_id": mask},
        "block_sizes": {"block_size": block},
        "aux_ids": aux_ids,
        "flags": {},
        "causality": {},
    }
    return dataclasses.replace(f, mask_ids=fields["mask_ids"], aux_ids=aux_ids, dflash=fields)


def _usable_context_layers(f: HeadFacts) -> bool:
    """What `_check_context_layers` accepts (without reporting): one agreed, well-formed list."""
    aux = f.aux
    return (
        not dflash_conflicts(f.dflash)
        and bool(f.aux_ids)
        and is_int_list(aux)
        and len(set(aux)) == len(aux)
        and aux == sorted(aux)
        and min(aux, default=0) >= 0
    )
