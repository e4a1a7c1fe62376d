"""speculators 0.9.0's P-EAGLE and DFlash training recipes as a library function: the reference
side of the learning-efficiency benchmark, trained in PyTorch on this CPU from the same target
features (`features(i)`) as our trainer, one sequence per optimizer step in the order the benchmark
gives.

The recipe is what `speculators train --speculator-type peagle|dflash` builds by default, built by
speculators' own code: `TrainConfig` (schema defaults + derived defaults: for dflash 5 layers,
block 16, cross-entropy, D-PACE) -> `build_draft_model` (`create_transformer_layer_config`,
`resolve_mask_token_id`, the model class's `from_training_args`) -> `TrainerConfig` as `cli.main`
fills it -> `build_optimizers` + linear warmup schedule as `Trainer.setup_optimizer` makes them ->
their per-step body (`Trainer.train_epoch`). Data: the raw per-position arrays go through their
`BaseDataset.__getitem__`, the preprocess `cli.main` picks (`shift_batch` for peagle, none for
dflash) and `CollateFn`.
CPU substitutions, each an option speculators itself offers: `draft_attn_impl` "sdpa" (flex
attention has no backward on CPU), `loss_implementation` "eager" (the "fused" loss is Triton), and
autocast on device "cpu". Two departures, both explained where they are made: the teacher's
`verifier_norm` is the identity (`features` already gives final-norm states), and batches are not
padded to `total_seq_len` (the padded rows cannot reach the real ones; they only cost time).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

__all__ = ["resolve_config", "vocab_maps", "build_reference", "teacher_logits", "train_speculators", "recipe_summary"]


def _httpx_alias() -> None:
    """speculators.train.utils imports its vLLM render client (data generation over HTTP, never
    called here), which imports `httpx` at import time; this environment's openai and
    huggingface_hub use its successor `httpx2` (same API) and httpx itself is not installed."""
    try:
        importlib.import_module("httpx")
    except ImportError:
        sys.modules["httpx"] = importlib.import_module("httpx2")


_httpx_alias()

# the CPU-capable choices speculators offers for its GPU-only defaults (simple_flex_attention, fused)
CPU_FIELDS = {"draft_attn_impl": "sdpa", "loss_implementation": "eager"}
# PEagleSpeculatorConfig fields that `PEagleDraftModel.from_training_args` does not forward from
# the CLI (its --embed-requires-grad flag is a no-op for peagle): an override of one is set on the
# model's config instead, and their `load_verifier_weights` applies it (see `_apply_model_overrides`)
MODEL_ONLY = ("embed_requires_grad",)


KINDS = ("peagle", "dflash")  # speculator types this module trains


def resolve_config(target_folder, *, kind="peagle", k=8, seed=0, steps=None, overrides=None, aux_layer_ids=None):
    """Their `TrainConfig` for a `kind` run on `target_folder` (their validators and derived
    defaults run), with the CPU fields, `k` as num_depths (peagle), then `overrides` (flat field
    names)."""
    from speculators.train.config.schema import CONFIG_DESTS, TrainConfig

    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(CONFIG_DESTS) - set(MODEL_ONLY))
    if unknown:
        raise ValueError(f"unknown speculators recipe fields {unknown} (flat TrainConfig names)")
    if kind not in KINDS:
        raise ValueError(f"speculator type {kind!r}: one of {KINDS}")
    flat = {
        "speculator_type": kind,
        "verifier_name_or_path": str(Path(target_folder).absolute()),
        "seed": seed,
        "max_steps": steps,
        **CPU_FIELDS,
        **({"num_depths": k} if kind == "peagle" else {}),
    }
    if aux_layer_ids is not None:  # the ids the features were taken at (recorded in the head's config)
        flat["target_layer_ids"] = [int(i) for i in aux_layer_ids]
    flat.update({key: v for key, v in overrides.items() if key not in MODEL_ONLY})
    return TrainConfig.from_flat(flat)


def vocab_maps(draft_ids, vocab_size: int):
    """(d2t int64 [Vd], t2d bool [V], Vd) as `speculators/train/vocab_mapping.py`
    (`build_vocab_mappings_from_distribution`) represents them: target id = draft id + d2t[draft id];
    (None, None, V) for the full vocabulary (their CLI's no-mapping path)."""
    ids = np.asarray(draft_ids, np.int64)
    if ids.ndim != 1 or len(ids) == 0 or np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"draft_ids must be sorted distinct target ids in [0, {vocab_size})")
    if len(ids) == vocab_size:
        return None, None, vocab_size
    d2t = torch.as_tensor(ids) - torch.arange(len(ids), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.as_tensor(ids)] = True
    return d2t, t2d, len(ids)


def _apply_model_overrides(model, overrides: dict) -> None:
    given = [key for key in MODEL_ONLY if key in overrides]
    for key in given:
        setattr(model.config, key, bool(overrides[key]))
    if not given:
        return
    # their loader re-applies config.embed_requires_grad to embed_tokens (eagle3/core.py
    # load_verifier_weights); the already loaded rows are kept (it only fills NaN weights)
    model.load_verifier_weights()


def model_class(kind: str):
    """Their model class of a speculator type (`cli.main`: `SpeculatorModel.registry`)."""
    import speculators.models  # noqa: F401  (registers every model class)
    from speculators.model import SpeculatorModel

    return SpeculatorModel.registry[kind]


def build_reference(
    target_folder, draft_ids, *, kind="peagle", k=8, seed=0, steps=None, overrides=None, aux_layer_ids=None
):
    """(their draft model, flat args Namespace, TrainConfig) built as their `cli.main` builds them."""
    from speculators.train.cli import build_draft_model, set_seed
    from speculators.train.vocab_mapping import get_target_vocab_size

    cfg = resolve_config(
        target_folder, kind=kind, k=k, seed=seed, steps=steps, overrides=overrides, aux_layer_ids=aux_layer_ids
    )
    args = argparse.Namespace(**cfg.flatten())  # cli.main's "phase-1 adapter"
    set_seed(args.seed, args.deterministic_cuda)  # before the model is built, as cli.main does
    vocab = get_target_vocab_size(None, args.verifier_name_or_path, args.trust_remote_code)
    d2t, t2d, vd = vocab_maps(draft_ids, vocab)
    model = build_draft_model(args, model_class(kind), t2d, d2t, vd)
    _apply_model_overrides(model, dict(overrides or {}))
    # Trap 1: their teacher is verifier_lm_head(verifier_norm(verifier_last_hidden_states))
    # (peagle/core.py forward) because vLLM hands them the last layer's PRE-norm state, and
    # verifier_norm is the draft arch's plain RMSNorm (x * w; Qwen3RMSNorm for peagle), which for
    # Gemma's (1 + w) final norm would scale every channel wrongly (speculators resolves the Gemma
    # norm class for dflash only: models/utils.py resolve_verifier_norm_class). `features` gives
    # the state AFTER our final norm, so the teacher is verifier_lm_head(y): any norm here would
    # be applied twice (for dflash too: its Gemma norm is right on pre-norm states only).
    # tests/test_speculators_recipe.py checks it gives the target's logits.
    model.verifier_norm = torch.nn.Identity()
    _check_heads(model, Path(target_folder), draft_ids, args.trust_remote_code)
    return model, args, cfg


def _check_heads(model, folder: Path, draft_ids, trust_remote_code: bool) -> None:
    """Trap 2: their `load_verifier_weights` (model.py `_load_verifier_weights`) takes lm_head rows
    from the checkpoint's "lm_head.weight", else from embed_tokens (a key-presence guess, right for
    tied Gemma-3 whose file has no lm_head: logits = final-norm state @ embedding^T, unscaled).
    Checked here against the target's own config (`tie_word_embeddings`): verifier_lm_head (the
    teacher) and lm_head (the frozen draft head) must both be the output matrix's draft rows.
    Their embed_tokens is the raw embedding, without Gemma's sqrt(H) input scale: their recipe,
    kept (the draft's input_layernorm makes the forward scale-free; only the size of AdamW's
    steps relative to the rows depends on it)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from peagle_jax.sources.weights import Checkpoint

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code).get_text_config()
    keys = Checkpoint(folder).where
    if config.tie_word_embeddings:
        key = min((k for k in keys if k.endswith("embed_tokens.weight")), key=len)
    else:
        key = "lm_head.weight"
    with safe_open(str(keys[key]), framework="pt") as f:
        rows = f.get_tensor(key)[torch.as_tensor(np.asarray(draft_ids, np.int64))].float()
    for name in ("verifier_lm_head", "lm_head"):
        if not torch.equal(getattr(model, name).weight.detach(), rows):
            raise ValueError(f"speculators' {name} is not the target's {key} rows of the draft vocabulary")


def teacher_logits(model, y: torch.Tensor) -> torch.Tensor:
    """Their teacher expression (peagle/core.py forward) on final-norm states y [..., H]."""
    with torch.no_grad():
        return model.verifier_lm_head(model.verifier_norm(y))


def _dataset(examples, features, max_len: int, dtype):
    """Their `BaseDataset` over the given arrays: `_get_raw_data` returns what their
    `ArrowDataset._get_raw_data` returns (train/data.py: hidden_states = the aux layers
    concatenated, verifier_last_hidden_states, input_ids, loss_mask 1 on assistant tokens);
    `__getitem__` adds lengths and position_ids."""
    from speculators.train.data import BaseDataset

    class FeatureDataset(BaseDataset):
        def _compute_approx_lengths(self):
            return [len(ids) for ids, _ in examples]

        def _get_raw_data(self, index):
            ids, mask = examples[index]
            aux, y = features(index)
            if aux.shape[0] != len(ids) or y.shape[0] != len(ids):
                raise ValueError(f"example {index}: features of {aux.shape[0]} positions for {len(ids)} tokens")
            return {
                "hidden_states": torch.tensor(np.asarray(aux, np.float32)),  # a copy: features may be read-only
                "input_ids": torch.as_tensor(np.asarray(ids, np.int64)),
                "verifier_last_hidden_states": torch.tensor(np.asarray(y, np.float32)),
                "loss_mask": torch.as_tensor(np.asarray(mask, np.int64)),  # their preprocessing: int 0/1
            }

    return FeatureDataset(max_len, dtype)


def _batch(item: dict, args, model, dtype) -> dict:
    """One step's batch through the preprocess their `cli.main` picks (peagle: `shift_batch`,
    eagle3/data.py: input_ids[1:], hidden_states[:-1], verifier_last_hidden_states[1:],
    loss_mask[1:]; dflash: none) and `CollateFn` (casts the *hidden_states* keys to
    hidden_states_dtype, builds document_ids). Not padded to total_seq_len: padded rows have
    document -1, which no real row attends, and are out of the loss; the COD sampler and DFlash's
    anchor choice draw the same rows (they read only the loss mask's valid positions)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    shift = args.speculator_type == "peagle"
    length = max(1, min(len(item["input_ids"]) - shift, args.total_seq_len))
    hidden = model.config.transformer_layer_config.hidden_size
    preprocess = shift_batch if shift else None
    collate = CollateFn(length, hidden, len(model.target_layer_ids), dtype, preprocess=preprocess)
    return collate([item])


def trainer_config(args, hidden_states_dtype, train_kwargs: dict):
    """Their `TrainerConfig` as `speculators/train/cli.py` main() fills it: every field from the
    flat arg of the same name, but the four it renames or computes."""
    from speculators.train.trainer import TrainerConfig

    same = {f: getattr(args, f) for f in TrainerConfig._fields if f in vars(args) and f != "hidden_states_dtype"}
    return TrainerConfig(
        **same,
        num_epochs=args.epochs,
        resume_from_checkpoint=not args.no_resume_from_checkpoint,
        train_call_kwargs=train_kwargs,
        val_call_kwargs=train_kwargs,
        hidden_states_dtype=hidden_states_dtype,
    )


def _optimizers(model, tc, loader_len: int):
    """(optimizers, schedulers, (warmup, total)) as `Trainer.setup_optimizer` makes them."""
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import _resolve_scheduler_steps
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    optimizers = build_optimizers(model, tc)
    if tc.scheduler_type == "none":
        return optimizers, [], (0, 0)
    warmup, total = _resolve_scheduler_steps(tc, loader_len)
    if tc.scheduler_type == "linear":
        make = lambda o: get_linear_schedule_with_warmup(o, warmup, total)
    else:
        make = lambda o: get_cosine_schedule_with_warmup(o, warmup, total, tc.scheduler_num_cosine_cycles)
    return optimizers, [make(o) for o in optimizers], (warmup, total)


def _train_step(model, batch, tc, optimizers, schedulers) -> dict:
    """One step of their `Trainer.train_epoch`: forward under autocast (theirs runs on the
    accelerator's device type; here the CPU's), zero_grad, backward, clip 1.0, step, schedule."""
    dtype = tc.hidden_states_dtype
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        _, loss, metrics = model(**batch, **(tc.train_call_kwargs or {}))
    for opt in optimizers:
        opt.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    lrs = [opt.param_groups[0]["lr"] for opt in optimizers]
    for opt in optimizers:
        opt.step()
    for sched in schedulers:
        sched.step()
    slots = sorted(int(key.split("_")[1]) for key in metrics if key.startswith("position_") and key.endswith("_sum"))
    acc = [float(metrics[f"position_{d}_acc_sum"]) / max(float(metrics[f"position_{d}_acc_total"]), 1.0) for d in slots]
    return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "lr": lrs, "acc": acc}


def save_head(model, out: Path, dtype=torch.bfloat16) -> Path:
    """`save_pretrained` of the trained head as their `SingleGPUCheckpointer.save_checkpoint`
    writes it: float tensors cast to `dtype` (their default bf16), config.json's dtype patched."""
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("verifier_")}
    model.save_pretrained(str(out), state_dict=convert_float_dtype(state, dtype))
    patch_config_dtype(out / "config.json", dtype)
    return out


def _groups(model, optimizers) -> list[dict]:
    """Each optimizer's hyperparameters (lr: the base one, before the schedule) and parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    keys = ("weight_decay", "betas", "eps", "momentum", "nesterov", "ns_steps", "adjust_lr_fn")
    out = []
    for opt in optimizers:
        group = opt.param_groups[0]
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        hyper = {"lr": group.get("initial_lr", group["lr"]), **{k: group[k] for k in keys if k in group}}
        used = {"params": sorted(names[id(p)] for p in params), "numel": int(sum(p.numel() for p in params))}
        out.append({"optimizer": type(opt).__name__, **hyper, **used})
    return out


def _resolved(args, model, tc, optimizers, schedule) -> dict:
    """The recipe as it was run: every flat TrainConfig field, then what the build resolved."""
    tl = model.config.transformer_layer_config
    return {
        "train_config": {
            k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))
        },
        "draft_layer_config": tl.to_diff_dict(),
        "attn_implementation": tl._attn_implementation,
        "mask_token_id": model.mask_token_id,
        "embed_requires_grad": bool(model.embed_tokens.weight.requires_grad),
        "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad),
        "optimizer_groups": _groups(model, optimizers),
        "scheduler": {"type": tc.scheduler_type, "warmup_steps": schedule[0], "total_steps": schedule[1]},
        "grad_clip": 1.0,
        "train_call_kwargs": {k: (sorted(v) if k == "loss_config" else v) for k, v in tc.train_call_kwargs.items()},
        "hidden_states_dtype": str(tc.hidden_states_dtype),
        "teacher": "verifier_lm_head(y), y = final-norm target states (verifier_norm replaced by identity)",
        "speculators_config": model.config.speculators_config.model_dump(mode="json"),
    }


def train_speculators(
    target_folder: Path,
    examples: list[tuple[np.ndarray, np.ndarray]],
    features: Callable[[int], tuple[np.ndarray, np.ndarray]],
    order: list[int],
    draft_ids: np.ndarray,
    out: Path,
    *,
    kind: str = "peagle",
    k: int = 8,
    seed: int = 0,
    steps: int | None = None,
    overrides: dict | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    save_dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """Train speculators' `kind` head (peagle or dflash) `steps` (default len(order)) steps, step s
    on example order[s % len(order)], and save it to `out` (bf16, as their checkpointer). Returns
    {"losses", "wall_s" (the steps: collate, forward, backward, optimizer; not `features`, not the
    build), "step_s", "features_s", "acc" (per depth or block slot, per step), "grad_norms",
    "lrs", "config"}. `aux_layer_ids`: the target layers of the aux states (their default
    [2, L//2, L-3], for dflash too)."""
    from speculators.model import SpeculatorModel

    steps = len(order) if steps is None else int(steps)
    model, args, _ = build_reference(
        target_folder,
        draft_ids,
        kind=kind,
        k=k,
        seed=seed,
        steps=steps,
        overrides=overrides,
        aux_layer_ids=aux_layer_ids,
    )
    SpeculatorModel.verify_training_compatible(model)  # Trainer.setup_model
    dtype = getattr(torch, args.hidden_states_dtype)
    train_kwargs, _ = model_class(kind).get_trainer_kwargs(**vars(args))
    tc = trainer_config(args, dtype, train_kwargs)
    optimizers, schedulers, schedule = _optimizers(model, tc, len(order))
    data = _dataset(examples, features, args.total_seq_len, dtype)
    model.train()
    logs, step_s, features_s = [], [], 0.0
    for s in range(steps):
        tf = time.perf_counter()
        item = data[order[s % len(order)]]  # calls `features`: our target's time, not theirs
        ts = time.perf_counter()
        features_s += ts - tf
        batch = _batch(item, args, model, dtype)
        logs.append(_train_step(model, batch, tc, optimizers, schedulers))
        step_s.append(time.perf_counter() - ts)
    save_head(model, out, save_dtype)
    return {
        "losses": [r["loss"] for r in logs],
        "wall_s": float(sum(step_s)),
        "step_s": step_s,
        "features_s": features_s,
        "acc": [r["acc"] for r in logs],
        "grad_norms": [r["grad_norm"] for r in logs],
        "lrs": [r["lr"] for r in logs],
        "config": _resolved(args, model, tc, optimizers, schedule),
    }


def recipe_summary(overrides: dict | None = None) -> dict:
    """The resolved recipe for the docs table, from their TrainConfig alone (no target needed;
    shapes that come from the target, like the MLP width, are named by where they come from)."""
    f = resolve_config("<target>", overrides=overrides).flatten()
    adamw = {"optimizer": "AdamW", "lr": f["lr"], "weight_decay": f["weight_decay"]}
    muon = {"optimizer": "Muon", "params": "2-D trainable weights but embed_tokens / lm_head (fc, q/k/v/o, MLP)"}
    muon |= {k: f[f"muon_{k}"] for k in ("lr", "momentum", "weight_decay", "ns_steps", "adjust_lr_fn")}
    groups = [muon, {**adamw, "params": "the rest: embed_tokens, norms, mask_hidden"}]
    warmup = (
        f"{f['scheduler_warmup_steps']} steps"
        if f["scheduler_warmup_steps"] is not None
        else f"{f['scheduler_warmup_ratio']} of the steps"
        if f["scheduler_warmup_ratio"] is not None
        else "1% of the steps (floor)"
    )
    layers = f["num_layers"]
    return {
        "draft": {
            "arch": f["draft_arch"],
            "layers": layers,
            "hidden_act": f["draft_hidden_act"],
            "width, heads, MLP": "the target's hidden size, heads, head_dim, KV heads, intermediate size",
            "attention": [("full" if i in f["full_attention_indices"] else "sliding") for i in range(layers)],
            "sliding_window": f["sliding_window"],
            "attn_implementation": f["draft_attn_impl"],
            **{k: f[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm")},
        },
        "embed_tokens trainable": bool(dict(overrides or {}).get("embed_requires_grad", True)),
        "lm_head": "the target's rows of the draft vocabulary, frozen",
        "mask token": "--mask-token-id, else the tokenizer's mask, else an added <|MASK|>, else pad/eos/unk",
        "optimizer_groups": groups if f["optimizer"] == "muon" else [{**adamw, "params": "all trainable"}],
        "schedule": f"{f['scheduler_type']}, warmup {warmup}, to 0 at the last step",
        "grad_clip": 1.0,
        "loss": f"{f['loss_fn']} ({f['loss_implementation']}), one mean over the supervised COD rows",
        "cod": {k: f[k] for k in ("num_depths", "down_sample_ratio", "down_sample_ratio_min", "max_anchors")},
        "hidden_states_dtype": f["hidden_states_dtype"] + " (features cast by their collate; autocast compute)",
        "seed": f["seed"],
    }
