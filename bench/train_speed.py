"""Drafter-training speed: this trainer's jitted step against speculators' own P-EAGLE training step.

Both sides train the same head on the same COD rows of one sequence of L tokens, in float32 on
the same CPU threads, one optimizer step = forward + backward + gradient clipping + AdamW:

* ours: `train.step.TrainStep` on cached target features (the step `python -m train` runs with
  `--data.cache_features`), rows from `train.cod.make_batch` (the trainer's defaults: K_train 8,
  r 0.7, r_min 0.2, rows padded to row_factor 3.5 x L in buckets of 512), attention `auto`
  (a dense [rows, rows] mask up to 512 rows, the blockwise kernels beyond, the chain keys gathered:
  `AttentionSpec.chain_depth` K - 1; the first layer attends the mask slot once per position,
  `kernels.slot_attention`), optax AdamW.
* theirs: speculators 0.9.0 `PEagleDraftModel` (PyTorch) doing what `speculators.train.trainer`
  does per step minus autocast (f32): `model(**batch)`, `zero_grad`, `loss.backward()`,
  `clip_grad_norm_(1.0)`, `torch.optim.AdamW` step, linear LR schedule step. Loss: its eager
  `kl_div_loss` (the default `fused` loss is a Triton kernel, GPU only). Attention: `--their-attn`,
  one or both of the `draft_attn_impl` choices it offers "for hardware that doesn't support flex
  attention": `sdpa` (a bool [rows, rows] mask from `create_mask`, torch SDPA) and `eager` (a
  float mask from `create_float_mask`, matmul + softmax). Its default, `simple_flex_attention`,
  cannot train on CPU (torch 2.13: "FlexAttention does not support backward on CPU"). Its COD
  sampler (`generate_cod_sample_indices`, called inside `forward`) is replaced, while its forward
  runs, by one returning our rows (the padding rows left out), so both sides see the same rows;
  the sampler's own time is measured apart (`their_sampler_ms`). Optimizer: AdamW (its CLI's
  default is Muon).

The head: the default of `python -m train` for Gemma-3-270M (one layer, --layers N for more; width 640, 4 heads of 256,
1 KV head, MLP 2048, fc_norm, draft vocabulary 16384, embed_tokens and lm_head frozen; speculators'
P-EAGLE trains embed_tokens by default: --train-embed trains it on both sides) built by
`pj.new_drafter` from the real target, exported to speculators' layout (f32) and loaded into
`PEagleDraftModel`, so both start from the same weights; the first step's losses are compared
(`loss_ours`, `loss_theirs[...]`, `loss_max_rel_diff`). Features are random arrays of the cached
features' shapes (aux [L, 3 x 640], final-norm states [L, 640], RMS-normalised so speculators'
verifier_norm (weight 1) leaves them as they are); the target forward is in neither side.
Loss mask: the first (1 - --loss-fraction) of the positions are a prompt (no loss), the rest
supervised (default 0.9; the bundled ShareGPT chats supervise 70% of their tokens): rows without
loss cost us no vocabulary work (`train.loss.fused_kl`), speculators computes them and masks.

Timing: each side's first step (XLA compile; torch's first call) is excluded, then --repeats
rounds of ours, theirs (each --their-attn), ours, theirs, ... in one process
(`peagle_jax.runtime.timing.side_by_side`); the median and
min step times are reported, with sequence tokens/s and COD rows/s (real rows, the same both
sides), and speedup = their median / ours. --threads N restricts the process to N cores (XLA
sizes its pool from the affinity mask) and sets torch's threads to N. --profile adds one
profiled step per side: torch.profiler self CPU time by (op, input shapes); XLA's trace summed
by HLO instruction (thread-ms), each with its shapes and JAX op name from the compiled module;
both split into draft vocab / embedding / attention / other by the shapes the ops touch.

    python -m bench.train_speed [--lengths 512,2048] [--repeats 5] [--their-attn sdpa,eager]
        [--threads N] [--train-embed] [--attention auto|dense|kernels] [--loss-fraction F] [--layers N] [--profile]
        [--json runs/bench/train_speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

from bench.command import command_line

K, DRAFT_VOCAB, ROW_FACTOR, ROW_GRANULARITY = 8, 16384, 3.5, 512
ATTN = ("sdpa", "eager")  # simple_flex_attention: no backward on CPU


def build(
    length: int,
    threads: int,
    their_attns: list[str],
    small: bool,
    train_embed: bool = False,
    attention: str = "auto",
    loss_fraction: float = 0.9,
    layers: int = 1,
):
    """(our step, our compiled HLO text (a function), theirs {attn: (step, model)}, info); the
    steps take no argument and return the loss."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from speculators.config import SpeculatorModelConfig
    from speculators.losses.eager import kl_div_loss
    from speculators.models.peagle import PEagleDraftModel
    from speculators.models.peagle import core as peagle_core
    from transformers import get_linear_schedule_with_warmup

    import peagle_jax as pj
    from peagle_jax.formats import export_speculators
    from train import cod
    from train.data import Example
    from train.flags import from_dict
    from train.spec import BatchSpec
    from train.step import batch_arrays
    from train.trainer import Trainer

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations inside speculators
    if small:  # tests: the tiny preset's random Llama target instead of Gemma-3-270M
        from train.tiny import build_tiny_target

        with tempfile.TemporaryDirectory() as tmp:
            target = pj.load_target(build_tiny_target(Path(tmp) / "tiny"), dtype="float32")
    else:
        from peagle_jax.sources.assets import prepare

        target = pj.load_target(prepare("gemma3-270m"), dtype="float32")
    v, h = target.config.vocab_size, target.config.hidden_size
    vd = min(DRAFT_VOCAB, v // 2)
    rng = np.random.default_rng(0)
    counts = rng.zipf(1.3, v).astype(np.int64)  # some frequency order for the draft vocabulary
    model = dict(draft_vocab=vd, num_layers=layers, k_train=K, freeze_embed=not train_embed, attention=attention)
    trainer = Trainer(from_dict({"model": model}), target, 1000, token_counts=counts)  # the default recipe
    drafter = trainer.drafter
    head_w_np = np.array(trainer.stepper.head_w, np.float32)  # writable: torch shares it

    # --- the same rows for both
    ids = rng.integers(10, v, length).astype(np.int32)
    mask = np.arange(length) >= int(length * (1 - loss_fraction))  # a prompt, then the supervised answer
    rows = BatchSpec(k=K, max_len=length, length_buckets=1, row_factor=ROW_FACTOR, row_granularity=ROW_GRANULARITY)
    b = cod.make_batch([Example(ids, mask, 0)], rows, step=0)
    real = b.doc[0] >= 0
    aux = (rng.normal(size=(1, length, 3 * h)) * 30).astype(np.float32)
    x = rng.normal(size=(1, length, h)).astype(np.float32)
    eps = drafter.config.rms_norm_eps
    y = (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)).astype(np.float32)  # fixed by an RMSNorm of weight 1

    # --- theirs: our head exported to speculators' layout, loaded into its PyTorch model
    with tempfile.TemporaryDirectory() as tmp:
        export_speculators(drafter, Path(tmp) / "spec", "float32")
        raw = json.loads((Path(tmp) / "spec" / "config.json").read_text())
        state = load_file(str(Path(tmp) / "spec" / "model.safetensors"))
    state["verifier_lm_head.weight"] = torch.as_tensor(head_w_np)
    state["verifier_norm.weight"] = torch.ones(h)
    # the trainer's rows: row t holds token x[t+1], aux[t], teacher at t+1; speculators reads
    # input_ids, aux, teacher and loss mask at the row's reference position: shift them here
    shift = lambda a: np.concatenate([a[:, 1:], np.zeros_like(a[:, :1])], axis=1)  # noqa: E731
    anchor_t = torch.as_tensor(b.anchor[0][real]).long()
    depth_t = torch.as_tensor(b.depth[0][real]).long()
    inputs = dict(
        hidden_states=torch.as_tensor(aux),
        input_ids=torch.as_tensor(shift(b.tokens)).long(),
        document_ids=torch.as_tensor(np.where(np.arange(length) < length - 1, 0, -1)[None]).long(),
        loss_mask=torch.as_tensor(b.sup).float(),
        verifier_last_hidden_states=torch.as_tensor(shift(y)),
        num_depths=K,
        loss_config={"kl_div": (kl_div_loss, 1.0)},
        max_anchors=None,
        down_sample_ratio=0.7,
        down_sample_ratio_min=0.2,
    )
    t0 = time.perf_counter()
    peagle_core.generate_cod_sample_indices(seq_length=length, loss_mask=inputs["loss_mask"], num_depths=K)
    sampler_ms = (time.perf_counter() - t0) * 1e3
    sampler = peagle_core.generate_cod_sample_indices

    def pinned(**kw):  # our rows (see the docstring)
        return anchor_t, depth_t

    theirs = {}
    for attn in their_attns:
        cfg = SpeculatorModelConfig.from_dict(raw)
        cfg.transformer_layer_config._attn_implementation = attn
        torch.manual_seed(0)
        model = PEagleDraftModel(cfg)
        res = model.load_state_dict(state, strict=False)
        assert not res.missing_keys and not res.unexpected_keys, res
        model.embed_tokens.weight.requires_grad_(train_embed)  # its P-EAGLE default: True
        model.train()
        opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3, weight_decay=0.01)
        sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=1000)

        def their_step(model=model, opt=opt, sched=sched):
            peagle_core.generate_cod_sample_indices = pinned  # only while its forward runs
            try:
                _, loss, _ = model(**inputs)
            finally:
                peagle_core.generate_cod_sample_indices = sampler
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            return float(loss.detach())

        theirs[attn] = (their_step, model)

    # --- ours: the trainer's cached-features step
    batch = batch_arrays(b)
    feats = (jnp.asarray(aux), jnp.asarray(y))

    def our_step():
        return float(jax.block_until_ready(trainer.update(batch, feats)["loss"]))

    def our_hlo() -> str:  # the compiled step's HLO text (a second compile: --profile only)
        t = trainer
        return t.stepper.trace_cached(t.params, t.opt_state, t.frozen, *feats, batch).lower().compile().as_text()

    info = {
        "length": length,
        "rows_padded": int(b.anchor.shape[1]),
        "rows": int(real.sum()),
        "supervised_rows": int((b.sup[0][np.clip(b.anchor[0] + b.depth[0], 0, length - 1)] & real).sum()),
        "loss_fraction": loss_fraction,
        "rows_per_depth": np.bincount(b.depth[0][real], minlength=K).tolist(),
        "their_sampler_ms": sampler_ms,
        "head": {
            "hidden": drafter.config.hidden_size,
            "heads": drafter.config.num_heads,
            "kv_heads": drafter.config.num_kv_heads,
            "head_dim": drafter.config.head_dim,
            "intermediate": drafter.config.intermediate_size,
            "draft_vocab": drafter.config.draft_vocab_size,
            "vocab": v,
            "layers": drafter.config.num_layers,
        },
    }
    return our_step, our_hlo, theirs, info


def measure(length: int, a) -> dict:
    our_step, our_hlo, theirs, info = build(
        length, a.threads, a.their_attn, a.small, a.train_embed, a.attention, a.loss_fraction, a.layers
    )
    from peagle_jax.runtime.timing import side_by_side, wall

    steps = {"ours": our_step, **{attn: step for attn, (step, _) in theirs.items()}}
    info["ours_first_s"], info["loss_ours"] = wall(our_step)
    for attn, step in list(steps.items())[1:]:
        info[f"theirs_first_s[{attn}]"], info[f"loss_theirs[{attn}]"] = wall(step)
    sides = {}
    for name, t in side_by_side(steps, a.repeats, first=False).items():
        med = t.ms / 1e3
        sides[name] = {
            "times_s": list(t.times),
            "median_ms": t.ms,
            "min_ms": t.min_ms,
            "tokens_per_s": length / med,
            "rows_per_s": info["rows"] / med,
        }
    info["sides"] = sides
    ours = sides["ours"]["median_ms"]
    info["speedup"] = {attn: sides[attn]["median_ms"] / ours for attn in theirs}
    if a.profile:
        from bench.step_profile import profile_ours, profile_theirs

        info["profile_ours"] = profile_ours(our_step, our_hlo(), info, a.top)
        info["profile_theirs"] = {attn: profile_theirs(step, info, a.top) for attn, (step, _) in theirs.items()}
    info["loss_max_rel_diff"] = max(
        abs(info[f"loss_theirs[{attn}]"] - info["loss_ours"]) / max(abs(info["loss_ours"]), 1e-12) for attn in theirs
    )
    return info


def commit() -> str | None:
    """The checkout's HEAD (+ "-dirty" with uncommitted changes), None outside git."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.train_speed", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,2048", help="sequence lengths (tokens), comma separated")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (each: ours, then theirs)")
    ap.add_argument(
        "--their-attn",
        default="sdpa,eager",
        help=f"speculators draft_attn_impl values to time, comma separated ({', '.join(ATTN)})",
    )
    ap.add_argument("--threads", type=int, default=None, help="CPU cores for both sides (default: all available)")
    ap.add_argument("--profile", action="store_true", help="one extra profiled step per side: what dominates")
    ap.add_argument("--top", type=int, default=8, help="--profile: ops listed per side")
    ap.add_argument(
        "--train-embed",
        action="store_true",
        help="train embed_tokens on both sides (speculators' P-EAGLE default; ours freezes it by default)",
    )
    ap.add_argument(
        "--attention",
        default="auto",
        choices=("auto", "dense", "kernels"),
        help="ours: model.attention (trainer default auto)",
    )
    ap.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's allocator as it is (default: peagle_jax.runtime.host.reuse_freed_memory, as the trainer)",
    )
    ap.add_argument(
        "--layers", type=int, default=1, help="drafter layers (the trainer's default 1; the released heads have 4)"
    )
    ap.add_argument(
        "--loss-fraction",
        type=float,
        default=0.9,
        help="supervised share of the positions (a prompt first; 0.7 = the bundled ShareGPT chats' token-weighted share)",
    )
    ap.add_argument("--small", action="store_true", help="a tiny random target instead of Gemma-3-270M (tests)")
    ap.add_argument("--json", default="runs/bench/train_speed.json")
    a = ap.parse_args(argv)
    a.their_attn = [s for s in a.their_attn.split(",") if s]
    bad = sorted(set(a.their_attn) - set(ATTN))
    if not a.their_attn:
        ap.error(f"--their-attn: name at least one of {', '.join(ATTN)}")
    if bad:
        ap.error(f"--their-attn: unknown {bad} (known: {', '.join(ATTN)})")
    if not 0 < a.loss_fraction <= 1:
        ap.error(f"--loss-fraction must be in (0, 1], got {a.loss_fraction}")
    cpus = sorted(os.sched_getaffinity(0))
    a.threads = a.threads or len(cpus)
    if a.threads < len(cpus):  # XLA sizes its thread pool from the affinity mask; torch from set_num_threads
        if "jax" in sys.modules or "torch" in sys.modules:
            ap.error("--threads below the available cores needs a fresh process (jax/torch already imported)")
        os.sched_setaffinity(0, cpus[: a.threads])
    from peagle_jax.runtime.host import reuse_freed_memory

    reused = not a.default_malloc and reuse_freed_memory()  # both sides, as `python -m train` does

    load_start = os.getloadavg()
    results = []
    print(f"{'tokens':>7} {'rows':>6} {'side':>22} {'median ms':>10} {'min ms':>9} {'tokens/s':>9} "
          f"{'rows/s':>8} {'speedup':>8}  first-step loss", flush=True)  # fmt: skip
    for length in (int(s) for s in a.lengths.split(",")):
        r = measure(length, a)
        results.append(r)
        for name, s in r["sides"].items():
            loss = r["loss_ours"] if name == "ours" else r[f"loss_theirs[{name}]"]
            sp = "" if name == "ours" else f"{r['speedup'][name]:.2f}x"
            label = "ours (jax)" if name == "ours" else f"speculators {name}"
            print(
                f"{length:>7} {r['rows']:>6} {label:>22} {s['median_ms']:>10.1f} {s['min_ms']:>9.1f} "
                f"{s['tokens_per_s']:>9.1f} {s['rows_per_s']:>8.1f} {sp:>8}  {loss:.6f}",
                flush=True,
            )
        if a.profile:
            for name, prof in [("ours", r["profile_ours"]), *r["profile_theirs"].items()]:
                if isinstance(prof, str):
                    print(f"  profile {name}: {prof}")
                    continue
                cats = ", ".join(f"{c} {100 * v['share']:.0f}%" for c, v in prof["categories"].items())
                print(f"  profile {name}: {prof['total_ms']:.0f} thread-ms: {cats}")
                for p in prof["top"]:
                    print(f"    {p['ms']:9.1f} ms {100 * p['share']:5.1f}%  {p['category']:>11}  {p['op'][:110]}")
    import jax
    import torch

    meta = {
        "command": command_line("bench.train_speed", argv),
        "cpus": len(os.sched_getaffinity(0)),
        "threads": a.threads,
        "torch_threads": torch.get_num_threads(),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "k": K,
        "repeats": a.repeats,
        "train_embed": a.train_embed,
        "attention_ours": a.attention,
        "commit": commit(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "reuse_freed_memory": reused,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
    }
    try:
        import speculators

        meta["speculators"] = speculators.__version__
    except (ImportError, AttributeError):
        pass
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
