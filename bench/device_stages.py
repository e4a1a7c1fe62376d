"""The device playbook's stage children (`python -m bench.device` runs each in its own process):
`--stage train_step` (the trainer's step, Pallas against XLA, at growing lengths) and
`--stage kernels_tpu` (the Pallas TPU kernels against the XLA paths). Each writes its JSON after
every measurement, so a stage killed at its timeout keeps what it measured."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from bench.device import ACCELERATORS, error_line, write_json

STEP_LENGTHS, SMOKE_STEP_LENGTHS = (8192, 16384, 32768), (64,)
MAX_STEP_LENGTH, SMOKE_MAX_STEP_LENGTH = 1 << 20, 128
RECIPE_TOKENS, SMOKE_RECIPE_TOKENS = 256, 64  # the default recipe's data.max_len; the tiny preset's


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device_stages", description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=("train_step", "kernels_tpu"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=60.0, help="the child's time")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--target", default="gemma3-270m", help="an asset name, a folder, a Hub id or (dummy) a preset")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    return stage_main(p.parse_args(argv))


def stage_main(args) -> int:
    """A stage's child process (--stage): writes DIR/stages/STAGE.json (after every measurement)."""
    out = Path(args.out)
    deadline = time.monotonic() + args.seconds - 10  # leave time to write and exit
    if args.stage == "train_step":
        target = _step_target(out, args.smoke, args.target, args.load_format)
        train_step_stage(target, out / "stages" / "train_step.json", deadline, args.smoke)
    else:
        tpu_kernels_stage(out / "kernels" / "tpu.json", deadline, args.smoke)
    return 0


def _step_target(out: Path, smoke: bool, name: str, load_format: str):
    """(target, token counts, compute dtype) of the train_step stage: `name` (an asset, a folder, a
    Hub id or a preset; a tiny random Llama for --smoke) with its weights or dummy ones, stored in
    the compute dtype as `python -m train` does."""
    import jax
    import numpy as np

    import peagle_jax as pj
    from peagle_jax.sources.assets import ASSETS, prepare

    if smoke:
        from train.tiny import build_tiny_target

        path = build_tiny_target(out / "tiny-target")  # train_head and evaluate use it too
    else:
        path = prepare(name) if name in ASSETS else name
    dtype = "bfloat16" if jax.default_backend() in ACCELERATORS else "float32"
    t0 = time.perf_counter()
    target = pj.load_target(path, dtype=dtype, load_format=load_format)
    print(f"[train_step] target {name} ({load_format} weights) in {time.perf_counter() - t0:.1f} s", flush=True)
    counts = np.random.default_rng(0).zipf(1.3, target.config.vocab_size).astype(np.int64)
    return target, counts, dtype


def _step_trainer(target, counts, dtype: str, smoke: bool):
    """The default recipe's Trainer (attention "kernels": Pallas on GPU / TPU); smoke: the tiny
    preset's head sizes."""
    from train.flags import from_dict
    from train.trainer import Trainer

    model = {"compute_dtype": dtype, "attention": "kernels"}
    if smoke:
        model.update(draft_vocab=48, k_train=4)
    return Trainer(from_dict({"model": model}), target, 1000, token_counts=counts)


def _example(length: int, vocab: int, seed: int = 0):
    """One random sequence of `length` tokens: a 10% prompt, the rest supervised."""
    import numpy as np

    from train.data import Example

    ids = np.random.default_rng(seed).integers(10, vocab, length).astype(np.int32)
    return Example(ids, np.arange(length) >= length // 10, seed)


def _peak_bytes():
    """The process's peak device memory so far (None where the backend does not say, e.g. CPU)."""
    import jax

    with contextlib.suppress(Exception):
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return None


def time_step(trainer, vocab: int, length: int, variant: str, steps: int) -> dict:
    """One cached-features step of `length` tokens, compiled ahead (variant "xla": traced under
    kernels.for_platform("cpu"), the XLA blockwise path for this device) and timed over `steps`
    steps from a copy of the trainer's state (the compiled step donates its inputs)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kernels
    from kernels.limits import device_name
    from peagle_jax.hardware.devices import rates
    from peagle_jax.runtime.timing import side_by_side
    from train.step import batch_arrays

    st, h = trainer.stepper, trainer.drafter.config.hidden_size
    b = trainer.cod_batch([_example(length, vocab)], 0, length=length)
    batch = st.partition(batch_arrays(b))
    rng = np.random.default_rng(length)
    aux = jnp.asarray(rng.normal(size=(1, length, 3 * h)).astype(np.float32) * 30)
    y = jnp.asarray(rng.normal(size=(1, length, h)).astype(np.float32) * 20)
    row = dict(variant=variant, tokens=length, rows=int(b.anchor.shape[1]))
    t0 = time.perf_counter()
    with kernels.for_platform("cpu") if variant == "xla" else contextlib.nullcontext():
        row["backend"] = kernels.resolve_backend()
        traced = st.trace_cached(trainer.params, trainer.opt_state, trainer.frozen, aux, y, batch)
        compiled = traced.lower().compile()
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    text = compiled.as_text() or ""
    row["pallas_in_program"] = "__gpu$xla.gpu.triton" in text or "tpu_custom_call" in text
    plan = compiled.memory_analysis()
    if plan is not None:
        row["program_bytes"] = int(plan.temp_size_in_bytes + plan.argument_size_in_bytes + plan.output_size_in_bytes)
    state, losses = list(jax.tree.map(jnp.copy, (trainer.params, trainer.opt_state))), []

    def step():  # the compiled step donates its state: each call takes the last one
        state[0], state[1], m = compiled(*state, trainer.frozen, st.head_w, aux, y, batch)
        losses.append(float(m["loss"]))

    step_s = side_by_side({"step": step}, steps, first=False)["step"].ms / 1e3  # compiled ahead: every step timed
    row["first_loss"] = losses[0]  # from the same state and rows in both variants: they should agree
    row.update(status="ok", step_ms=round(1e3 * step_s, 2), tokens_per_second=round(length / step_s))
    row["peak_bytes_in_use"] = _peak_bytes()
    if row["peak_bytes_in_use"] and row.get("program_bytes"):  # the process's running peak / the program's plan
        row["peak_over_plan"] = round(row["peak_bytes_in_use"] / row["program_bytes"], 3)
    est = step_estimate(traced, compiled, rates(device_name(jax.devices()[0])))
    if est is not None:  # the roofline estimate of `python -m peagle_jax.plan`, calibrated by the measurement
        row.update(
            estimate_ms=round(1e3 * est.seconds, 3), bound=est.bound, measured_over_estimate=step_s / est.seconds
        )
    return row


def step_estimate(traced, compiled, device):
    """The roofline estimate of a compiled one-device step on `device` (`peagle_jax.hardware.devices.rates`;
    None, as for the CPU, which has no published rates: no estimate)."""
    from peagle_jax.hardware.roofline import estimate, gathered_bytes, jaxpr_flops

    plan = compiled.memory_analysis()
    if device is None or plan is None:
        return None
    sizes = dict(
        argument_bytes=plan.argument_size_in_bytes, output_bytes=plan.output_size_in_bytes,
        alias_bytes=plan.alias_size_in_bytes, gathered_bytes=gathered_bytes(traced.jaxpr, compiled),
    )  # fmt: skip
    return estimate(jaxpr_flops(traced.jaxpr), 1, device=device, **sizes)


def recipe_step(trainer, vocab: int, length: int, steps: int) -> dict:
    """The recipe's own step as `python -m train` runs it (the target inside the step, the COD
    batch built and the step's statistics read on the host): median seconds after the first
    (compiling) one."""
    import jax
    import jax.numpy as jnp

    from peagle_jax.runtime.timing import timed

    saved = (*jax.tree.map(jnp.copy, (trainer.params, trainer.opt_state)), trainer.step)
    recs = []

    def step():  # each on a sequence of its own
        i = len(recs)
        recs.append(trainer.train_step(trainer.cod_batch([_example(length, vocab, seed=i)], i, length=length)))

    try:
        timing = timed(step, steps)
    finally:  # the variants' steps start from one state (the step donates the one it is given)
        trainer.params, trainer.opt_state, trainer.step = saved
    step_s = timing.ms / 1e3
    return dict(
        status="ok", tokens=length, compile_s=round(timing.first_s, 2), step_s=round(step_s, 5), loss=recs[-1]["loss"]
    )


def attempt(fn, deadline: float, need_s: float) -> dict:
    """fn()'s record with its seconds, or a failed one (an OOM is a result) or, when fewer than
    `need_s` seconds are left, a skipped one."""
    import gc

    if deadline - time.monotonic() < need_s:
        return {"status": "skipped: out of time"}
    t0 = time.monotonic()
    try:
        rec = fn()
    except Exception as e:  # noqa: BLE001 - out of memory / unsupported are results too
        rec = {"status": f"failed: {error_line(e)}"}
    gc.collect()  # the failed attempt's buffers go before the next one
    return {**rec, "seconds": round(time.monotonic() - t0, 1)}


def train_step_stage(loaded, path: Path, deadline: float, smoke: bool) -> None:
    """The train_step stage: the recipe's step, then Pallas vs XLA at each length, then the Pallas
    step at doubling lengths while the previous one fitted (`path` rewritten after each)."""
    import jax

    target, counts, dtype = loaded
    vocab, steps = target.config.vocab_size, 2 if smoke else 5
    res = dict(platform=jax.default_backend(), compute_dtype=dtype, recipe=None, rows=[], longest_fits={})
    trainers = {v: _step_trainer(target, counts, dtype, smoke) for v in ("pallas", "xla")}
    tokens = SMOKE_RECIPE_TOKENS if smoke else RECIPE_TOKENS
    res["recipe"] = attempt(lambda: recipe_step(trainers["pallas"], vocab, tokens, steps), deadline, 0)
    write_json(path, res)

    def measure(length: int, variant: str) -> dict:
        done = [r for r in res["rows"] if r["variant"] == variant and r["status"] == "ok"]
        need_s = done[-1]["seconds"] * length / done[-1]["tokens"] if done else 0  # time ~ tokens
        row = attempt(lambda: time_step(trainers[variant], vocab, length, variant, steps), deadline, need_s)
        res["rows"].append({"variant": variant, "tokens": length, **row})
        ok = [r["tokens"] for r in res["rows"] if r["variant"] == variant and r["status"] == "ok"]
        res["longest_fits"][variant] = max(ok, default=None)
        write_json(path, res)
        return row

    lengths = SMOKE_STEP_LENGTHS if smoke else STEP_LENGTHS
    for length in lengths:
        at_length = {v: measure(length, v) for v in trainers}
    last = at_length["pallas"]
    length, cap = lengths[-1], SMOKE_MAX_STEP_LENGTH if smoke else MAX_STEP_LENGTH
    while last["status"] == "ok" and length < cap:
        length *= 2
        last = measure(length, "pallas")
    res["longest_fits_capped"] = res["longest_fits"].get("pallas") == cap
    write_json(path, res)
    broken = [r for r in [res["recipe"], *res["rows"][:2]] if r["status"] != "ok"]  # the step does not run at all
    if broken:
        raise SystemExit(f"the train step fails at {broken[0].get('tokens')} tokens: {broken[0]['status']}")


def _rel_err(x, ref) -> float:
    """`kernels.cases.rel_err` over pytrees of arrays: the worst leaf."""
    import jax

    from kernels.cases import rel_err

    return max(rel_err(a, b) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(ref), strict=True))


def _check_impls(impls: dict, args, base: dict, iters: int) -> list[dict]:
    """Rows of {impl, status, compile_s, ms, rel_err_vs_xla} for jitted `impls` (the first, XLA, is
    the reference of the others; more than 2e-2 relative error is WRONG)."""
    from peagle_jax.runtime.timing import timed

    rows, want = [], None
    for name, f in impls.items():
        row = {**base, "impl": name}
        try:
            timing = timed(lambda f=f: f(*args), iters)
            row.update(status="ok", compile_s=round(timing.first_s, 2), ms=round(timing.ms, 3))
            got = f(*args)
            if want is None:
                want = got
            else:
                row["rel_err_vs_xla"] = err = _rel_err(got, want)
                if not err <= 2e-2:
                    row["status"] = f"WRONG: rel err vs xla {err:.3g} > 2e-2"
        except Exception as e:  # noqa: BLE001 - unsupported / OOM are results too
            row["status"] = f"failed: {error_line(e)}"
        rows.append(row)
    return rows


def tpu_attention_rows(n: int, smoke: bool) -> list[dict]:
    """Forward + backward of P-EAGLE attention on a K=8 COD layout of n positions: the Pallas TPU
    kernel against the blockwise XLA path (bf16, Hq 8, Hkv 2, D 128; smoke: f32, tiny, interpreted)."""
    import jax
    import jax.numpy as jnp

    from kernels import AttentionSpec, attention
    from kernels.layouts import cod_layout

    hq, hkv, d, dtype = (2, 1, 32, jnp.float32) if smoke else (8, 2, 128, jnp.bfloat16)
    a, dd, c = cod_layout(n, 8, rng=0)
    spec, t = AttentionSpec.peagle(a, dd, c), len(a)
    ks = jax.random.split(jax.random.PRNGKey(n), 4)
    q, do = (jax.random.normal(k, (1, t, hq, d), dtype) for k in ks[::3])
    k, v = (jax.random.normal(x, (1, t, hkv, d), dtype) for x in ks[1:3])

    def fwd_bwd(backend):
        def step(q, k, v, spec, do):
            fn = lambda q, k, v: attention(q, k, v, spec, backend=backend, interpret="generic" if smoke else False)  # noqa: E731
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(do)

        return jax.jit(step)

    base = dict(kind="attention", n=n, rows=t, hq=hq, hkv=hkv, d=d, dtype=str(jnp.dtype(dtype)))
    return _check_impls(
        {"xla": fwd_bwd("xla"), "pallas_tpu": fwd_bwd("tpu")}, (q, k, v, spec, do), base, 1 if smoke else 5
    )


def tpu_decode_rows(t: int, smoke: bool) -> list[dict]:
    """Decode attention of t query rows over a KV cache at Gemma-3-270M's shapes (Hq 4, Hkv 1,
    D 256, bf16; a 32k cache filled to 4k): the Pallas TPU kernel against the XLA decode path."""
    import functools

    import jax
    import jax.numpy as jnp

    from kernels import decode
    from kernels.cases import decode_positions

    cache, fill, d, dtype = (200, 150, 32, jnp.float32) if smoke else (32768, 4096, 256, jnp.bfloat16)
    ks = jax.random.split(jax.random.PRNGKey(t), 3)
    q = jax.random.normal(ks[0], (1, t, 4, d), dtype)
    k, v = (jax.random.normal(x, (1, cache, 1, d), dtype) for x in ks[1:])
    pos = jnp.asarray(decode_positions(1, t, fill, [fill]))
    kw = dict(scale=d**-0.5)
    impls = {
        "xla_decode": jax.jit(functools.partial(decode.attention, backend="xla", **kw)),
        "pallas_tpu": jax.jit(functools.partial(decode.attention, backend="tpu", interpret="generic" if smoke else False, **kw)),
    }  # fmt: skip
    base = dict(kind="decode", cache=cache, fill=fill, b=1, t=t, hq=4, hkv=1, d=d, dtype=str(jnp.dtype(dtype)))
    return _check_impls(impls, (q, k, v, pos), base, 1 if smoke else 20)


def tpu_kernels_stage(path: Path, deadline: float, smoke: bool) -> None:
    """The kernels stage on a TPU (`path` rewritten after each measurement); exit status 1 when a
    kernel is wrong or fails."""
    import jax

    res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=[])
    for n in (48,) if smoke else (4096, 16384):
        if deadline - time.monotonic() > 0:
            res["rows"] += tpu_attention_rows(n, smoke)
            write_json(path, res)
    for t in (1, 18):
        if deadline - time.monotonic() > 0:
            res["rows"] += tpu_decode_rows(t, smoke)
            write_json(path, res)
    bad = [r for r in res["rows"] if r["status"] != "ok"]
    if bad:
        raise SystemExit(f"{len(bad)} kernel check(s) not ok, first: {bad[0]['impl']} {bad[0]['status']}")


if __name__ == "__main__":
    sys.exit(main())
