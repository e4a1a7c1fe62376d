"""MoE target throughput: grouped experts vs a dense loop over experts, side by side in one run.

A GPT-OSS-layout target with random weights (hidden 1024, 8 layers, 32 experts top-4, vocab 32k,
sinks, alternating sliding-128 / full layers, YaRN) is run as prefill (one forward over
`--prefill` tokens per row, KV cache written) and cached greedy decode (`--decode-steps` steps of
one token per row), with each expert product of `peagle_jax.models.moe` ("blocks": sorted
blocks, the CPU default; "ragged": jax.lax.ragged_dot; "dense": every expert over every token),
then transformers' GptOssForCausalLM (torch, eager, same shapes and dtype) when it is installed.

    nice -n 10 .venv/bin/python -m bench.moe_bench [--json bench/moe_bench.json]

Prints a table and writes JSON. Ratios are measured in one run; the machine may be shared.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from peagle_jax.config.target_config import RopeConfig, TargetConfig
from peagle_jax.models.decoder import Decoder
from peagle_jax.models.registry import hf_config
from peagle_jax.runtime.timing import side_by_side, timed


def bench_config(hidden=1024, layers=8, experts=32, top_k=4, vocab=32000, expert_width=512) -> TargetConfig:
    heads, head_dim = hidden // 64, 64
    return TargetConfig(
        model_type="gpt_oss",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=expert_width,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 4),
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope=RopeConfig(
            theta=150000.0, type="yarn", factor=32.0, original_max_position_embeddings=4096, truncate=False
        ),
        layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)),
        sliding_window=128,
        attention_bias=True,
        attention_sinks=True,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_width,
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        expert_gate_up="interleaved",
        swiglu_limit=7.0,
        max_position_embeddings=4096,
    )


def bench_jax(cfg: TargetConfig, impl: str, batch: int, prefill: int, steps: int, repeats: int, dtype) -> dict:
    model = Decoder(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    for layer in model.layers:
        layer.mlp.impl = impl
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill_fn(state, tokens, positions, cache):
        out = nnx.merge(graphdef, state)(tokens, positions, cache, logits_at=positions[:, -1:])
        return out.logits, out.cache

    @jax.jit
    def decode_fn(state, tokens, start, cache):
        def step(carry, _):
            tok, pos, cache = carry
            out = nnx.merge(graphdef, state)(tok, pos, cache)
            nxt = jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
            return (nxt, pos + 1, out.cache), nxt[:, 0]

        pos = jnp.full((tokens.shape[0], 1), start, jnp.int32)
        (_, _, cache), toks = jax.lax.scan(step, (tokens, pos, cache), None, length=steps)
        return toks, cache

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(batch, prefill)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(prefill, dtype=jnp.int32), (batch, prefill))
    cache_len = prefill + steps
    empty = tuple(
        (jnp.zeros((batch, cache_len, cfg.num_kv_heads, cfg.head_dim), dtype),) * 2 for _ in range(cfg.num_layers)
    )
    t_prefill = timed(lambda: prefill_fn(state, tokens, positions, empty), repeats).min_ms / 1000  # the best call
    logits, filled = prefill_fn(state, tokens, positions, empty)
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    t_decode = timed(lambda: decode_fn(state, first, prefill, filled), repeats).min_ms / 1000
    toks, _ = decode_fn(state, first, prefill, filled)
    return {
        "impl": impl,
        "prefill_tok_s": batch * prefill / t_prefill,
        "decode_tok_s": batch * steps / t_decode,
        "prefill_s": t_prefill,
        "decode_step_ms": 1000 * t_decode / steps,
        "tokens_checksum": int(np.asarray(toks).sum()),
    }


def bench_transformers(cfg: TargetConfig, batch: int, prefill: int, steps: int, repeats: int) -> dict | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    hf_cfg = transformers.GptOssConfig(**{k: v for k, v in hf_config(cfg).items() if k != "architectures"})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_cfg).eval().float()
    ids = torch.randint(0, cfg.vocab_size, (batch, prefill))

    def run_prefill():
        with torch.no_grad():
            return model(ids, use_cache=True)

    def run_decode(out):
        cache = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        with torch.no_grad():
            for _ in range(steps):
                o = model(tok, past_key_values=cache, use_cache=True)
                cache, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
        return tok

    box = {}
    runs = {"prefill": lambda: box.update(out=run_prefill()), "decode": lambda: run_decode(box["out"])}
    best = {name: t.min_ms / 1000 for name, t in side_by_side(runs, repeats).items()}  # in turn, the best calls
    best_p, best_d = best["prefill"], best["decode"]
    return {
        "impl": f"transformers {transformers.__version__} (torch {torch.__version__}, eager)",
        "prefill_tok_s": batch * prefill / best_p,
        "decode_tok_s": batch * steps / best_d,
        "prefill_s": best_p,
        "decode_step_ms": 1000 * best_d / steps,
    }


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.moe_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--impls", default="blocks,dense,ragged")
    p.add_argument("--expert-width", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--json", default="bench/moe_bench.json")
    a = p.parse_args(argv)
    cfg = bench_config(expert_width=a.expert_width)
    dtype = jnp.dtype(a.dtype)
    expert_params = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    rows = []
    for impl in a.impls.split(","):
        rows.append(bench_jax(cfg, impl, a.batch, a.prefill, a.decode_steps, a.repeats, dtype))
        gc.collect()  # one model's weights at a time
    if not a.no_transformers and a.dtype == "float32":
        hf = bench_transformers(cfg, a.batch, a.prefill, a.decode_steps, a.repeats)
        if hf is not None:
            rows.append(hf)
    base = next((r for r in rows if r["impl"] == "dense"), rows[0])
    print(
        f"GPT-OSS layout: hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_experts} experts top-"
        f"{cfg.num_experts_per_tok} (width {cfg.moe_intermediate_size}), vocab {cfg.vocab_size}, {a.dtype}; "
        f"expert params {expert_params / 1e6:.0f}M; batch {a.batch}, prefill {a.prefill}, decode {a.decode_steps}"
    )
    print(f"{'impl':<48} {'prefill tok/s':>14} {'x dense':>8} {'decode tok/s':>13} {'x dense':>8}")
    for r in rows:
        print(
            f"{r['impl']:<48} {r['prefill_tok_s']:>14.1f} {r['prefill_tok_s'] / base['prefill_tok_s']:>8.2f} "
            f"{r['decode_tok_s']:>13.1f} {r['decode_tok_s'] / base['decode_tok_s']:>8.2f}"
        )
    checks = {r["tokens_checksum"] for r in rows if "tokens_checksum" in r}
    report = {
        "config": {
            "hidden": cfg.hidden_size,
            "layers": cfg.num_layers,
            "experts": cfg.num_experts,
            "top_k": cfg.num_experts_per_tok,
            "expert_width": cfg.moe_intermediate_size,
            "vocab": cfg.vocab_size,
            "dtype": a.dtype,
        },
        "batch": a.batch,
        "prefill": a.prefill,
        "decode_steps": a.decode_steps,
        "rows": rows,
        "same_greedy_tokens_across_impls": len(checks) == 1,
        "machine": {"platform": platform.platform(), "jax": jax.__version__, "backend": jax.default_backend()},
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
