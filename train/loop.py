"""`run(cfg)`: target + data -> trained head -> saved, exported, evaluated, summarised.

Determinism and resume: the data order is a seeded permutation per epoch and the COD rows
of step s are seeded by (seed, s, row), so the batches are a pure function of the step;
a rerun with the same OUT restores the latest checkpoint (params, optimizer state, step)
and continues with exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import jax
import numpy as np

from train import cod
from train import config as C
from train import data as D
from train import distributed as dist
from train.checkpoint import Checkpoints
from train.step import (
    TrainStep,
    batch_arrays,
    compute_parts,
    conditional_hits,
    make_optimizer,
    path_of,
    split_params,
)

__all__ = ["run", "TrainError", "serve_command"]


class TrainError(ValueError):
    """A run that cannot start or continue (one-line message)."""


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=float))
    os.replace(tmp, path)


def serve_command(vllm_dir: Path, target_path, k_train: int, mode: str, family: str | None = None) -> str:
    """The vLLM command line (`peagle_jax.serving.serve_command`: method eagle3, K, parallel
    drafting, `--model-impl transformers` for target families whose native vLLM model does not
    capture aux states)."""
    from peagle_jax.serving import serve_command as serve

    return serve(vllm_dir, mode, k_train, family, target=str(target_path))


def resolve_target(cfg: C.TrainConfig, out: Path) -> Path:
    name = cfg.model.target
    if name == "tiny":
        from train.tiny import build_tiny_target

        return build_tiny_target(out / "tiny-target", cfg.model.seed)
    if Path(name).is_dir():
        return Path(name)
    from peagle_jax import assets

    try:
        return assets.prepare(name)
    except Exception as e:  # noqa: BLE001
        raise TrainError(
            f"model.target {name!r}: not a folder, and cannot prepare it as an asset: {str(e).splitlines()[0]}"
        ) from None


def _check_resume(out: Path, cfg: C.TrainConfig) -> None:
    saved = out / "config.json"
    if not saved.exists():
        return
    old = C.load_saved(saved)
    new = C.to_dict(cfg)
    for section in ("model", "data", "optim"):
        for k, v in new[section].items():
            if old.get(section, {}).get(k) != v:
                raise TrainError(
                    f"{out} holds a run with {section}.{k}={old.get(section, {}).get(k)!r} "
                    f"(now {v!r}): use another --out, or the same settings to resume"
                )
    for k in ("steps", "epochs", "per_depth_loss", "chain_decay"):
        if old["loop"].get(k) != new["loop"][k]:
            raise TrainError(
                f"{out} holds a run with loop.{k}={old['loop'].get(k)!r} (now {new['loop'][k]!r}): "
                "use another --out, or the same settings to resume"
            )


def load_data(cfg: C.TrainConfig, tokenizer, out: Path, target=None) -> D.Dataset:
    d = cfg.data
    records = list(D.load_conversations(d.source, d.max_conversations, d.seed))
    regenerated = None
    if d.regenerate:
        from train.regenerate import regenerate

        regenerated = regenerate(records, target, tokenizer, out / "regenerated.jsonl", d.regenerate_tokens)
    examples, stats = D.tokenize(
        records,
        tokenizer,
        template=d.template,
        max_len=d.max_len,
        too_long=d.too_long,
        bad_rows=d.bad_rows,
        regenerated=regenerated,
    )
    train, held = D.split(examples, d.heldout, d.seed)
    stats.update(train=len(train), heldout=len(held), train_tokens=int(sum(len(e.ids) for e in train)))
    return D.Dataset(train, held, stats)


def order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, 1, epoch]).permutation(n)


def batch_examples(train: list, step: int, batch_size: int, seed: int) -> list:
    out = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, j = divmod(i, len(train))
        out.append(train[order(len(train), seed, epoch)[j]])
    return out


class Metrics:
    """OUT/metrics.jsonl (lines past a restored step are dropped) + TensorBoard events; written
    by process 0 only (`enabled`)."""

    def __init__(self, out: Path, resume_step: int, enabled: bool = True):
        self.path = out / "metrics.jsonl"
        self.enabled = enabled
        if not enabled:
            return
        if self.path.exists():
            keep = [
                ln
                for ln in self.path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= resume_step
            ]
            tmp = self.path.with_name("metrics.jsonl.tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            os.replace(tmp, self.path)
        self.f = self.path.open("a")
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except ImportError:
            self.tb = None

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        self.f.write(json.dumps(rec, default=float) + "\n")
        self.f.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])
                elif isinstance(v, list):
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{k}/{i}", x, rec["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self.f.close()
        if self.tb is not None:
            self.tb.close()


def summarize(m: dict, batch, k: int, eval_k: int, first_row: int | None = None) -> dict:
    """Host metrics of one step: per-depth accuracy, conditional accuracy, simulated tau.
    first_row: `batch` holds this process's rows only, from that global row (hit / sup are then
    split over processes): their conditional counts are summed over processes."""
    rows_split = first_row is not None
    correct, total = np.asarray(m["correct"]), np.asarray(m["total"])
    acc = np.where(total > 0, correct / np.maximum(total, 1), 0.0)
    hit, sup = (dist.local_rows(m[n]) if rows_split else np.asarray(m[n]) for n in ("hit", "sup"))
    cond, ctot = conditional_hits(hit, sup, batch.anchor, batch.depth, batch.doc, k)
    if rows_split:
        cond, ctot = dist.sum_over_processes(cond, first_row), dist.sum_over_processes(ctot, first_row)
    cacc = np.where(ctot > 0, cond / np.maximum(ctot, 1), 0.0)
    return {
        "loss": float(m["loss"]),
        "acc": acc.tolist(),
        "cond_acc": cacc.tolist(),
        "sim_tau": float(1.0 + cacc[:eval_k].sum()),
        "correct": correct,
        "total": total,
        "cond": cond,
        "ctot": ctot,
    }


def run(cfg: C.TrainConfig) -> dict | None:
    """Trains, saves, exports and evaluates; the summary (None on processes other than 0)."""
    t0 = time.perf_counter()
    dist.setup(cfg.dist)  # before any JAX op: the devices of every process form one mesh
    import peagle_jax as pj
    from peagle_jax.drafter import Drafter
    from peagle_jax.sharding import device_mesh

    main = dist.is_main()
    if dist.multi_process() and (cfg.data.cache_features or cfg.data.regenerate):
        raise TrainError("data.cache_features and data.regenerate run in one process only (dist.num_processes 1)")
    mesh = device_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    out = Path(cfg.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    _check_resume(out, cfg)
    dist.barrier("resume-checked")  # every process reads the old config.json before process 0 replaces it
    if main:
        _write_json(out / "config.json", C.to_dict(cfg))

    def log(msg: str) -> None:
        if main:
            print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    if main:  # process 0 builds the tiny target (one writer), the others then find it
        tpath = resolve_target(cfg, out)
    dist.barrier("target-ready")
    if not main:
        tpath = resolve_target(cfg, out)
    # bf16 compute: the frozen target is stored in bf16 too (no master copy needed)
    tdtype = "bfloat16" if cfg.model.compute_dtype == "bfloat16" else cfg.model.dtype
    target = pj.load_target(tpath, dtype=tdtype)  # placed on the mesh by TrainStep
    tok = target.tokenizer
    if tok is None:
        raise TrainError(f"{tpath}: the target folder has no tokenizer (tokenizer.json / tokenizer.model)")
    log(f"target {tpath} loaded")
    ds = load_data(cfg, tok, out, target)
    log(f"data: {json.dumps(ds.stats)}")
    if cfg.data.prepare_only:
        if main:
            wall = time.perf_counter() - t0
            _write_json(
                out / "summary.json",
                {"prepared_only": True, "target": str(tpath), "data": ds.stats, "wall_seconds": wall},
            )
        return {"prepared_only": True, "out": str(out)} if main else None
    mc = cfg.model
    v = target.config.vocab_size
    if mc.draft_vocab > v:
        raise TrainError(f"model.draft_vocab={mc.draft_vocab} exceeds the target's vocabulary of {v}")
    if mc.mask_token_id is not None and not 0 <= mc.mask_token_id < v:
        raise TrainError(f"model.mask_token_id={mc.mask_token_id} is outside the target's vocabulary [0, {v})")
    if target.config.num_layers < 4:
        raise TrainError(f"{tpath}: a target of {target.config.num_layers} layers has no 3 distinct aux layers")
    counts = D.token_counts(ds.train, v)
    vd = mc.draft_vocab if 0 < mc.draft_vocab < v else None
    drafter = pj.new_drafter(
        target,
        num_layers=mc.num_layers,
        mode=mc.mode,
        draft_vocab=vd,
        seed=mc.seed,
        mask_token_id=mc.mask_token_id,
        k_train=mc.k_train,
        token_counts=counts if vd else None,
        dtype=mc.dtype,
        fc_norm=mc.fc_norm,
        norm_before_fc=mc.norm_before_fc,
    )
    used = (np.arange(drafter.config.draft_vocab_size) + drafter.d2t).astype(np.int64)
    head_w = jax.numpy.asarray(target.embedding_arrays()[1][used], drafter.dtype)
    parts, params, frozen = split_params(drafter, mc.freeze_embed, mc.freeze_lm_head)
    parts = compute_parts(parts, drafter.config, mc.compute_dtype, mc.dtype)
    if mc.norm_from_target:
        tnorm = np.asarray(target.state["norm"]["weight"][...], np.float32) + target.config.norm_offset
        params["norm.weight"] = jax.numpy.asarray(tnorm, params["norm.weight"].dtype)

    lc, oc, dc = cfg.loop, cfg.optim, cfg.data
    total = lc.steps or max(1, math.ceil(lc.epochs * len(ds.train) / dc.batch_size))
    opt = make_optimizer(
        oc.lr, oc.warmup_steps, total, oc.min_lr_ratio, oc.b1, oc.b2, oc.weight_decay, oc.clip, oc.norm_lr_scale
    )
    opt_state = opt.init(params)
    k = mc.k_train
    stepper = TrainStep(
        parts,
        opt,
        target,
        head_w,
        mode=mc.mode,
        k=k,
        per_depth=lc.per_depth_loss,
        chain_decay=lc.chain_decay,
        attention=mc.attention,
        segments=lc.segments,
        max_rows_per_segment=lc.max_rows_per_segment,
        mesh=mesh,
        state=(params, opt_state, frozen),
    )
    lo, hi = stepper.rows(dc.batch_size)  # this process's rows of every batch (fails early if uneven)
    params, opt_state, frozen = stepper.place_state(params, opt_state, frozen)
    target.state, target.mesh = stepper.target_state, mesh  # keep only the placed copy
    log(f"mesh {dict(mesh.shape)} over {jax.device_count()} devices, {jax.process_count()} process(es)")
    ckpt = Checkpoints(out / "checkpoints", lc.keep)
    start = 0
    latest = ckpt.latest()
    if latest is not None:  # restored onto this run's mesh, whatever mesh wrote it
        params, opt_state, meta = ckpt.restore(latest, params, opt_state)
        start = int(meta["step"])
        log(f"resumed from {out / 'checkpoints'} at step {start}")
    feats = None
    if dc.cache_features:
        from train.features import FeatureCache

        feats = FeatureCache(Path(dc.cache_features), stepper, tpath, cfg)
    metrics = Metrics(out, start, enabled=main)
    eval_k = min(7, k)
    kw = dict(
        seed=dc.seed,
        max_len=dc.max_len,
        mode=mc.mode,
        k=k,
        r=dc.cod_r,
        r_min=dc.cod_r_min,
        max_anchors=dc.max_anchors,
        row_factor=dc.row_factor,
        length_buckets=dc.length_buckets,
        row_granularity=dc.row_granularity,
    )

    def heldout_eval(step: int) -> dict | None:
        if not ds.heldout:
            return None
        sums = None
        for i in range(0, len(ds.heldout), dc.batch_size):
            b = cod.make_batch(ds.heldout[i : i + dc.batch_size], step=10**9 + i, **kw)  # fixed eval rows
            s = summarize(stepper.evaluate(params, frozen, batch_arrays(b)), b, k, eval_k)
            s["n"] = 1
            sums = (
                s
                if sums is None
                else {
                    key: sums[key] + s[key] if key in ("correct", "total", "cond", "ctot", "loss", "n") else None
                    for key in s
                }
            )
        acc = sums["correct"] / np.maximum(sums["total"], 1)
        cacc = sums["cond"] / np.maximum(sums["ctot"], 1)
        rec = {
            "step": step,
            "eval_loss": sums["loss"] / sums["n"],
            "eval_acc": acc.tolist(),
            "eval_cond_acc": cacc.tolist(),
            "eval_sim_tau": float(1 + cacc[:eval_k].sum()),
        }
        metrics.log(rec)
        return rec

    from tqdm import tqdm

    kill_at = int(os.environ.get("PEAGLE_TRAIN_SIGKILL_AT_STEP", "0"))

    bar = tqdm(total=total, initial=start, disable=not (lc.progress and main), dynamic_ncols=True, desc="train")
    tokens_done, t_train = 0, time.perf_counter()
    eval_rec = None
    try:
        for step in range(start, total):
            exs = batch_examples(ds.train, step, dc.batch_size, dc.seed)  # the global batch
            n_tokens = sum(len(e.ids) for e in exs)
            length = cod.bucket_for(max(len(e.ids) for e in exs), dc.max_len, dc.length_buckets)
            b = cod.make_batch(exs[lo:hi], step=step, first_row=lo, length=length, **kw)  # this process's rows
            if dist.multi_process():  # one row bucket for all: the largest (only the row count travels)
                b = cod.pad_rows(b, dist.max_over_processes(b.anchor.shape[1]))
            f = feats.get(exs, b) if feats is not None else None
            params, opt_state, m = stepper(params, opt_state, frozen, batch_arrays(b), f)
            s = summarize(m, b, k, eval_k, first_row=lo)
            tokens_done += n_tokens
            dt = time.perf_counter() - t_train
            rec = {
                "step": step + 1,
                "loss": s["loss"],
                "acc": s["acc"],
                "cond_acc": s["cond_acc"],
                "sim_tau": s["sim_tau"],
                "grad_norm": float(m["grad_norm"]),
                "tokens": n_tokens,
                "tokens_per_second": tokens_done / dt,
                "lr": float(opt_schedule_lr(oc, total, step)),
            }
            metrics.log(rec)
            bar.set_postfix(
                loss=f"{s['loss']:.3f}",
                a0=f"{s['acc'][0]:.2f}",
                a1=f"{s['acc'][1] if k > 1 else 0:.2f}",
                a2=f"{s['acc'][2] if k > 2 else 0:.2f}",
                tok_s=f"{rec['tokens_per_second']:.0f}",
            )
            bar.update(1)
            done = step + 1
            if lc.eval_every and done % lc.eval_every == 0 and done < total:
                eval_rec = heldout_eval(done)
            if done % lc.checkpoint_every == 0 or done == total:
                ckpt.save(done, params, opt_state, {"step": done, "seed": dc.seed, "config": C.to_dict(cfg)})
            if kill_at == done:  # tests: a hard kill (no cleanup) after this step
                os.kill(os.getpid(), signal.SIGKILL)
    finally:
        bar.close()
    ckpt.close()
    eval_rec = heldout_eval(total)
    train_wall = time.perf_counter() - t_train
    log(
        f"trained {total - start} steps in {train_wall:.1f} s"
        + (f"; held-out loss {eval_rec['eval_loss']:.4f}" if eval_rec else "")
    )

    # head: save, export, evaluate
    arrays = {**dist.to_host(params), **dist.to_host(frozen)}  # gathered from every process
    if not main:
        metrics.close()
        return None
    if dist.multi_process():  # the final speculative eval runs on process 0 alone, with its own copy
        target = pj.load_target(tpath, dtype=tdtype)
    arrays = {path_of(kk): vv for kk, vv in arrays.items()}
    head = Drafter.from_arrays(drafter.config, arrays, mc.dtype)
    head_dir = head.save(out / "head")
    from peagle_jax.convert import export_drafter

    try:
        vllm_dir, report = export_drafter(
            head_dir, out / "vllm", "vllm", dtype=cfg.eval.export_dtype, target=tpath, overwrite=True
        )
    except Exception as e:  # noqa: BLE001 - export refused (inspect found a problem)
        raise TrainError(f"export refused: {str(e).splitlines()[0]}") from None
    log(f"saved {head_dir}, exported {vllm_dir}")
    # from metrics.jsonl, so a resumed run reports its whole history
    recs = [json.loads(ln) for ln in metrics.path.read_text().splitlines() if '"loss"' in ln]
    tail = recs[-20:]
    per_depth = np.mean([r["acc"] for r in tail], axis=0).tolist() if tail else []
    cond_acc = np.mean([r["cond_acc"] for r in tail], axis=0).tolist() if tail else []
    first_loss = recs[0]["loss"] if recs else None
    last = recs[-1] if recs else None
    summary = {
        "mode": mc.mode,
        "k_train": k,
        "target": str(tpath),
        "train_tokens": int(
            sum(len(e.ids) for s_ in range(total) for e in batch_examples(ds.train, s_, dc.batch_size, dc.seed))
        ),
        "split_tokens": int(ds.stats["train_tokens"]),
        "steps": total,
        "wall_seconds": None,
        "train_seconds": train_wall,
        "first_loss": first_loss,
        "final_loss": None if last is None else last["loss"],
        "per_depth_accuracy": per_depth,
        "conditional_accuracy": cond_acc,
        "simulated_acceptance_length": float(1 + np.sum(cond_acc[:eval_k])) if cond_acc else None,
        "simulated_acceptance_definition": f"1 + sum over depths d < {eval_k} of the share of supervised rows "
        "whose drafts at depths 0..d are all right (mean of the last 20 steps)",
        "heldout": eval_rec,
        "data": ds.stats,
        "draft_vocab_size": drafter.config.draft_vocab_size,
        "head_dir": str(head_dir),
        "vllm_dir": str(vllm_dir),
        "export_warnings": report.get("warnings", []),
        "resumed_from_step": start,
    }
    if cfg.eval.enabled:
        from train.evaluate import measure, prompt_ids

        convs = _eval_conversations(cfg)
        prompts = prompt_ids(tok, convs, max_prompt=256)
        log(f"evaluating on {len(prompts)} {cfg.eval.prompts} prompts, K={list(cfg.eval.ks)}")
        ev = measure(target, head, prompts, ks=cfg.eval.ks, mode=mc.mode, max_new=cfg.eval.max_new_tokens)
        log("evaluated")
        main_k = 7 if 7 in ev["by_k"] else max(ev["by_k"])
        summary["eval"] = {
            **ev["by_k"][main_k],
            "baseline_tokens_per_second": ev["baseline_tokens_per_second"],
            "prompts": ev["prompts"],
            "max_new_tokens": ev["max_new_tokens"],
            "prompt_set": cfg.eval.prompts,
            "by_k": ev["by_k"],
        }
    summary["serve"] = report.get("serve") or serve_command(vllm_dir, tpath, k, mc.mode, target.config.model_type)
    summary["wall_seconds"] = time.perf_counter() - t0
    _write_json(out / "summary.json", summary)
    metrics.close()
    return summary


def opt_schedule_lr(oc, total: int, step: int) -> float:
    import optax

    warm = max(0, min(oc.warmup_steps, total - 1))
    return float(
        optax.warmup_cosine_decay_schedule(0.0, oc.lr, warm, max(total, warm + 1), oc.lr * oc.min_lr_ratio)(step)
    )


def _eval_conversations(cfg: C.TrainConfig):
    if cfg.eval.prompts == "synthetic":
        convs = D.synthetic_conversations(cfg.eval.num_prompts, seed=10_000 + cfg.data.seed)
        return [[m for m in c if m["role"] == "user"] for c in convs]
    from peagle_jax.prompts import load_prompts

    return load_prompts(cfg.eval.prompts, cfg.eval.num_prompts)
