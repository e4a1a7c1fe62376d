"""`run(cfg)`: target + data -> `Trainer` -> trained head, saved, exported, evaluated, summarised.

Resume: a rerun with the same OUT restores the latest checkpoint (params, optimizer state, step)
and continues with exactly the batches the uninterrupted run would have seen (`train.trainer`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from peagle_jax.runtime.command_line import UsageError, check_interrupted, interrupted, note, signals_deferred, started
from train import config as C
from train import data as D
from train import distributed as dist
from train.checkpoint import Checkpoints
from train.checks import INT_MAX
from train.evaluate import heldout_rounds
from train.hooks import Checkpointing, Export, Logging, Progress, StopOnNonFinite
from train.init_head import adopt_head
from train.metrics import MetricsLog
from train.path_checks import foreign_out
from train.payoff import fastest_k, payoff
from train.target_checks import TrainError, check_target, check_target_fits
from train.trainer import Hook, TimeBudget, Trainer, total_steps

__all__ = ["run", "TrainError", "serve_fields", "check_resume"]


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=float))
    os.replace(tmp, path)


def serve_fields(vllm_dir: Path, target_path, k_train: int, mode: str, family: str | None = None) -> dict:
    """The summary's `serve` (the vLLM command line, `peagle_jax.formats.serving.serve_command`),
    `serve_lines` (what to run, `serving.serve_lines`: vLLM pinned to the releases that serve a
    P-EAGLE head, and this project's engine) and `serve_note`; a target from the Hub is named by
    its id, as vLLM takes it."""
    from peagle_jax.formats import serve_command, serve_lines, serve_note
    from peagle_jax.sources.hub import repo_id_of

    args = (vllm_dir, mode, k_train, family, repo_id_of(target_path) or str(target_path))
    return {"serve": serve_command(*args), "serve_lines": serve_lines(*args), "serve_note": serve_note(mode)}


def resolve_target(cfg: C.TrainConfig, out: Path) -> Path:
    """The target's folder; with dummy weights a preset name stays a name (no folder) and a Hub
    id fetches config.json and the tokenizer only."""
    name = cfg.model.target
    dummy = cfg.model.load_format == "dummy"
    if dummy and not Path(name).exists():
        from peagle_jax.models.presets import preset_fields

        if preset_fields(name) is not None:
            return Path(name)
    if name == "tiny":
        from train.tiny import build_tiny_target

        return build_tiny_target(out / "tiny-target", cfg.model.seed)
    if Path(name).is_dir():
        return Path(name)
    from peagle_jax.sources import assets, hub

    if name not in assets.ASSETS and hub.is_repo_id(name):
        return hub.download(name, "config" if dummy else "target")  # its errors are one line naming the id
    try:
        return assets.prepare(name)
    except Exception as e:  # noqa: BLE001
        raise TrainError(
            f"model.target {name!r}: not a folder, and cannot prepare it as an asset: {str(e).splitlines()[0]}"
        ) from None


def has_checkpoint(out: Path) -> bool:
    folder = out / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def check_resume(out: Path, cfg: C.TrainConfig) -> None:
    """A TrainError when OUT holds checkpoints of a run with other settings (a run that stopped
    before its first checkpoint leaves nothing to resume: any settings may reuse its OUT)."""
    saved = out / "config.json"
    if not saved.exists() or not has_checkpoint(out):
        return
    old = C.load_saved(saved)
    new = C.to_dict(cfg)
    for section in ("model", "data", "optim"):
        for k, v in new[section].items():
            if section == "data" and k in C.REGENERATION_TRANSPORT:
                continue
            if _unset_default(section, k, old.get(section, {}).get(k)) != _unset_default(section, k, v):
                raise TrainError(
                    f"{out} holds a run with {section}.{k}={old.get(section, {}).get(k)!r} "
                    f"(now {v!r}): use another --out, or the same settings to resume"
                )
    # a run saved before loop.ce_weight had forward KL, or CE with DFlash's loop.dflash_loss ce
    old_loop = {"ce_weight": 1.0 if old["loop"].get("dflash_loss") == "ce" else 0.0, **old["loop"]}
    old_loop = {"dflash_weights": "exp", "dpace_alpha": 0.5, **old_loop}  # saved before loop.dflash_weights
    for k in (
        "steps",
        "epochs",
        "per_depth_loss",
        "chain_decay",
        "dflash_gamma",
        "ce_weight",
        "dflash_weights",
        "dpace_alpha",
    ):
        if old_loop.get(k) != new["loop"][k]:
            raise TrainError(
                f"{out} holds a run with loop.{k}={old_loop.get(k)!r} (now {new['loop'][k]!r}): "
                "use another --out, or the same settings to resume"
            )


def _unset_default(section: str, key: str, value):
    """model.draft_vocab unset is the 16384 it was before it could be unset: the same head on every
    target a run of 16384 could train on."""
    if (section, key, value) == ("model", "draft_vocab", None):
        return C.DEFAULT_DRAFT_VOCAB
    return value


def load_data(cfg: C.TrainConfig, tokenizer, out: Path, target=None, mesh=None) -> D.Dataset:
    """The run's examples, split. A server's request log (`D.read_request_log`) is the target's
    own answers: never regenerated, its newest conversations held out."""
    d = cfg.data
    served = D.read_request_log(Path(d.source), d.max_conversations) if D.is_request_log(d.source) else None
    if served is None:
        part = dict(split=d.split, subset=d.subset, revision=d.revision)  # of a Hub dataset
        records = list(D.load_conversations(d.source, d.max_conversations, d.seed, **part))
    else:
        records = served.records
    regenerated = None
    if d.regenerate and served is None:
        from train.regenerate import regenerate_for

        regenerated = regenerate_for(cfg, records, target, out, mesh, cfg.loop.progress and dist.is_main())
    examples, stats = D.tokenize(
        records,
        tokenizer,
        template=d.template,
        max_len=d.max_len,
        too_long=d.too_long,
        bad_rows=d.bad_rows,
        regenerated=regenerated,
        vocab=None if target is None else target.config.vocab_size,
    )
    if served is None:
        train, held = D.split(examples, d.heldout, d.seed)
    else:
        train, held = D.split_newest(examples, d.heldout)
        stats["request_log"] = {**served.stats, "regenerated": False}
    stats.update(train=len(train), heldout=len(held), train_tokens=int(sum(len(e.ids) for e in train)))
    return D.Dataset(train, held, stats)


def served_notes(cfg: C.TrainConfig, stats: dict, tpath) -> list[str]:
    """What the run says of a request log it trains on (nothing for other sources): its answers
    are the target's own, so none is regenerated; a log of another target than model.target. The
    latter is kept in the summary's data.request_log.target_note."""
    served = stats.get("request_log")
    if served is None:
        return []
    skipped = " (data.regenerate skipped)" if cfg.data.regenerate else ""
    notes = [
        f"data: a request log, {served['used']} requests ({served['duplicates']} duplicates dropped), the newest "
        f"{stats['heldout']} held out: the target's own answers, not regenerated{skipped}"
    ]
    other = D.other_targets(served["targets"], cfg.model.target, tpath)
    if other:
        served["target_note"] = (
            f"the request log {cfg.data.source} holds answers of {', '.join(other)}, not of model.target "
            f"{cfg.model.target}: a head learns to draft for the target whose answers it reads"
        )
        notes.append(f"note: {served['target_note']}")
    return notes


def run(cfg: C.TrainConfig, hooks: Sequence[Hook] = ()) -> dict | None:
    """Trains, saves, exports and evaluates; the summary (None on processes other than 0).
    `hooks` run after the trainer's own (logging, evaluation, checkpoints, export) at every step.
    A run that fails or is interrupted before its first checkpoint leaves nothing behind: an OUT
    it made is removed, an OUT that existed before is left as it was given; the error says which
    (`leave_out`)."""
    t0 = time.perf_counter()
    dist.setup(cfg.dist)  # before any JAX op: the devices of every process form one mesh
    from peagle_jax.runtime.sharding import device_mesh

    cfg = adopt_head(cfg)  # model.init_head's settings, saved in OUT/config.json (the command line has them already)

    if dist.multi_process() and (cfg.data.cache_features or cfg.data.regenerate):
        raise TrainError("data.cache_features and data.regenerate run in one process only (dist.num_processes 1)")
    mesh = device_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    out = Path(cfg.out).absolute()
    import_libraries(cfg)
    started()  # OUT is made or opened next: an interrupt from here unwinds (OUT removed or its checkpoint kept)
    created = first_missing(out)
    opened: list = []  # what leave_out closes before it removes OUT
    try:
        return _run(cfg, hooks, t0, mesh, out, opened)
    except BaseException as err:
        for close in opened:
            try:
                close()
            except Exception:  # noqa: BLE001, S110 - the run's own error is the one to report
                pass
        leave_out(out, created, err)
        raise


def import_libraries(cfg: C.TrainConfig) -> None:
    """The libraries the run loads its target with, imported while it is still starting: an import
    takes seconds (torch, transformers) and an interrupt can only unwind once it has returned; in
    start-up the interrupt ends the process at once (`peagle_jax.runtime.command_line.starting_up`)."""
    from transformers import AutoTokenizer  # noqa: F401 - every target's tokenizer

    if cfg.model.target == "tiny":
        import torch  # noqa: F401 - train.tiny builds the target with them
        from transformers import LlamaForCausalLM  # noqa: F401


def first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what making it creates), None when it exists."""
    if path.exists():
        return None
    while not path.parent.exists() and path.parent != path:
        path = path.parent
    return path


def leave_out(out: Path, created: Path | None, err: BaseException) -> None:
    """After a run stopped by `err` before its first checkpoint (nothing to resume): OUT removed
    when this run made it (`created`: the outermost folder it made), left as it was when it existed
    before (or when it holds regenerated answers a rerun reuses); a note on `err` says which."""
    if not dist.is_main() or not out.is_dir() or has_checkpoint(out):
        return  # nothing made, another process's to do, or a checkpoint to resume from
    regenerated = out / "regenerated.jsonl"
    if regenerated.is_file() and regenerated.stat().st_size:
        text = f"{out} kept: it holds regenerated answers a rerun with the same --out reuses"
    elif created is not None:
        with signals_deferred():  # a second Ctrl-C does not leave half of it
            shutil.rmtree(created, ignore_errors=True)
        text = f"removed {created}, which this run made: it stopped before its first checkpoint"
    else:
        text = f"{out} kept as it was: it existed before this run"
    if isinstance(err, KeyboardInterrupt) or interrupted() is not None:  # or what an interrupt turned into
        text = f"interrupted before the first checkpoint (nothing to resume): {text}"
    note(err, text)


def _run(cfg: C.TrainConfig, hooks: Sequence[Hook], t0: float, mesh, out: Path, opened: list) -> dict | None:
    out = prepare_out(cfg)
    log = console(t0)
    tpath, target = load_target(cfg, out)
    check_target(cfg, target, tpath)  # before the data: what this target cannot train with
    check_target_fits(cfg, target.config, tpath, shards=_batch_shards(mesh))
    log(f"target {tpath} loaded")
    check_interrupted()
    ds = load_data(cfg, target.tokenizer, out, target, mesh)
    for line in served_notes(cfg, ds.stats, tpath):
        log(line)
    log(f"data: {json.dumps(ds.stats)}")
    check_interrupted()
    if cfg.data.prepare_only:
        if dist.is_main():
            stats = {"prepared_only": True, "target": str(tpath), "data": ds.stats}
            _write_json(out / "summary.json", {**stats, "wall_seconds": time.perf_counter() - t0})
        return {"prepared_only": True, "out": str(out)} if dist.is_main() else None
    if cfg.data.batch_size > len(ds.train):
        raise UsageError(
            f"--data.batch-size {cfg.data.batch_size} exceeds the {len(ds.train)} training examples of "
            f"data.source {cfg.data.source}: lower --data.batch-size"
        )
    counts = D.token_counts(ds.train, target.config.vocab_size)
    trainer = Trainer(cfg, target, total_steps(cfg, len(ds.train)), token_counts=counts, mesh=mesh)
    target.state, target.mesh = trainer.stepper.target_state, mesh  # keep only the placed copy
    log(f"mesh {dict(mesh.shape)} over {jax.device_count()} devices, {jax.process_count()} process(es)")
    ckpt = Checkpoints(out / "checkpoints", cfg.loop.keep)
    start = trainer.restore(ckpt) or 0
    if start:
        log(f"resumed from {out / 'checkpoints'} at step {start}")
    metrics = MetricsLog(out, start, enabled=dist.is_main())
    opened.append(metrics.close)
    logging, export = Logging(metrics, ds.heldout, cfg.loop.eval_every), Export(out, tpath, cfg.eval.export_dtype)
    own = [
        StopOnNonFinite(),  # first: a non-finite step is neither logged nor checkpointed
        TimeBudget(cfg.loop.max_seconds),
        logging,
        Progress(trainer, cfg.loop.progress and dist.is_main()),
        Checkpointing(ckpt, cfg.loop.checkpoint_every),
        export,  # last of the trainer's own: after the final evaluation and checkpoint
    ]
    t_train = time.perf_counter()
    trainer.fit(ds.train, [*own, *hooks], features=feature_cache(cfg, trainer, tpath))
    train_wall = time.perf_counter() - t_train
    check_interrupted()
    ev = logging.last_eval
    log(
        f"trained {trainer.step - start} steps in {train_wall:.1f} s"
        + (f"; held-out loss {ev['eval_loss']:.4f}" if ev else "")
    )
    if not dist.is_main():
        metrics.close()
        return None
    head_dir, vllm_dir, report = export.head_dir, export.vllm_dir, export.report
    log(f"saved {head_dir}, exported {vllm_dir}")
    summary = run_summary(cfg, trainer, ds, metrics, tpath, start, train_wall, ev)
    summary.update(head_dir=str(head_dir), vllm_dir=str(vllm_dir), export_warnings=report.get("warnings", []))
    if cfg.eval.enabled and dist.multi_process():  # process 0 alone measures, on its own copy of the target
        target = load_target(cfg, out)[1]
    # what the engine accepts answering the held-out conversations
    if ds.heldout and (cfg.eval.enabled or not dist.multi_process()):
        log(f"held-out acceptance per greedy round ({len(ds.heldout)} conversations)")
        summary["heldout_rounds"] = heldout_rounds(
            target, export.head, ds.heldout, k=trainer.eval_k, max_len=cfg.data.max_len
        )
        check_interrupted()
    if cfg.eval.enabled:
        summary["eval"] = measure_speed(cfg, target, export.head, log)
        check_interrupted()
        summary.update(serving_advice(summary, metrics.records()))
    k_serve = summary.get("best_k", trainer.k)
    summary.update(serve_fields(vllm_dir, tpath, k_serve, cfg.model.mode, target.config.model_type))
    summary["wall_seconds"] = time.perf_counter() - t0
    _write_json(out / "summary.json", summary)
    metrics.close()
    check_interrupted()
    return summary


def _batch_shards(mesh) -> int:
    """The devices a batch's rows are split over (mesh axes data and fsdp)."""
    shape = dict(mesh.shape)
    return max(1, shape.get("data", 1) * shape.get("fsdp", 1))


def console(t0: float) -> Callable[[str], None]:
    """A print of the seconds since t0 and a message, on process 0 only."""

    def log(msg: str) -> None:
        if dist.is_main():
            print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    return log


def prepare_out(cfg: C.TrainConfig) -> Path:
    """OUT made, checked against a run it already holds (resume), and given this run's config."""
    out = Path(cfg.out).absolute()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {cfg.out}: exists and is not a folder")
    foreign = foreign_out(cfg.out)  # checked by the flags too; a config built in Python reaches here unchecked
    if foreign is not None:
        raise UsageError(f"--out {cfg.out}: {foreign}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {cfg.out}: cannot make the folder ({e.strerror})") from None
    check_resume(out, cfg)
    dist.barrier("resume-checked")  # every process reads the old config.json before process 0 replaces it
    if dist.is_main():
        _write_json(out / "config.json", C.to_dict(cfg))
    return out


def load_target(cfg: C.TrainConfig, out: Path):
    """(folder, Target) of model.target; bf16 compute stores the frozen target in bf16 too."""
    import peagle_jax as pj

    if dist.is_main():  # process 0 builds the tiny target (one writer), the others then find it
        tpath = resolve_target(cfg, out)
    dist.barrier("target-ready")
    if not dist.is_main():
        tpath = resolve_target(cfg, out)
    dtype = "bfloat16" if cfg.model.compute_dtype == "bfloat16" else cfg.model.dtype
    target = pj.load_target(tpath, dtype=dtype, load_format=cfg.model.load_format)  # placed on the mesh by the Trainer
    if target.tokenizer is None and cfg.model.load_format == "dummy":
        target.tokenizer = word_tokenizer(target, tpath)
    if target.tokenizer is None:
        raise TrainError(f"{tpath}: the target folder has no tokenizer (tokenizer.json / tokenizer.model)")
    return tpath, target


def word_tokenizer(target, tpath):
    """The synthetic data's word tokenizer (`train.tiny`), standing in for a dummy target's missing
    one: its few ids are valid in any vocabulary at least as large."""
    from train.tiny import tokenizer

    tok = tokenizer()
    if len(tok) > target.config.vocab_size:
        raise TrainError(f"{tpath}: no tokenizer, and a vocabulary of {target.config.vocab_size} < {len(tok)} words")
    return tok


def feature_cache(cfg: C.TrainConfig, trainer: Trainer, tpath: Path):
    if not cfg.data.cache_features:
        return None
    from train.features import FeatureCache

    return FeatureCache(Path(cfg.data.cache_features), trainer.stepper, tpath, cfg)


def run_summary(cfg, trainer: Trainer, ds: D.Dataset, metrics: MetricsLog, tpath, start: int, train_wall, ev) -> dict:
    """The run's numbers, from metrics.jsonl (so a resumed run reports its whole history)."""
    dc, eval_k = cfg.data, trainer.eval_k
    recs = metrics.records()
    tail = recs[-20:]
    per_depth = np.mean([r["acc"] for r in tail], axis=0).tolist() if tail else []
    cond_acc = np.mean([r["cond_acc"] for r in tail], axis=0).tolist() if tail else []
    taus = [1 + float(np.sum(r["cond_acc"][:eval_k])) for r in tail]  # one per batch: a step's sim_tau
    batches = (D.batch_examples(ds.train, s, dc.batch_size, dc.seed) for s in range(trainer.step))
    return {
        "mode": cfg.model.mode,
        "init_head": cfg.model.init_head,
        "k_train": trainer.k,
        "target": str(tpath),
        "train_tokens": int(sum(len(e.ids) for b in batches for e in b)),
        "split_tokens": int(ds.stats["train_tokens"]),
        "steps": trainer.step,
        "stopped_early": trainer.step < trainer.steps,
        "wall_seconds": None,
        "train_seconds": train_wall,
        "first_loss": recs[0]["loss"] if recs else None,
        "final_loss": recs[-1]["loss"] if recs else None,
        "per_depth_accuracy": per_depth,
        "conditional_accuracy": cond_acc,
        "simulated_acceptance_length": float(np.mean(taus)) if taus else None,
        "simulated_acceptance_se": float(np.std(taus, ddof=1) / np.sqrt(len(taus))) if len(taus) > 1 else None,
        "simulated_acceptance_batches": len(taus),
        "simulated_acceptance_definition": f"1 + sum over depths d < {eval_k} of the share of supervised rows "
        "whose drafts at depths 0..d are all right (mean of the last 20 steps; se: their spread)",
        "heldout": ev,
        "data": ds.stats,
        "draft_vocab_size": trainer.drafter.config.draft_vocab_size,
        "resumed_from_step": start,
        "target_load_format": cfg.model.load_format,
    }


def serving_advice(summary: dict, records: list[dict]) -> dict:
    """{best_k, payoff, accelerator_command}: the fastest measured K, what a head needs to pay
    off per K (`train.payoff`) and a run of the tokens the fitted curve asks for at that K."""
    by_k = summary["eval"]["by_k"]
    best = fastest_k(by_k)
    pay = payoff(records, by_k)
    needed = [(v["tokens_needed"], k) for k, v in pay.items() if v["tokens_needed"]]
    out = {"best_k": int(best), "payoff": pay, "accelerator_command": None}
    if needed and summary["steps"] and by_k[best]["speedup"] < 1.0:  # a head that pays off needs no budget
        tokens, k = min(needed)
        per_step = summary["train_tokens"] / summary["steps"]
        steps = max(1, math.ceil(tokens / per_step / 8))  # 8 sequences per step on an accelerator
        if steps > INT_MAX:  # more than --loop.steps takes: no command to suggest, the advice says so
            out["accelerator_steps_beyond"] = steps
        else:
            out["accelerator_command"] = (
                f"python -m train --data.max_conversations 0 --data.regenerate True --data.batch_size 8 "
                f"--loop.steps {steps} --model.compute_dtype bfloat16 --out OUT   # ~{tokens:.2g} tokens for K={k}"
            )
    return out


def measure_speed(cfg: C.TrainConfig, target, head, log) -> dict:
    """Acceptance length and speed against plain decoding on cfg.eval's prompts, per K."""
    from peagle_jax.engine import prompt_ids
    from train.evaluate import measure

    prompts = prompt_ids(target.tokenizer, _eval_conversations(cfg), max_tokens=256)
    log(f"evaluating on {len(prompts)} {cfg.eval.prompts} prompts, K={list(cfg.eval.ks)}")
    ev = measure(target, head, prompts, ks=cfg.eval.ks, mode=cfg.model.mode, max_new=cfg.eval.max_new_tokens)
    log("evaluated")
    main_k = 7 if 7 in ev["by_k"] else max(ev["by_k"])
    return {
        **ev["by_k"][main_k],
        "baseline_tokens_per_second": ev["baseline_tokens_per_second"],
        "prompts": ev["prompts"],
        "max_new_tokens": ev["max_new_tokens"],
        "prompt_set": cfg.eval.prompts,
        "by_k": ev["by_k"],
    }


def _eval_conversations(cfg: C.TrainConfig):
    if cfg.eval.prompts == "synthetic":
        convs = D.synthetic_conversations(cfg.eval.num_prompts, seed=10_000 + cfg.data.seed)
        return [[m for m in c if m["role"] == "user"] for c in convs]
    from peagle_jax.engine import load_prompts

    return load_prompts(cfg.eval.prompts, cfg.eval.num_prompts)
