"""Whether a DFlash layer attends causally inside its block: the keys of a head's config.json
that decide it, and what each reader makes of them, as one table (`CAUSALITY`).

The keys (a layer's type is `layer_types[i]`, "full_attention" when the list is absent; it sits
in `transformer_layer_config` (speculators) or at the top level (vLLM native), where vLLM's
speculators translation also puts it):
- `sliding_window_non_causal` (speculators, top level). speculators 0.9.0: sliding-window layers
  attend bidirectionally when true (default false: causally); full-attention layers always do.
- `dflash_config.causal` (vLLM native). vLLM's override for every layer.

vLLM (<= 0.34) reads them so:
- its speculators translation (`update_dflash`, vllm/transformers_utils/configs/speculators/
  algos.py) writes `dflash_config` anew with `causal = not sliding_window_non_causal` (absent:
  true), an override for every layer, full-attention layers included;
- its DFlash layer (`_dflash_layer_causal`, vllm/model_executor/models/qwen3_dflash.py) is causal
  when `dflash_config.causal` says so, else when its layer type is "sliding_attention".

So a speculators head with `sliding_window_non_causal: false` (speculators' default, which its
own `save_pretrained` writes) runs causally in vLLM where it was trained bidirectionally.
`meant` is the head as trained: speculators' rule for its format; for the native format the
z-lab rule (full-attention layers bidirectional, sliding ones causal unless
`dflash_config.causal` is false, or a speculators `sliding_window_non_causal: true` says so).
"""

from __future__ import annotations

from typing import NamedTuple

from peagle_jax.config.fields import ConfigError

__all__ = [
    "FULL",
    "SLIDING",
    "ANY",
    "ABSENT",
    "SWNC_KEY",
    "CAUSAL_KEY",
    "CAUSALITY",
    "Causality",
    "layer_causality",
    "head_causality",
    "causality_keys",
]

FULL, SLIDING = "full_attention", "sliding_attention"
ABSENT = "absent"  # the key is not in the config
ANY = "any"  # the key plays no part in this row
SWNC_KEY = "sliding_window_non_causal"
CAUSAL_KEY = "dflash_config.causal"


class Causality(NamedTuple):
    fmt: str  # "speculators" | "vllm"
    layer: str  # FULL | SLIDING
    swnc: object  # sliding_window_non_causal: True | False | ABSENT | ANY
    causal: object  # dflash_config.causal: True | False | ABSENT | ANY
    vllm: bool  # vLLM <= 0.34 runs the layer causally
    meant: bool  # the head was trained causal there
    why: str = ""  # where vLLM and the head disagree: the reason


# why vLLM and the head disagree, for the lint's message
_EVERY_LAYER = "vLLM's speculators translation makes it dflash_config.causal for every layer, full attention included"
_DEFAULTS = "absent, vLLM's translation takes it as true, speculators as false"
_OVERRIDE = "vLLM applies it to every layer; DFlash trains full attention bidirectionally"
_IGNORED = "vLLM reads dflash_config.causal, not sliding_window_non_causal, in a native config"
# speculators' format: vLLM writes dflash_config anew, speculators never reads it (causal: ANY)
# native format: dflash_config.causal decides for vLLM; sliding_window_non_causal only for `meant`
CAUSALITY = (
    Causality("speculators", FULL, True, ANY, False, False),
    Causality("speculators", FULL, False, ANY, True, False, _EVERY_LAYER),
    Causality("speculators", FULL, ABSENT, ANY, False, False),
    Causality("speculators", SLIDING, True, ANY, False, False),
    Causality("speculators", SLIDING, False, ANY, True, True),
    Causality("speculators", SLIDING, ABSENT, ANY, False, True, _DEFAULTS),
    Causality("vllm", FULL, ANY, True, True, False, _OVERRIDE),
    Causality("vllm", FULL, ANY, False, False, False),
    Causality("vllm", FULL, ANY, ABSENT, False, False),
    Causality("vllm", SLIDING, ANY, True, True, True),
    Causality("vllm", SLIDING, ANY, False, False, False),
    Causality("vllm", SLIDING, True, ABSENT, True, False, _IGNORED),
    Causality("vllm", SLIDING, False, ABSENT, True, True),
    Causality("vllm", SLIDING, ABSENT, ABSENT, True, True),
)


def _fits(cell, value) -> bool:
    return cell == ANY or cell == value


def layer_causality(fmt: str, layer: str, swnc=ABSENT, causal=ABSENT) -> Causality:
    """The table's row for one layer (each key True, False or ABSENT)."""
    rows = [
        r for r in CAUSALITY if (r.fmt, r.layer) == (fmt, layer) and _fits(r.swnc, swnc) and _fits(r.causal, causal)
    ]
    assert len(rows) == 1, (fmt, layer, swnc, causal, rows)  # the table covers each combination once
    return rows[0]


def head_causality(fmt: str, layer_types, keys: dict) -> list[Causality]:
    """The row of every layer of a head: `layer_types` one per layer (FULL where a config has
    none), `keys` the causality keys present (SWNC_KEY / CAUSAL_KEY -> bool)."""
    swnc, causal = keys.get(SWNC_KEY, ABSENT), keys.get(CAUSAL_KEY, ABSENT)
    return [layer_causality(fmt, t, swnc, causal) for t in layer_types]


def causality_keys(fmt: str, layer_types, meant) -> dict:
    """The keys to write so that vLLM and the trainer both run layer i causal exactly when
    `meant[i]`: an explicit value where one serves, else the key left out. ConfigError when no
    value of the format's key does (a causal sliding layer beside a full one, for speculators)."""
    key = SWNC_KEY if fmt == "speculators" else CAUSAL_KEY
    for value in (True, False) if fmt == "speculators" else (False, True, ABSENT):
        rows = head_causality(fmt, layer_types, {key: value})
        if all(r.vllm == r.meant == m for r, m in zip(rows, meant)):
            return {} if value == ABSENT else {key: value}
    raise ConfigError(
        f"no {key!r} makes vLLM (<= 0.34) run layers {list(layer_types)} causal as {list(meant)} in the "
        f"{fmt} format (its speculators translation applies one value to every layer); export --format vllm"
    )
