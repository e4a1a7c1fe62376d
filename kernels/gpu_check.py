"""GPU check for a lent device (H200 / any CUDA GPU): correctness + timings, < 8 minutes.

    python -m kernels.gpu_check [--json gpu_check.json] [--n 4096 8192 16384]
    python -m kernels.gpu_check --smoke      # CPU dry run of this script (interpret mode)

1. Runs the ``gpu``-marked tests of tests/kernels/test_kernels_gpu.py natively (Pallas
   Triton kernels vs the dense reference at bf16 tolerances, determinism).
2. Times forward+backward of P-EAGLE attention on K=8 COD layouts (N positions ->
   ~3.4 N rows) for the Pallas GPU kernel against ``jax.nn.dot_product_attention`` with a
   dense [B, 1, T, T] boolean mask (implementation "xla", and "cudnn" when it accepts the
   mask), bf16, Hq=8, Hkv=2, D=128. Dense configurations predicted not to fit in device
   memory are skipped; failures (OOM, unsupported) are recorded, not fatal.
3. Prints a table and writes JSON (atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tests(smoke: bool):
    if smoke:
        return {"skipped": "smoke run (no GPU): the gpu-marked tests need a GPU"}
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
        os.path.join(ROOT, "tests", "kernels", "test_kernels_gpu.py"),
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


def time_fn(f, args, iters):
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    compile_s = time.perf_counter() - t0
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return compile_s, statistics.median(ts)


def run_timings(ns, smoke: bool, iters: int, hq: int, hkv: int, d: int):
    import jax
    import jax.numpy as jnp

    from kernels import AttentionSpec, attention, make_schedule
    from kernels.layouts import cod_layout

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
                    comp, med = time_fn(make(fwd), (q, k, v, spec, do), iters)
                    row.update(status="ok", compile_s=round(comp, 2), fwd_bwd_ms=round(1e3 * med, 2))
                except Exception as e:  # noqa: BLE001 - OOM / unsupported are results too
                    row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="P-EAGLE kernels: GPU tests + timings")
    p.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--hq", type=int, default=8)
    p.add_argument("--hkv", type=int, default=2)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--json", default="gpu_check.json")
    p.add_argument("--smoke", action="store_true", help="CPU dry run: tiny sizes, Pallas in interpret mode, no tests")
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    import jax

    if args.smoke:
        args.n, args.iters, args.hq, args.hkv, args.d = [48, 96], 1, 2, 1, 32
    elif jax.default_backend() != "gpu":
        print("gpu_check: no GPU found (use --smoke for a CPU dry run)", file=sys.stderr)
        return 2
    t0 = time.time()
    tests = run_tests(args.smoke)
    timings = run_timings(args.n, args.smoke, args.iters, args.hq, args.hkv, args.d)
    print()
    print(f"device: {jax.devices()[0].device_kind}; K=8 COD rows; fwd+bwd median of {args.iters}")
    print("| N | rows | impl | fwd+bwd ms | compile s | status |")
    print("|---|---|---|---|---|---|")
    for r in timings:
        print(
            f"| {r['n']} | {r['rows']} | {r['impl']} | {r.get('fwd_bwd_ms', '-')} | "
            f"{r.get('compile_s', '-')} | {r['status']} |"
        )
    out = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        tests=tests,
        timings=timings,
        seconds=round(time.time() - t0, 1),
    )
    with open(args.json + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(args.json + ".tmp", args.json)
    print(f"wrote {args.json} ({out['seconds']} s)")
    ok = args.smoke or tests.get("returncode") == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
