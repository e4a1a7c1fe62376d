"""The values of a training configuration checked before any work starts: ranges, finiteness and
choices, each refused with one line naming its flag (`peagle_jax.runtime.command_line.UsageError`, exit 2).
`train.flags.parse_args` runs `validate` on every command line. Then, against the loaded target:
what its head cannot be (`check_target`: a `TrainError`, exit 1) and what one step cannot fit
(`check_target_fits`)."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
from pathlib import Path

from peagle_jax.runtime.command_line import UsageError
from peagle_jax.runtime.distributed import checks as dist_checks
from train.config import DEFAULT_DRAFT_VOCAB, draft_vocab_size

__all__ = [
    "validate",
    "TrainError",
    "check_target",
    "check_target_fits",
    "step_bytes",
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
        _path_checks,
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


def _path_checks(cfg) -> list[tuple[bool, str]]:
    """Names that cannot be right whatever the run does: empty ones (the current folder), a file
    where a folder is written or read, an evaluation prompt set that is neither known nor a file."""
    m, d, e = cfg.model, cfg.data, cfg.eval
    out = [
        (cfg.out.strip() != "", "--out must name a folder, got ''"),
        (m.target.strip() != "", "model.target must not be empty (a Hugging Face folder, an asset name, or tiny)"),
        (d.source.strip() != "", "data.source must not be empty (sharegpt, synthetic, or a file or folder)"),
        (d.cache_features is None or d.cache_features.strip() != "", "data.cache_features must not be empty"),
        (
            m.init_head is None or m.init_head.strip() != "",
            "model.init_head must not be empty (a head's folder or Hub id)",
        ),
    ]
    if not all(ok for ok, _ in out):
        return out
    out += _written_folder_checks(cfg)
    out += [
        (
            not _a_file_target(m.target),
            f"model.target {m.target}: a file, not a folder (a Hugging Face folder, an asset name, or tiny)",
        ),
        (
            _named_target(m.target) or (m.load_format == "dummy" and _preset(m.target)),
            f"model.target {m.target}: no such folder, nor an asset name, a Hub id (org/name) or tiny"
            + (", nor a preset" if m.load_format == "dummy" else " (a preset needs --model.load_format dummy)"),
        ),
        _init_head_check(m.init_head),
        (
            _named_source(d.source),
            f"data.source {d.source}: no such file or folder, nor sharegpt, synthetic or a Hub dataset id (org/name)",
        ),
    ]
    # one check per Hub-only flag, so the error names the flag that was given
    out += [
        (
            value is None or _a_hub_source(d.source),
            f"data.{name} {value}: picks a part of a Hub dataset; data.source {d.source} is not a Hub id "
            "(org/name, with no local file or folder of that name)",
        )
        for name, value in (("split", d.split), ("subset", d.subset), ("revision", d.revision))
    ]
    if e.enabled:
        out.append(
            (
                _prompts_ok(e.prompts),
                f"eval.prompts {e.prompts!r}: neither mtbench, humaneval, synthetic nor an existing JSONL file",
            )
        )
    return out


def _written_folder_checks(cfg) -> list[tuple[bool, str]]:
    """The folders the run writes (--out, data.cache_features): folders or missing, writable, and
    --out no head's or model's folder."""
    d = cfg.data
    out = [
        (_kind(cfg.out) in ("dir", "missing"), f"--out {cfg.out}: exists and is not a folder"),
        (
            d.cache_features is None or _kind(d.cache_features) in ("dir", "missing"),
            f"data.cache_features {d.cache_features}: exists and is not a folder",
        ),
    ]
    if not all(ok for ok, _ in out):
        return out
    foreign = foreign_out(cfg.out)
    out.append((foreign is None, f"--out {cfg.out}: {foreign}"))
    for flag, folder in (("--out", cfg.out), ("data.cache_features", d.cache_features)):
        why = folder is not None and _unwritable_folder(folder)
        out.append((not why, f"{flag} {folder}: {why}"))
    return out


def foreign_out(out: str) -> str | None:
    """What an existing --out holds when it is no training run's folder: a drafter head (this
    project's format, vLLM, speculators) or a model (a config.json that is not a run's), which a
    run would write into (its config.json replaced by the run's). None: a new folder, an empty
    one, a run's, or one without a config.json."""
    from peagle_jax.formats.head_config import head_kind, is_run_config

    p = Path(out)
    if _kind(out) != "dir":
        return None
    kind = head_kind(p)
    if kind is None and (p / "config.json").is_file():
        try:
            raw = json.loads((p / "config.json").read_text())
        except (OSError, ValueError):
            raw = None
        if is_run_config(raw):
            return None
        if not (isinstance(raw, dict) and ("model_type" in raw or "architectures" in raw)):
            return "holds a config.json that is not a training run's (a run writes its own there): give a new folder"
        kind = "a Hugging Face model folder"
    if kind is None:
        return None
    return f"{kind}, not a training run's (a run writes its own config.json there): give a new folder"


def _unwritable_folder(path: str) -> str | None:
    """Why the run cannot write into folder `path` (made when missing), None when it can."""
    from peagle_jax.runtime.folders import unwritable

    p = Path(path)
    try:
        if p.is_dir():  # written into, not beside
            return None if os.access(p, os.W_OK | os.X_OK) else f"folder {p} is not writable"
        return unwritable(p, "folder")
    except (OSError, ValueError):  # a name the system refuses (too long, a NUL byte): the run's own error names it
        return None


def _kind(path: str, expand: bool = False) -> str:
    """dir, file, other (a device, a socket ...) or missing; a name the system refuses (too long,
    a NUL byte) is missing here, and the run's own error names it. `expand`: ~ is the home folder."""
    try:
        p = Path(path).expanduser() if expand else Path(path)
        return "dir" if p.is_dir() else "file" if p.is_file() else "other" if p.exists() else "missing"
    except (OSError, ValueError, RuntimeError):  # RuntimeError: ~user of no such user
        return "missing"


def _a_file_target(target: str) -> bool:
    if target == "tiny" or _kind(target) in ("dir", "missing"):
        return False
    from peagle_jax.sources.assets import ASSETS

    return target not in ASSETS


def _named_target(target: str) -> bool:
    """What `train.loop.resolve_target` can find: tiny, an asset, a path, or a Hub id to download."""
    from peagle_jax.sources.assets import ASSETS
    from peagle_jax.sources.hub import is_repo_id

    named = target == "tiny" or target in ASSETS or _kind(target) != "missing" or is_repo_id(target)
    return named or _refused_name(target)


def _preset(target: str) -> bool:
    """A preset target (`peagle_jax.models.presets`): shapes only, which dummy weights can fill."""
    from peagle_jax.models.presets import preset_fields

    return preset_fields(target) is not None


def _init_head_check(name: str | None) -> tuple[bool, str]:
    """model.init_head names a folder (its head is read once the flags are) or a Hub id."""
    from peagle_jax.sources.hub import is_repo_id

    kind = "missing" if name is None else _kind(name)
    if name is None or kind == "dir" or (kind == "missing" and is_repo_id(name)):
        return True, ""
    why = "a file, not a head's folder" if kind == "file" else "no such folder, nor a Hub id (org/name)"
    return False, f"model.init_head {name}: {why}"


def _named_source(source: str) -> bool:
    """What `train.data.load_conversations` reads: the two built-in sets, a path, or a Hub dataset id."""
    from train.data import hub_source

    named = source in ("sharegpt", "synthetic") or _kind(source) != "missing" or hub_source(source)
    return named or _refused_name(source)


def _refused_name(path: str) -> bool:
    """A name the system refuses (too long, a NUL byte): left to the run, whose error names it."""
    try:
        os.stat(path)
    except ValueError:  # a NUL byte
        return True
    except OSError as err:
        return err.errno == errno.ENAMETOOLONG
    return False


def _a_hub_source(source: str) -> bool:
    from train.data import hub_source

    return _kind(source) == "missing" and hub_source(source)


def _prompts_ok(prompts: str) -> bool:
    """What `train.loop` evaluates on: synthetic, a set of `peagle_jax.engine.prompts.load_prompts`, a file."""
    from peagle_jax.engine import PROMPT_SETS

    if prompts == "synthetic" or prompts.lower().replace("-", "").replace("_", "") in PROMPT_SETS:
        return True
    return _kind(prompts, expand=True) == "file"


# ---------------------------------------------------------------------------------------
# against the loaded target: the head it can take, its positions, and the memory of one step
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
