"""The values of a training configuration checked before any work starts: ranges, finiteness and
choices, each refused with one line naming its flag (`peagle_jax.cli.UsageError`, exit 2).
`train.config.parse_args` runs `validate` on every command line."""

from __future__ import annotations

import math

from peagle_jax.cli import UsageError

__all__ = ["validate"]


def validate(cfg):
    """One-line UsageError naming the flag for values no run can use (before any work starts)."""
    for ok, msg in (*_choice_checks(cfg), *_model_data_checks(cfg), *_optim_loop_checks(cfg), *_eval_mesh_checks(cfg)):
        if not ok:
            raise UsageError(msg)
    return cfg


def _finite(x) -> bool:
    return math.isfinite(x)


def _choice_checks(cfg) -> list[tuple[bool, str]]:
    m, d = cfg.model, cfg.data
    return [
        (m.mode in ("parallel", "chain"), f"model.mode must be parallel or chain, got {m.mode!r}"),
        (m.dtype in ("float32", "bfloat16"), f"model.dtype must be float32 or bfloat16: {m.dtype!r}"),
        (m.compute_dtype in ("float32", "bfloat16"), "model.compute_dtype must be float32 or bfloat16"),
        (m.attention in ("auto", "kernels", "dense"), "model.attention must be auto, kernels or dense"),
        (d.length_buckets in (1, 2, 3), "data.length_buckets must be 1, 2 or 3"),
        (d.template in ("auto", "chat", "plain"), "data.template must be auto, chat or plain"),
        (d.too_long in ("truncate", "drop"), f"data.too_long must be truncate or drop: {d.too_long!r}"),
        (d.bad_rows in ("skip", "error"), f"data.bad_rows must be skip or error, got {d.bad_rows!r}"),
        (cfg.eval.export_dtype in ("float32", "bfloat16"), "eval.export_dtype must be float32 or bfloat16"),
    ]


def _model_data_checks(cfg) -> list[tuple[bool, str]]:
    m, d = cfg.model, cfg.data
    return [
        (m.num_layers >= 1, "model.num_layers must be >= 1"),
        (m.k_train >= 1, "model.k_train must be >= 1"),
        (m.draft_vocab >= 0, "model.draft_vocab must be >= 0"),
        (m.mask_token_id is None or m.mask_token_id >= 0, "model.mask_token_id must be >= 0"),
        (d.max_conversations >= 0, "data.max_conversations must be >= 0 (0 = all)"),
        (d.heldout >= 0, "data.heldout must be >= 0"),
        (d.max_len >= 16, "data.max_len must be >= 16"),
        (d.batch_size >= 1, "data.batch_size must be >= 1"),
        (_finite(d.row_factor) and d.row_factor >= 1.0, "data.row_factor must be a finite number >= 1"),
        (d.row_granularity >= 0, "data.row_granularity must be >= 0"),
        (0 < d.cod_r <= 1 and 0 <= d.cod_r_min <= 1, "data.cod_r and data.cod_r_min must lie in (0, 1]"),
        (d.max_anchors is None or d.max_anchors >= 1, "data.max_anchors must be >= 1 (or unset)"),
        (d.regenerate_tokens >= 1, "data.regenerate_tokens must be >= 1"),
    ]


def _optim_loop_checks(cfg) -> list[tuple[bool, str]]:
    o, lp = cfg.optim, cfg.loop
    return [
        (_finite(o.lr) and o.lr > 0, f"optim.lr must be a finite number > 0, got {o.lr!r}"),
        (o.warmup_steps >= 0, "optim.warmup_steps must be >= 0"),
        (0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio must lie in [0, 1]"),
        (0 <= o.b1 < 1 and 0 <= o.b2 < 1, "optim.b1 and optim.b2 must lie in [0, 1)"),
        (_finite(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay must be a finite number >= 0"),
        (_finite(o.clip) and o.clip > 0, f"optim.clip must be a finite number > 0, got {o.clip!r}"),
        (_finite(o.norm_lr_scale) and o.norm_lr_scale >= 0, "optim.norm_lr_scale must be a finite number >= 0"),
        (lp.steps >= 0, "loop.steps must be >= 0 (0 = loop.epochs over the data)"),
        (_finite(lp.epochs) and lp.epochs > 0, f"loop.epochs must be a finite number > 0, got {lp.epochs!r}"),
        (lp.checkpoint_every >= 1 and lp.keep >= 1, "loop.checkpoint_every and loop.keep must be >= 1"),
        (lp.eval_every >= 0, "loop.eval_every must be >= 0 (0 = only at the end)"),
        (_finite(lp.chain_decay) and lp.chain_decay > 0, "loop.chain_decay must be a finite number > 0"),
        (
            str(lp.segments) == "auto" or (str(lp.segments).isdigit() and int(lp.segments) >= 1),
            f"loop.segments must be an integer >= 1 or auto, got {lp.segments!r}",
        ),
        (lp.max_rows_per_segment >= 1, "loop.max_rows_per_segment must be >= 1"),
        (_finite(lp.max_seconds) and lp.max_seconds >= 0, "loop.max_seconds must be a finite number >= 0 (0 = none)"),
    ]


def _eval_mesh_checks(cfg) -> list[tuple[bool, str]]:
    e, mesh, dc = cfg.eval, cfg.mesh, cfg.dist
    axes = [mesh.data, mesh.fsdp, mesh.tensor]
    return [
        (len(e.ks) >= 1 and all(k >= 1 for k in e.ks), "eval.ks must be one or more integers >= 1"),
        (e.num_prompts >= 1, "eval.num_prompts must be >= 1"),
        (e.max_new_tokens >= 1, "eval.max_new_tokens must be >= 1"),
        (
            all(n >= 1 or n == -1 for n in axes) and axes.count(-1) <= 1,
            "mesh.data, mesh.fsdp and mesh.tensor must be >= 1, at most one of them -1 (the rest of the devices)",
        ),
        (
            dc.num_processes >= 1 and 0 <= dc.process_id < dc.num_processes,
            "dist.process_id must lie in [0, dist.num_processes)",
        ),
        (
            dc.num_processes == 1 or dc.coordinator or dc.auto,
            "dist.num_processes > 1 needs --dist.coordinator HOST:PORT (or --dist.auto true)",
        ),
        (dc.heartbeat_timeout >= 1 and dc.initialization_timeout >= 1, "dist timeouts must be >= 1 second"),
    ]
