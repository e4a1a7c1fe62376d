"""The values of a training configuration checked before any work starts: ranges, finiteness and
choices, each refused with one line naming its flag (`peagle_jax.runtime.command_line.UsageError`, exit 2).
`train.flags.parse_args` runs `validate` on every command line; the names it holds are checked by
`train.path_checks`, and the configuration against the loaded target by `train.target_checks`."""

from __future__ import annotations

import dataclasses
import math

from peagle_jax.runtime.command_line import UsageError
from peagle_jax.runtime.distributed import checks as dist_checks
from train.path_checks import path_checks

__all__ = [
    "validate",
    "INT_MAX",
    "SEED_MAX",
    "FLOAT32_MAX",
    "FLOAT32_TINY",
]

INT_MAX = 2**31 - 1  # counts, sizes and token ids become int32 arrays and XLA shapes
SEED_MAX = 2**32 - 1  # numpy's and torch's seeds: non-negative
FLOAT32_MAX = 3.4028234663852886e38  # the step computes in float32: a larger value is inf there
FLOAT32_TINY = 1.1754943508222875e-38  # float32's (and bfloat16's) smallest normal: below it a value is 0 or subnormal


def validate(cfg):
    """One-line UsageError naming the flag for values no run can use (before any work starts)."""
    groups = (  # in order: a later group may rely on an earlier one (integers in range before products)
        _int_range_checks,
        _choice_checks,
        _model_data_checks,
        _optim_loop_checks,
        _eval_mesh_checks,
        _dflash_checks,
        _regenerate_checks,
        path_checks,
    )
    for group in groups:
        for ok, msg in group(cfg):
            if not ok:
                raise UsageError(msg)
    return cfg


def _finite(x) -> bool:
    return math.isfinite(x)


def _finite32(x) -> bool:
    """Finite in float32 too (1e300 passes math.isfinite and is inf in the step)."""
    return math.isfinite(x) and abs(x) <= FLOAT32_MAX


def _segments_ok(segments) -> bool:
    """An integer >= 1 (or its digits, from a file) or auto, as `train.segments.resolve_segments` reads it."""
    if segments == "auto":
        return True
    if isinstance(segments, bool):
        return False
    try:
        n = int(segments)  # "²" passes str.isdigit and is no int
    except (TypeError, ValueError):
        return False
    return 1 <= n <= INT_MAX


def _choice_checks(cfg) -> list[tuple[bool, str]]:
    m, d, o = cfg.model, cfg.data, cfg.optim
    return [
        (m.mode in ("parallel", "chain", "dflash"), f"model.mode must be parallel, chain or dflash, got {m.mode!r}"),
        (m.load_format in ("auto", "dummy"), f"model.load_format must be auto or dummy, got {m.load_format!r}"),
        (m.dtype in ("float32", "bfloat16"), f"model.dtype must be float32 or bfloat16: {m.dtype!r}"),
        (m.compute_dtype in ("float32", "bfloat16"), "model.compute_dtype must be float32 or bfloat16"),
        (m.attention in ("auto", "kernels", "dense"), "model.attention must be auto, kernels or dense"),
        (d.length_buckets in (1, 2, 3), "data.length_buckets must be 1, 2 or 3"),
        (d.template in ("auto", "chat", "plain"), "data.template must be auto, chat or plain"),
        (d.too_long in ("truncate", "drop"), f"data.too_long must be truncate or drop: {d.too_long!r}"),
        (d.bad_rows in ("skip", "error"), f"data.bad_rows must be skip or error, got {d.bad_rows!r}"),
        (cfg.eval.export_dtype in ("float32", "bfloat16"), "eval.export_dtype must be float32 or bfloat16"),
        (o.optimizer in ("adamw", "muon"), f"optim.optimizer must be adamw or muon, got {o.optimizer!r}"),
        (o.schedule in ("cosine", "linear"), f"optim.schedule must be cosine or linear, got {o.schedule!r}"),
    ]


def _model_data_checks(cfg) -> list[tuple[bool, str]]:
    m, d = cfg.model, cfg.data
    return [
        (m.num_layers >= 1, "model.num_layers must be >= 1"),
        (m.k_train >= 1, "model.k_train must be >= 1"),
        (m.block_size >= 2, f"model.block_size must be >= 2 (the bonus token and >= 1 draft), got {m.block_size}"),
        (m.draft_vocab is None or m.draft_vocab >= 0, "model.draft_vocab must be >= 0 (or unset)"),
        (m.mask_token_id is None or m.mask_token_id >= 0, "model.mask_token_id must be >= 0"),
        *_window_checks(m),
        (d.max_conversations >= 0, "data.max_conversations must be >= 0 (0 = all)"),
        (d.heldout >= 0, "data.heldout must be >= 0"),
        (d.max_len >= 16, "data.max_len must be >= 16"),
        (d.batch_size >= 1, "data.batch_size must be >= 1"),
        (_finite(d.row_factor) and d.row_factor >= 1.0, "data.row_factor must be a finite number >= 1"),
        (
            not _finite(d.row_factor) or d.row_factor * max(d.max_len, 1) <= INT_MAX,
            f"data.row_factor x data.max_len (COD rows per sequence) must be at most {INT_MAX}, got "
            f"{d.row_factor!r} x {d.max_len}",
        ),
        (d.row_granularity >= 0, "data.row_granularity must be >= 0"),
        (0 < d.cod_r <= 1 and 0 <= d.cod_r_min <= 1, "data.cod_r and data.cod_r_min must lie in (0, 1]"),
        (d.max_anchors is None or d.max_anchors >= 1, "data.max_anchors must be >= 1 (or unset)"),
        (d.regenerate_tokens >= 1, "data.regenerate_tokens must be >= 1"),
        *_batch_checks(cfg),
    ]


def _window_checks(m) -> list[tuple[bool, str]]:
    """Sliding head layers: a window of at least one position; full layers and the non-causal
    block only beside a window (and the latter only for DFlash)."""
    layers = set(m.full_attention_layers)
    return [
        (
            m.sliding_window is None or m.sliding_window >= 1,
            f"model.sliding_window must be >= 1, got {m.sliding_window}",
        ),
        (
            not layers or m.sliding_window is not None,
            "model.full_attention_layers needs model.sliding_window (without a window every layer is full)",
        ),
        (
            layers <= set(range(m.num_layers)),
            f"model.full_attention_layers {sorted(layers)}: the head's layers are 0 .. {m.num_layers - 1}",
        ),
        (
            not m.sliding_window_non_causal or (m.mode == "dflash" and m.sliding_window is not None),
            "model.sliding_window_non_causal is for DFlash heads with a model.sliding_window",
        ),
    ]


def _conversations(cfg) -> int | None:
    """The most conversations the source can give (data.max_conversations; the synthetic source
    makes 256 when it is 0), None when only reading the source says."""
    d = cfg.data
    if d.max_conversations > 0:
        return d.max_conversations
    return 256 if d.source == "synthetic" else None


def _batch_checks(cfg) -> list[tuple[bool, str]]:
    """A held-out split that leaves no training conversation, or a batch larger than the training
    split can be (it would repeat conversations within a step and only cost memory)."""
    d, n = cfg.data, _conversations(cfg)
    if n is None or d.heldout < 0 or d.batch_size < 1:
        return []
    if d.heldout >= n:
        return [(False, f"data.heldout {d.heldout} leaves no training conversation of data.max_conversations {n}")]
    return [
        (
            d.batch_size <= n - d.heldout,
            f"--data.batch-size {d.batch_size} exceeds the at most {n - d.heldout} training conversations "
            f"(data.max_conversations {n} - data.heldout {d.heldout}): lower --data.batch-size",
        )
    ]


def _optim_loop_checks(cfg) -> list[tuple[bool, str]]:
    o, lp = cfg.optim, cfg.loop
    return [
        (_finite32(o.lr) and o.lr > 0, f"optim.lr must be a finite number > 0, got {o.lr!r}"),
        (
            not (0 < o.lr < FLOAT32_TINY),
            f"--optim.lr {o.lr!r} is {'0' if o.lr < 2**-150 else 'subnormal'} in float32 (the step's dtype): no weight "
            f"would move; the smallest usable learning rate is {FLOAT32_TINY:.3g}",
        ),
        (o.warmup_steps >= 0, "optim.warmup_steps must be >= 0"),
        (0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio must lie in [0, 1]"),
        (0 <= o.b1 < 1 and 0 <= o.b2 < 1, "optim.b1 and optim.b2 must lie in [0, 1)"),
        (0 <= o.muon_momentum < 1, f"optim.muon_momentum must lie in [0, 1), got {o.muon_momentum!r}"),
        (
            _finite32(o.muon_weight_decay) and o.muon_weight_decay >= 0,
            f"optim.muon_weight_decay must be a finite number >= 0, got {o.muon_weight_decay!r}",
        ),
        (_finite32(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay must be a finite number >= 0"),
        (_finite32(o.clip) and o.clip > 0, f"optim.clip must be a finite number > 0, got {o.clip!r}"),
        (_finite32(o.norm_lr_scale) and o.norm_lr_scale >= 0, "optim.norm_lr_scale must be a finite number >= 0"),
        (lp.steps >= 0, "loop.steps must be >= 0 (0 = loop.epochs over the data)"),
        (_finite(lp.epochs) and lp.epochs > 0, f"loop.epochs must be a finite number > 0, got {lp.epochs!r}"),
        (lp.checkpoint_every >= 1 and lp.keep >= 1, "loop.checkpoint_every and loop.keep must be >= 1"),
        (lp.eval_every >= 0, "loop.eval_every must be >= 0 (0 = only at the end)"),
        (_finite32(lp.chain_decay) and lp.chain_decay > 0, "loop.chain_decay must be a finite number > 0"),
        (_finite32(lp.dflash_gamma) and lp.dflash_gamma > 0, "loop.dflash_gamma must be a finite number > 0"),
        (_finite32(lp.ce_weight) and 0 <= lp.ce_weight <= 1, "loop.ce_weight must be a number in [0, 1]"),
        (lp.dflash_weights in ("exp", "dpace"), f"loop.dflash_weights must be exp or dpace, got {lp.dflash_weights!r}"),
        (_finite32(lp.dpace_alpha) and 0 < lp.dpace_alpha <= 1, "loop.dpace_alpha must be a number in (0, 1]"),
        (
            lp.dflash_weights != "dpace" or cfg.model.mode == "dflash",
            f"loop.dflash_weights dpace weighs DFlash block slots: it needs --model.mode dflash (not {cfg.model.mode})",
        ),
        (
            lp.dflash_weights != "dpace" or lp.ce_weight == 1,
            "loop.dflash_weights dpace reads each slot's cross-entropy as its confidence: it needs --loop.ce_weight 1 "
            "(speculators' rule: dpace requires loss_fn ce)",
        ),
        (_segments_ok(lp.segments), f"loop.segments must be an integer >= 1 or auto, got {lp.segments!r}"),
        (lp.max_rows_per_segment >= 1, "loop.max_rows_per_segment must be >= 1"),
        (_finite(lp.max_seconds) and lp.max_seconds >= 0, "loop.max_seconds must be a finite number >= 0 (0 = none)"),
    ]


def _dflash_checks(cfg) -> list[tuple[bool, str]]:
    """What a DFlash run cannot use: COD segments, or rounds of more drafts than a block holds."""
    m, lp, e = cfg.model, cfg.loop, cfg.eval
    if m.mode != "dflash":
        return []
    drafts = m.block_size - 1
    return [
        (
            m.init_layer is None,
            f"--model.init-layer {m.init_layer} with --model.mode dflash: a DFlash head has no fused first layer to "
            "start from a target layer (drop --model.init-layer, or use mode parallel or chain)",
        ),
        (
            m.block_size < cfg.data.max_len,
            f"--model.block-size {m.block_size} must be below --data.max-len {cfg.data.max_len}: a block (its anchor "
            "and block_size - 1 drafts) lies inside one training sequence",
        ),
        (
            lp.segments in (1, "1", "auto"),
            f"loop.segments={lp.segments!r} splits COD rows: a DFlash step runs its blocks in one pass (use 1)",
        ),
        (
            not e.enabled or max(e.ks) <= drafts,
            f"eval.ks {list(e.ks)}: a DFlash head of model.block_size {m.block_size} drafts at most {drafts} a round",
        ),
    ]


MAX_CONCURRENCY = 1024  # a thread each


def _an_http_url(url: str) -> bool:
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - a port that is no number raises here
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not any(c.isspace() for c in url)


def _regenerate_checks(cfg) -> list[tuple[bool, str]]:
    """The regeneration's transport: in process (its batch) or through an endpoint (a URL, only with
    data.regenerate on)."""
    d = cfg.data
    out = [
        (d.regenerate_batch >= 1, f"data.regenerate_batch must be >= 1, got {d.regenerate_batch}"),
        (
            d.regenerate_api in ("completions", "chat"),
            f"data.regenerate_api must be completions or chat, got {d.regenerate_api!r}",
        ),
        (
            d.regenerate_model is None or d.regenerate_model.strip() != "",
            "data.regenerate_model must not be empty (unset: the first model the server lists)",
        ),
        (
            1 <= d.regenerate_concurrency <= MAX_CONCURRENCY,
            f"data.regenerate_concurrency must lie in [1, {MAX_CONCURRENCY}] (a thread each), got {d.regenerate_concurrency}",
        ),
        (
            _finite(d.regenerate_timeout) and d.regenerate_timeout > 0,
            f"data.regenerate_timeout must be a finite number of seconds > 0, got {d.regenerate_timeout!r}",
        ),
        (d.regenerate_retries >= 0, f"data.regenerate_retries must be >= 0, got {d.regenerate_retries}"),
    ]
    if d.regenerate_endpoint is not None:
        out += [
            (
                _an_http_url(d.regenerate_endpoint),
                "data.regenerate_endpoint must be an http:// or https:// URL of the server (e.g. "
                f"http://localhost:8000/v1), got {d.regenerate_endpoint!r}",
            ),
            (
                d.regenerate,
                "data.regenerate_endpoint is set but data.regenerate is false: add --data.regenerate true",
            ),
        ]
    return out


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
        *dist_checks(dc),
    ]


def _int_fields(cfg):
    """(flag name, value) of every integer field of the sections (each value of a tuple)."""
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(part):
            continue
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            for v in value if isinstance(value, tuple) else (value,):
                if isinstance(v, int) and not isinstance(v, bool):
                    yield f"{section.name}.{f.name}", v


def _int_range_checks(cfg) -> list[tuple[bool, str]]:
    """Seeds in [0, SEED_MAX]; every other integer at most INT_MAX (their lower bounds are above)."""
    out = []
    for name, v in _int_fields(cfg):
        if name.endswith(".seed"):
            out.append((0 <= v <= SEED_MAX, f"{name} must lie in [0, {SEED_MAX}], got {v}"))
        else:
            out.append((v <= INT_MAX, f"{name} must be at most {INT_MAX}, got {v}"))
    return out
