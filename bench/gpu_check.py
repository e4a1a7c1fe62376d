"""GPU check for a lent device (H200 / any CUDA GPU): correctness + timings, < 8 minutes.

    python -m bench.gpu_check [--json gpu_check.json] [--n 4096 8192 16384]
    python -m bench.gpu_check --parts decode      # only the decode kernel (tests + timings)
    python -m bench.gpu_check --smoke             # CPU dry run of this script (interpret mode)

1. Runs the ``gpu``-marked tests of tests/kernels/test_kernels_gpu.py and
   tests/kernels/test_kernels_decode_pallas.py natively (Pallas Triton kernels vs the dense
   reference / the XLA decode path at bf16 tolerances, determinism, per-row block reads; their
   cases: `kernels.cases`).
2. Times forward+backward of P-EAGLE attention on K=8 COD layouts (N positions ->
   ~3.4 N rows) for the Pallas GPU kernel against ``jax.nn.dot_product_attention`` with a
   dense [B, 1, T, T] boolean mask (implementation "xla", and "cudnn" when it accepts the
   mask), bf16, Hq=8, Hkv=2, D=128. Dense configurations predicted not to fit in device
   memory are skipped; failures (OOM, unsupported) are recorded, not fatal.
3. Decode attention over a KV cache (`kernels.decode`) at Gemma-3-270M's attention shapes
   (Hq 4, Hkv 1, D 256, bf16), a 32k cache filled to 256 / 4k / 16k (and "ragged": batch
   rows filled to different lengths), batch 1 and 4, T = 1 and 18 query rows (decoding, a
   K=8 verification), no window and Gemma's 512 window: the Pallas GPU kernel
   (`kernels.decode_gpu`) checked against the XLA decode path (max |diff| / max |ref|),
   then ms per call of both and of the dense path over the whole cache (`kernels.dense`,
   the models' "dense" reference); plus the kernel's KV splits at batch 1, 16k filled.
4. Prints tables and writes JSON (atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tests(smoke: bool, parts=("attention", "decode")):
    if smoke:
        return {"skipped": "smoke run (no GPU): the gpu-marked tests need a GPU"}
    files = {"attention": "test_kernels_gpu.py", "decode": "test_kernels_decode_pallas.py"}
    t0 = time.time()
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        *(os.path.join(ROOT, "tests", "kernels", files[p]) for p in parts),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240)
    tail = (r.stdout + r.stderr).strip().splitlines()[-15:]
    print("\n".join(tail), flush=True)
    return {"returncode": r.returncode, "seconds": round(time.time() - t0, 1), "summary": tail[-1] if tail else ""}


def _device_bytes():
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
        return int(stats.get("bytes_limit", 0)) or None
    except Exception:  # noqa: BLE001 - best effort
        return None


def run_decode_timings(
    cache: int, fills, batches, ts, windows, smoke: bool, iters: int, hq: int, hkv: int, d: int, splits
):
    import functools

    import jax
    import jax.numpy as jnp

    from kernels import decode, decode_gpu, dense
    from kernels.cases import decode_positions, rel_err
    from peagle_jax.runtime.timing import back_to_back

    dtype = jnp.float32 if smoke else jnp.bfloat16
    scale = d**-0.5
    interpret = smoke
    rows = []

    def dense_fn(q, k, v, pos, window):
        kpos = jnp.arange(k.shape[1])[None, None, :]
        mask = (kpos <= pos[:, :, None]) & (pos[:, :, None] >= 0)
        if window is not None:
            mask &= pos[:, :, None] - kpos < window
        return dense.attention(q, k, v, mask, scale=scale)[0]

    for b in batches:
        ks = jax.random.split(jax.random.PRNGKey(b), 3)
        k = jax.random.normal(ks[0], (b, cache, hkv, d), dtype)
        v = jax.random.normal(ks[1], (b, cache, hkv, d), dtype)
        for t in ts:
            q = jax.random.normal(ks[2], (b, t, hq, d), dtype)
            for window in windows:
                impls = {  # xla_decode first: the reference of the pallas rows
                    "xla_decode": jax.jit(
                        functools.partial(decode.attention, scale=scale, window=window, backend="xla")
                    ),
                    "pallas_gpu": jax.jit(
                        functools.partial(
                            decode.attention, scale=scale, window=window, backend="gpu", interpret=interpret
                        )
                    ),
                    "dense": jax.jit(functools.partial(dense_fn, window=window)),
                }
                if b == min(batches) and t == min(ts) and window is None:
                    for n in splits:
                        impls[f"pallas_gpu_splits{n}"] = jax.jit(
                            functools.partial(decode_gpu.attention, scale=scale, num_splits=n, interpret=interpret)
                        )
                for fill in [*fills, "ragged"] if b > 1 else fills:
                    args = (q, k, v, jnp.asarray(decode_positions(b, t, fill, fills)))
                    want = None
                    for name, f in impls.items():
                        if name.startswith("pallas_gpu_splits") and fill != max(fills):
                            continue
                        row = dict(
                            impl=name, cache=cache, fill=fill, b=b, t=t, window=window, hq=hq, hkv=hkv, d=d,
                            dtype=str(jnp.dtype(dtype)),
                        )  # fmt: skip
                        try:
                            timing = back_to_back(lambda f=f, args=args: f(*args), iters)  # first: compile
                            row.update(status="ok", compile_s=round(timing.first_s, 2), ms=round(timing.ms, 4))
                            if name == "xla_decode":
                                want = f(*args)
                            elif name.startswith("pallas_gpu"):
                                if want is None:
                                    raise RuntimeError("no xla_decode output to compare with")
                                row["rel_err_vs_xla"] = err = rel_err(f(*args), want)
                                if not err <= 2e-2:
                                    row["status"] = f"WRONG: rel err vs xla_decode {err:.3g} > 2e-2"
                        except Exception as e:  # noqa: BLE001 - OOM / unsupported are results too
                            row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    return rows


def run_timings(ns, smoke: bool, iters: int, hq: int, hkv: int, d: int):
    import jax
    import jax.numpy as jnp

    from kernels import AttentionSpec, attention, make_schedule
    from kernels.layouts import cod_layout
    from peagle_jax.runtime.timing import timed

    mem = _device_bytes()
    dtype = jnp.float32 if smoke else jnp.bfloat16
    rows = []
    for n in ns:
        a, dd, c = cod_layout(n, 8, rng=0)
        T = len(a)
        spec = AttentionSpec.peagle(a, dd, c)
        ks = jax.random.split(jax.random.PRNGKey(n), 4)
        q = jax.random.normal(ks[0], (1, T, hq, d), dtype)
        k = jax.random.normal(ks[1], (1, T, hkv, d), dtype)
        v = jax.random.normal(ks[2], (1, T, hkv, d), dtype)
        do = jax.random.normal(ks[3], q.shape, dtype)
        sched = jax.jit(make_schedule, static_argnums=(1, 2))(spec, 64, 64)
        skipped = float(sched.skipped_fraction())

        def make(fwd):
            @jax.jit
            def step(q, k, v, spec, do):
                out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, spec), q, k, v)
                return out, vjp(do)

            return step

        impls = {
            "pallas_gpu": lambda q, k, v, s: attention(q, k, v, s, backend="gpu", interpret=smoke),
            "dense_xla": lambda q, k, v, s: jax.nn.dot_product_attention(
                q, k, v, mask=s.dense_mask()[:, None], implementation="xla"
            ),
        }
        if not smoke:
            impls["dense_cudnn"] = lambda q, k, v, s: jax.nn.dot_product_attention(
                q, k, v, mask=s.dense_mask()[:, None], implementation="cudnn"
            )
        if n == min(ns):
            impls["blockwise_xla"] = lambda q, k, v, s: attention(q, k, v, s, backend="xla")
        for name, fwd in impls.items():
            row = dict(impl=name, n=n, rows=T, hq=hq, hkv=hkv, d=d, dtype=str(jnp.dtype(dtype)), skipped_blocks=skipped)
            # dense xla materialises ~3 [Hq, T, T] f32 tensors + the mask
            need = T * T * (1 + 12 * hq)
            if name == "dense_xla" and mem and need > 0.8 * mem:
                row["status"] = f"skipped: needs ~{need / 1e9:.0f} GB > 80% of {mem / 1e9:.0f} GB"
            else:
                try:
                    step = make(fwd)
                    timing = timed(lambda step=step: step(q, k, v, spec, do), iters)  # first: compile
                    row.update(status="ok", compile_s=round(timing.first_s, 2), fwd_bwd_ms=round(timing.ms, 2))
                except Exception as e:  # noqa: BLE001 - OOM / unsupported are results too
                    row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description="P-EAGLE kernels: GPU tests + timings")
    p.add_argument("--parts", nargs="+", choices=["attention", "decode"], default=["attention", "decode"])
    p.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--hq", type=int, default=8)
    p.add_argument("--hkv", type=int, default=2)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--decode-cache", type=int, default=32768)
    p.add_argument("--decode-fills", type=int, nargs="+", default=[256, 4096, 16384])
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--decode-t", type=int, nargs="+", default=[1, 18], help="query rows per call (1: decoding)")
    p.add_argument("--decode-windows", type=int, nargs="+", default=[0, 512], help="sliding windows (0: none)")
    p.add_argument("--decode-splits", type=int, nargs="+", default=[1, 8, 32, 64], help="num_splits swept at batch 1")
    p.add_argument("--decode-iters", type=int, default=20)
    p.add_argument("--json", default="gpu_check.json")
    p.add_argument("--smoke", action="store_true", help="CPU dry run: tiny sizes, Pallas in interpret mode, no tests")
    args = p.parse_args(argv)
    import jax

    if args.smoke:
        args.n, args.iters, args.hq, args.hkv, args.d = [48, 96], 1, 2, 1, 32
        args.decode_cache, args.decode_fills, args.decode_batches = 200, [40, 150], [1, 2]
        args.decode_t, args.decode_windows, args.decode_splits, args.decode_iters = [1, 3], [0, 64], [1, 4], 1
    elif jax.default_backend() != "gpu":
        print("gpu_check: no GPU found (use --smoke for a CPU dry run)", file=sys.stderr)
        return 2
    t0 = time.time()
    tests = run_tests(args.smoke, args.parts)
    timings, decode = [], []
    if "attention" in args.parts:
        timings = run_timings(args.n, args.smoke, args.iters, args.hq, args.hkv, args.d)
    if "decode" in args.parts:
        windows = [w or None for w in args.decode_windows]
        decode = run_decode_timings(
            args.decode_cache,
            args.decode_fills,
            args.decode_batches,
            args.decode_t,
            windows,
            args.smoke,
            args.decode_iters,
            hq=4,
            hkv=1,
            d=256 if not args.smoke else 32,
            splits=args.decode_splits,
        )
    device = jax.devices()[0].device_kind
    if timings:
        print()
        print(f"device: {device}; K=8 COD rows; fwd+bwd median of {args.iters}")
        print("| N | rows | impl | fwd+bwd ms | compile s | status |")
        print("|---|---|---|---|---|---|")
        for r in timings:
            print(
                f"| {r['n']} | {r['rows']} | {r['impl']} | {r.get('fwd_bwd_ms', '-')} | "
                f"{r.get('compile_s', '-')} | {r['status']} |"
            )
    if decode:
        print()
        print(f"device: {device}; decode attention, cache {args.decode_cache}, Hq 4 Hkv 1; mean of {args.decode_iters}")
        print("| B | T | window | fill | impl | ms | rel err vs xla | compile s | status |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in decode:
            err = r.get("rel_err_vs_xla")
            print(
                f"| {r['b']} | {r['t']} | {r['window'] or '-'} | {r['fill']} | {r['impl']} | {r.get('ms', '-')} | "
                f"{'-' if err is None else f'{err:.2g}'} | {r.get('compile_s', '-')} | {r['status']} |"
            )
    out = dict(
        device=device,
        jax=jax.__version__,
        tests=tests,
        timings=timings,
        decode=decode,
        seconds=round(time.time() - t0, 1),
    )
    with open(args.json + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(args.json + ".tmp", args.json)
    print(f"wrote {args.json} ({out['seconds']} s)")
    kernels_ok = all(r["status"] == "ok" for r in decode if r["impl"].startswith("pallas"))
    ok = args.smoke or (tests.get("returncode") == 0 and kernels_ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
