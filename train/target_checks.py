"""A training configuration checked against the loaded target: what its head cannot be
(`check_target`: a `TrainError`, exit 1) and what one step cannot fit in memory
(`check_target_fits`, `step_bytes`)."""

from __future__ import annotations

import os

from peagle_jax.runtime.command_line import UsageError
from train.config import DEFAULT_DRAFT_VOCAB, draft_vocab_size

GIB = 2**30


class TrainError(ValueError):
    """A run that cannot start or continue (one-line message)."""


def check_target(cfg, target, where) -> None:
    """TrainError naming `where` (the target folder) when cfg.model cannot train on this target."""
    mc, v = cfg.model, target.config.vocab_size
    if mc.draft_vocab is not None and mc.draft_vocab > v:
        raise TrainError(
            f"model.draft_vocab={mc.draft_vocab} exceeds the target's vocabulary of {v}: lower --model.draft_vocab, "
            f"or leave it unset ({DEFAULT_DRAFT_VOCAB}, or the whole vocabulary when smaller)"
        )
    if mc.mask_token_id is not None and not 0 <= mc.mask_token_id < v:
        raise TrainError(f"model.mask_token_id={mc.mask_token_id} is outside the target's vocabulary [0, {v})")
    n = target.config.num_layers
    if mc.init_layer is not None and (mc.mode == "dflash" or not -n <= mc.init_layer < n):
        why = "a DFlash head has no fused first layer" if mc.mode == "dflash" else f"valid: {-n} .. {n - 1}"
        raise TrainError(f"model.init_layer={mc.init_layer}: {where} has {n} layers ({why})")
    if target.config.num_layers < 4:
        raise TrainError(f"{where}: a target of {target.config.num_layers} layers has no 3 distinct aux layers")


def step_bytes(cfg, tc) -> int:
    """A rough lower estimate of the memory one training step needs (bytes): the batch's target
    features and the head's rows (activations, their gradients, the draft logits), plus the dense
    attention scores. It is meant to catch settings off by orders of magnitude before a compile
    that would fail minutes later, not to size a run."""
    from kernels import DENSE_MAX_ROWS  # after the target loaded: jax is in already

    m, d = cfg.model, cfg.data
    b, t, h = d.batch_size, d.max_len, tc.hidden_size
    vd = draft_vocab_size(m.draft_vocab, tc.vocab_size)
    if m.mode == "dflash":
        anchors = max(1, min(512 if d.max_anchors is None else d.max_anchors, t - m.block_size))
        rows, keys = anchors * m.block_size, t + anchors * m.block_size
    else:
        rows = int(d.row_factor * t) * (m.k_train if m.mode == "chain" else 1)
        keys = rows
    floats = t * h * 4  # the target features the head reads (aux states, the final hidden)
    floats += rows * (8 * h * m.num_layers + 3 * vd)  # the head's activations and gradients, the logits
    dense = m.attention == "dense" or (m.attention == "auto" and rows <= DENSE_MAX_ROWS)
    if dense:
        floats += 2 * rows * keys * max(1, tc.num_heads) * m.num_layers  # scores and their gradient
    return 4 * b * floats


def memory_limit() -> int | None:
    """Bytes one device can hold: the accelerator's limit, or the host's memory on CPU."""
    import jax

    dev = jax.local_devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_target_fits(cfg, tc, where, limit: int | None = None, shards: int = 1) -> None:
    """UsageError (exit 2, naming the flag) for settings the target `tc` cannot train with: a DFlash
    block longer than the target's positions, or a step far beyond one device's memory (`limit`,
    bytes: found when None; the batch split over `shards` devices)."""
    m, d = cfg.model, cfg.data
    maxpos = tc.max_position_embeddings
    if m.mode == "dflash" and m.block_size > maxpos:
        raise UsageError(
            f"--model.block-size {m.block_size} exceeds the {maxpos} positions of the target {where} "
            "(max_position_embeddings)"
        )
    limit = memory_limit() if limit is None else limit
    need = step_bytes(cfg, tc) // max(1, shards)
    if limit and need > limit:
        flags = "--data.batch-size or --data.max-len" if d.batch_size > 1 else "--data.max-len"
        if m.mode == "dflash":
            flags = flags.replace(" or ", ", ") + " or --model.block-size"
        raise UsageError(
            f"one step of --data.batch-size {d.batch_size} x --data.max-len {d.max_len}"
            + (f" (--model.block-size {m.block_size})" if m.mode == "dflash" else "")
            + f" needs about {need / GIB:.3g} GiB, more than the {limit / GIB:.3g} GiB of this device: lower {flags}"
        )
