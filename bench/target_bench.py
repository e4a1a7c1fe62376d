"""Target forward speed: our JAX target vs transformers `generate`, side by side in one run.

    python -m bench.target_bench [--path DIR | --asset gemma3-270m] [--batch 1 8]
        [--prompt-len 128] [--new-tokens 32] [--repeats 3] [--torch-threads N]
        [--json runs/bench/target_bench.json]

For each batch size: prefill tokens/s (B * prompt_len / time of the prompt pass) and decode
tokens/s (B * (new - 1) / time of the decode steps after the first token), float32, greedy,
the same prompts and token counts on both sides. JAX: the engine's plain decoding (mode
"none", what `generate_greedy` runs): its jitted prefill (cache allocation included) and its
jitted `lax.while_loop` of rounds, warmed up first so compile time is excluded.
transformers: `generate(max_new_tokens=1)` is the prefill; `generate(max_new_tokens=N)` minus it
is the decode (min_new_tokens=N so EOS never stops early). Runs alternate between the two
(the machine is shared: `peagle_jax.runtime.timing.side_by_side`); the best of `--repeats` is reported
(all times go to the JSON). Decoding at batch B reads every weight once per step, so weight
bytes per decoded token = param bytes / B and the implied bandwidth = param bytes * steps/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from bench.command import command_line

TEXT = (
    "Speculative decoding speeds up autoregressive generation by letting a small draft model "
    "propose several tokens that the large target model then verifies in a single forward pass. "
    "When the proposals are accepted, the target produces multiple tokens for the cost of one step. "
    "The quality of the output is unchanged because every token is checked by the target model. "
)


def _prompts(tokenizer, vocab: int, batch: int, length: int) -> np.ndarray:
    if tokenizer is not None:
        ids = tokenizer(TEXT * 40)["input_ids"]
    else:
        ids = np.random.default_rng(0).integers(3, vocab, 8 * length).tolist()
    rows = [ids[1 + 7 * b : 1 + 7 * b + length - 1] for b in range(batch)]  # shifted rows
    bos = ids[0]
    return np.array([[bos] + r for r in rows], np.int32)


def bench_jax(target, prompts: np.ndarray, new: int):
    """Prefill and decode of the engine's plain decoding (mode "none": what `generate_greedy` runs)."""
    from peagle_jax.engine import SpeculativeDecoder
    from peagle_jax.engine import speculative as sp

    dec = SpeculativeDecoder(target, mode="none", eos_ids=())  # never stop early: fixed token counts
    rows = prompts.tolist()
    state = {}

    def run_prefill():
        cfg, _, st = dec.start(rows, max_new_tokens=new)
        state.update(cfg=cfg, state=st)
        return st

    def run_decode():
        st = sp.jit_generate(state["cfg"], *dec.modules(), state.pop("state"))
        state["out"] = np.asarray(st.out)[:, :new]

    return run_prefill, run_decode, state


def bench_lm_head(target, batch: int):
    """The lm_head + argmax alone on [B, 1, H] (the 262k-vocab product of each step), to time."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    @jax.jit
    def head(state, h):
        return jnp.argmax(nnx.merge(target.graphdef, state).lm_logits(h), axis=-1)

    h = jnp.ones((batch, 1, target.config.hidden_size), target.dtype)
    return lambda: head(target.state, h)


def bench_hf(model, prompts: np.ndarray, new: int):
    import torch

    ids = torch.as_tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    state = {}

    def gen(n):
        with torch.no_grad():
            return model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )

    def run_full():
        state["out"] = gen(new)[:, prompts.shape[1] :].numpy()

    return lambda: gen(1), run_full, state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.target_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--path", help="HF folder of the target (default: the prepared --asset)")
    p.add_argument("--asset", default="gemma3-270m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true", help="time only the JAX target")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="JAX target dtype (transformers always runs float32)",
    )
    p.add_argument(
        "--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's own, = the cores)"
    )
    p.add_argument("--json", default="runs/bench/target_bench.json")
    args = p.parse_args(argv)

    import jax
    import torch

    import peagle_jax as pj
    from peagle_jax.runtime.timing import side_by_side

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.path:
        folder = Path(args.path)
    else:
        from peagle_jax.sources.assets import prepare

        folder = prepare(args.asset)
    t0 = time.perf_counter()
    target = pj.load_target(folder, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    param_bytes = target.param_bytes
    print(
        f"# {target!r}\n# params {target.num_params / 1e6:.1f}M = {param_bytes / 2**20:.0f} MiB {args.dtype}; "
        f"load {load_s:.1f}s; jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), {os.cpu_count()} cpus",
        flush=True,
    )

    load_start = os.getloadavg()
    print(f"# load average {load_start[0]:.1f} (the machine is shared; numbers are best of {args.repeats})")
    rows = []
    for b in args.batch:
        prompts = _prompts(target.tokenizer, target.config.vocab_size, b, args.prompt_len)
        j_pre, j_dec, j_state = bench_jax(target, prompts, args.new_tokens)
        runs = {"jax_prefill": j_pre, "jax_decode": j_dec, "jax_lm_head": bench_lm_head(target, b)}
        if hf is not None:
            h_pre, h_full, h_state = bench_hf(hf, prompts, args.new_tokens)
            runs.update(hf_prefill=h_pre, hf_full=h_full)
        timings = side_by_side(runs, args.repeats)  # each warmed up (compiled) first, then in turn
        compile_s = timings["jax_prefill"].first_s + timings["jax_decode"].first_s
        times = {k: list(t.times) for k, t in timings.items()}
        med = {k: t.min_ms / 1000 for k, t in timings.items()}  # best of --repeats: the least disturbed run
        steps = args.new_tokens - 1
        row = {
            "batch": b,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "jax_compile_s": round(compile_s, 2),
            "jax_prefill_tok_s": b * args.prompt_len / med["jax_prefill"],
            "jax_decode_tok_s": b * steps / med["jax_decode"],
            "jax_decode_ms_per_step": 1e3 * med["jax_decode"] / steps,
            "jax_lm_head_ms": 1e3 * med["jax_lm_head"],
            "weight_bytes_per_decoded_token": param_bytes / b,
            "jax_implied_gb_s": param_bytes * steps / med["jax_decode"] / 1e9,
            "times_s": times,
        }
        if hf is not None:
            hf_decode = max(med["hf_full"] - med["hf_prefill"], 1e-9)
            row.update(
                hf_prefill_tok_s=b * args.prompt_len / med["hf_prefill"],
                hf_decode_tok_s=b * steps / hf_decode,
                hf_decode_ms_per_step=1e3 * hf_decode / steps,
                hf_implied_gb_s=param_bytes * steps / hf_decode / 1e9,
                same_tokens=bool(np.array_equal(j_state["out"], h_state["out"])),
            )
            row["decode_speedup"] = row["jax_decode_tok_s"] / row["hf_decode_tok_s"]
            row["prefill_speedup"] = row["jax_prefill_tok_s"] / row["hf_prefill_tok_s"]
        rows.append(row)
        print(f"# batch {b} done (jax compile {compile_s:.1f}s)", flush=True)

    hdr = (
        f"{'batch':>5} | {'prefill tok/s jax':>17} | {'hf':>8} | {'x':>5} | {'decode tok/s jax':>16} | "
        f"{'hf':>8} | {'x':>5} | {'ms/step jax':>11} | {'hf':>7} | {'MiB/token':>9} | {'GB/s jax':>8} | "
        f"{'GB/s hf':>7} | {'lm_head ms':>10} | same"
    )
    print(hdr)
    for r in rows:
        hf_ = r.get("hf_prefill_tok_s")
        print(
            f"{r['batch']:>5} | {r['jax_prefill_tok_s']:>17.0f} | {hf_ or float('nan'):>8.0f} | "
            f"{r.get('prefill_speedup', float('nan')):>5.2f} | {r['jax_decode_tok_s']:>16.1f} | "
            f"{r.get('hf_decode_tok_s', float('nan')):>8.1f} | {r.get('decode_speedup', float('nan')):>5.2f} | "
            f"{r['jax_decode_ms_per_step']:>11.1f} | {r.get('hf_decode_ms_per_step', float('nan')):>7.1f} | "
            f"{r['weight_bytes_per_decoded_token'] / 2**20:>9.0f} | {r['jax_implied_gb_s']:>8.1f} | "
            f"{r.get('hf_implied_gb_s', float('nan')):>7.1f} | {r['jax_lm_head_ms']:>10.1f} | {r.get('same_tokens', '-')}"
        )
    result = {
        "loadavg_start_end": [load_start, os.getloadavg()],
        "command": command_line("bench.target_bench", argv),
        "target": repr(target),
        "param_bytes": param_bytes,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "jax": jax.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "rows": rows,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
