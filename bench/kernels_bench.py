"""CPU benchmark: blockwise XLA attention vs a dense-mask attention on P-EAGLE COD layouts.

For N positions and K depths (COD sampling, r=0.7, r_min=0.2: about 3.4 N rows at K=8) it
measures forward+backward time and peak memory of

* ``blockwise``: ``kernels.attention(..., backend="xla")`` (schedule + blockwise loops),
* ``blockwise-chain``: the same with ``AttentionSpec.chain_depth = K - 1`` (each row's chain keys
  gathered outside the block loop, `kernels.chain`: what the trainer runs),
* ``slots``: ``kernels.slot_attention`` over the same rows when every deeper row reads one input
  (the drafter's first layer: the mask slot's query attended once per position; inputs per
  position, so its gradient is taken with respect to those six arrays),
* ``dense``: ``jax.nn.dot_product_attention(..., mask=[B,1,T,T] bool, implementation="xla")``
  (only where its predicted footprint fits, see --dense-limit-gb),

each configuration in its own child process (peak = the child's ``ru_maxrss``; ``base`` is
the child's RSS just before the first attention call, after jax is imported and the
inputs exist), and the fraction of (query block, KV block) pairs the schedule skips.
Tiny heads (Hq=2, Hkv=1, D=32 by default) keep the big N within minutes on 2 cores.

    python -m bench.kernels_bench [--n 1024 2048 4096 8192 16384] [--block 128 --block-k 512]
        [--paths blockwise blockwise-chain slots dense] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(args):
    """Run one configuration; print one JSON line."""
    import jax
    import jax.numpy as jnp

    from kernels import AttentionSpec, attention, chain, make_schedule, slot_attention
    from kernels.layouts import cod_layout
    from peagle_jax.runtime.timing import timed

    a, d, c = cod_layout(args.n, args.k, r=0.7, r_min=0.2, rng=0)
    T = len(a)
    spec = AttentionSpec.peagle(a, d, c, chain_depth=args.k - 1 if args.path in ("blockwise-chain", "slots") else 0)
    key = jax.random.PRNGKey(0)
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (1, T, args.hq, args.d), jnp.float32)
    k = jax.random.normal(kk, (1, T, args.hkv, args.d), jnp.float32)
    v = jax.random.normal(kv, (1, T, args.hkv, args.d), jnp.float32)
    do = jax.random.normal(kd, q.shape, jnp.float32)

    if args.path == "slots":  # per-position inputs: q0, k0, v0 and the slot's q, k (rotated), v
        n = args.n
        k0, v0 = k[:, :n], v[:, :n]
        q = (q[:, :n], k0, v0, q[:, n : 2 * n], k[:, n : 2 * n], v[:, :1])

        def fwd(q, k, v, spec):
            return slot_attention(*q, spec, backend="xla", block_q=args.block, block_k=args.block_k)
    elif args.path.startswith("blockwise"):

        def fwd(q, k, v, spec):
            return attention(q, k, v, spec, backend="xla", block_q=args.block, block_k=args.block_k)
    else:

        def fwd(q, k, v, spec):
            mask = spec.dense_mask()[:, None]  # [B, 1, T, T] bool
            return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")

    @jax.jit
    def step(q, k, v, spec, do):
        out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, spec), q, k, v)
        return out, vjp(do)

    jax.block_until_ready((q, k, v, do))
    base = _rss_mb()
    timing = timed(lambda: step(q, k, v, spec, do), args.repeats)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # the block loop the kernels run: chain keys gathered out, queries sorted (`kernels.chain`)
    loop_spec = jax.jit(lambda s: chain.sort_queries(chain.split(s)[0])[0])(spec) if spec.chain_depth else spec
    sched = jax.jit(make_schedule, static_argnums=(1, 2))(loop_spec, args.block, args.block_k)
    skipped = None if args.path == "slots" else float(sched.skipped_fraction())  # slots: another loop
    print(
        json.dumps(
            dict(
                path=args.path,
                n=args.n,
                k=args.k,
                rows=T,
                hq=args.hq,
                hkv=args.hkv,
                d=args.d,
                block=args.block,
                block_k=args.block_k,
                first_call_s=timing.first_s,
                fwd_bwd_s=timing.min_ms / 1000,
                base_rss_mb=base,
                peak_rss_mb=peak,
                skipped=skipped,
                blocks=int(sched.fwd_count.size * sched.num_kv_blocks),
            )
        )
    )


def dense_predicted_gb(T, hq):
    # calibrated on this box: N=4096 (T=13806, Hq=2) peaked at 13.3 GB ~ 70 B per mask entry
    return T * T * (1 + 34 * hq) / 1e9


def main():
    p = argparse.ArgumentParser(prog="python -m bench.kernels_bench", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--hq", type=int, default=2)
    p.add_argument("--hkv", type=int, default=1)
    p.add_argument("--d", type=int, default=32)
    p.add_argument("--block", type=int, default=256, help="query block (and KV block unless --block-k)")
    p.add_argument("--block-k", type=int, default=None, help="KV block (default: --block)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--dense-limit-gb", type=float, default=14.0)
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--paths", nargs="+", default=["blockwise", "dense"])
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", default="blockwise", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.block_k = args.block_k or args.block
    if args.child:
        args.n = args.n[0]
        return child(args)

    from kernels.layouts import cod_layout

    results = []
    for n in args.n:
        T = len(cod_layout(n, args.k, rng=0)[0])
        for path in args.paths:
            row = dict(path=path, n=n, k=args.k, rows=T)
            if path == "dense" and dense_predicted_gb(T, args.hq) > args.dense_limit_gb:
                row["skipped_reason"] = (
                    f"dense would need ~{dense_predicted_gb(T, args.hq):.0f} GB "
                    f"(> {args.dense_limit_gb} GB limit on this shared 23 GB box)"
                )
                results.append(row)
                print(json.dumps(row), flush=True)
                continue
            cmd = [
                sys.executable,
                "-m",
                "bench.kernels_bench",
                "--child",
                "--path",
                path,
                "--n",
                str(n),
                "--k",
                str(args.k),
                "--hq",
                str(args.hq),
                "--hkv",
                str(args.hkv),
                "--d",
                str(args.d),
                "--block",
                str(args.block),
                "--block-k",
                str(args.block_k),
                "--repeats",
                str(args.repeats),
            ]
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
                line = [x for x in r.stdout.splitlines() if x.startswith("{")]
                if r.returncode or not line:
                    row["error"] = (r.stderr.strip().splitlines() or ["?"])[-1][:200]
                else:
                    row = json.loads(line[-1])
            except subprocess.TimeoutExpired:
                row["error"] = f"timeout after {args.timeout}s"
            results.append(row)
            print(json.dumps(row), flush=True)

    print()
    print(
        f"P-EAGLE COD attention, K={args.k}, Hq={args.hq}, Hkv={args.hkv}, D={args.d}, "
        f"blocks {args.block} x {args.block_k}, "
        f"f32, CPU, forward+backward (jit, steady state)"
    )
    print("| N | rows | path | fwd+bwd s | peak RSS MB | (base MB) | blocks skipped |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "fwd_bwd_s" in r:
            print(
                f"| {r['n']} | {r['rows']} | {r['path']} | {r['fwd_bwd_s']:.2f} | "
                f"{r['peak_rss_mb']:.0f} | {r['base_rss_mb']:.0f} | "
                + ("- |" if r["skipped"] is None else f"{100 * r['skipped']:.1f}% of {r['blocks']} |")
            )
        else:
            print(f"| {r['n']} | {r['rows']} | {r['path']} | - | - | - | {r.get('skipped_reason') or r.get('error')} |")
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(dict(config=vars(args), results=results), f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
