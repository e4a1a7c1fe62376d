"""`--model.init_head HEAD`: fine-tune an existing head instead of training a fresh one.

The head (ours, a vLLM or speculators folder, or a Hub id: `peagle_jax.load_drafter`) brings its
shapes, mode, draft vocabulary and layer settings: `adopt_head` writes them into model.* once the
command line is read (`train.flags.parse_args`; the head's config alone is read, no weight), so
the run's checks, its saved config.json and its summary speak of the head it trains. A flag the
user gave (on the command line or in --config) that says otherwise is a usage error naming both.
`load_head` then loads its weights for the `Trainer`, checked against the target as the engine
checks a head it drafts with, and recorded as a head of this target trained at this run's depth.
"""

from __future__ import annotations

import dataclasses

from peagle_jax.runtime.command_line import UsageError, one_line
from train.config import draft_vocab_size
from train.target_checks import TrainError

__all__ = ["adopt_head", "head_settings", "load_head"]


def head_settings(c) -> dict:
    """The model.* values a head of DrafterConfig `c` was made with (what `new_drafter` would
    need to make a head of its shapes)."""
    sliding = {i for i, kind in enumerate(c.layer_types) if kind == "sliding_attention"}
    window = c.sliding_window if sliding else None
    out = {
        "mode": c.mode,
        "num_layers": c.num_layers,
        "draft_vocab": 0 if c.draft_vocab_size == c.vocab_size else c.draft_vocab_size,
        "sliding_window": window,
        "full_attention_layers": tuple(i for i in range(c.num_layers) if i not in sliding) if window else (),
    }
    if c.mode == "dflash":
        out.update(block_size=c.block_size, sliding_window_non_causal=c.sliding_window_non_causal)
    else:
        flags = ("fc_norm", "norm_before_fc", "qk_norm", "norm_before_residual")
        out.update({name: getattr(c, name) for name in flags})
    if c.mode != "chain":
        out["mask_token_id"] = c.mask_token_id
    return out


def _agrees(name: str, mine, theirs, c) -> bool:
    if name == "draft_vocab":  # 0, unset and the vocabulary's size may all mean the whole vocabulary
        return draft_vocab_size(mine, c.vocab_size) == c.draft_vocab_size
    if name == "mask_token_id" and mine is None:  # unset: whatever the head has
        return True
    return mine == theirs


def head_config(name: str):
    """The DrafterConfig of the head `name` (a folder or a Hub id, downloaded once); a UsageError
    naming the flag when it is no head."""
    from peagle_jax.formats import read_drafter_config
    from peagle_jax.sources.hub import resolve

    try:
        return read_drafter_config(resolve(name, "head"))
    except (OSError, ValueError) as err:  # no folder, no head, a bad config, a Hub id out of reach
        raise UsageError(f"--model.init_head {name}: {one_line(err)}") from None


def adopt_head(cfg, given=frozenset()):
    """`cfg` with model.* set to model.init_head's settings (`head_settings`); cfg itself without
    one. `given`: the dotted fields the user set ("model.num_layers"): one of them that differs
    from the head's is a UsageError naming both. Settings that only make a fresh head
    (model.init_layer, model.norm_from_target) are refused beside it."""
    mc = cfg.model
    if mc.init_head is None:
        return cfg
    for flag, value in (("init_layer", mc.init_layer), ("norm_from_target", mc.norm_from_target)):
        if value not in (None, False):
            raise UsageError(
                f"--model.{flag} {value} sets up a fresh head; --model.init_head {mc.init_head} starts from a "
                "trained one: drop one of them"
            )
    c = head_config(mc.init_head)
    settings = head_settings(c)
    for name, theirs in settings.items():
        mine = getattr(mc, name)
        if f"model.{name}" in given and not _agrees(name, mine, theirs, c):
            shown = " ".join(map(str, mine)) if isinstance(mine, tuple) else mine
            raise UsageError(
                f"--model.{name} {shown} contradicts --model.init_head {mc.init_head}, whose {name} is {theirs}: "
                "a fine-tune keeps its head's (drop the flag, or train a fresh head)"
            )
    return dataclasses.replace(cfg, model=dataclasses.replace(mc, **settings))


def load_head(mc, target):
    """model.init_head's head for `target` in model.dtype, to train: it must fit the target (its
    hidden size, vocabulary and aux layers: `peagle_jax.engine.check_drafter`, a TrainError
    otherwise); it is recorded as this target's (verifier, model type, aux layers) and trained
    at model.k_train (DFlash: its block's drafts)."""
    import peagle_jax as pj
    from peagle_jax.engine import check_drafter
    from peagle_jax.handles.drafter import Drafter
    from peagle_jax.sources.hub import repo_id_of

    head = pj.load_drafter(mc.init_head, target=target, dtype=mc.dtype)
    c = head.config
    try:
        check_drafter(c, target.config, c.mode, 1, "warn")
    except ValueError as err:
        where = getattr(target, "path", None) or "the target"
        raise TrainError(f"model.init_head {mc.init_head} does not fit the target {where}: {err}") from None
    path = getattr(target, "path", None)
    config = dataclasses.replace(
        c,
        aux_layer_ids=c.aux_layer_ids if c.aux_layer_ids is not None else tuple(target.aux_layer_ids),
        k_train=c.block_size - 1 if c.mode == "dflash" else mc.k_train,
        target_model_type=target.config.model_type,
        verifier=None if path is None else repo_id_of(path) or str(path),
        dummy_target=getattr(target, "load_format", "auto") == "dummy",
    )
    return Drafter.from_arrays(config, head.arrays(), mc.dtype)
