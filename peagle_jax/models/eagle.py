"""The EAGLE-3 / P-EAGLE drafter network (docs/method.md section 3), its COD-row
forward for training, its draft-vocabulary maps, and its state as arrays.

```
g   = fc(aux)                                   # [.., 3*Ht] -> [.., H]; optional norms before fc
layer 0 (fused):  z = concat(input_layernorm(embed(x)), hidden_norm(g))   # width 2H
                  h = res + o_proj(attn(q, k, v = proj(z)))  # res = g (hidden_norm(g) if norm_before_residual)
                  h = h + mlp(post_attention_layernorm(h))
layers 1..N-1:    plain pre-norm Llama blocks
logits = lm_head(norm(h))                       # [.., Vd]; target id = draft id + d2t[draft id]
```
Drafter layers may slide (`DrafterConfig.layer_types` / `sliding_window`): each layer applies
its window in every attention call (the rule: `kernels.visible`).

One module serves both modes: "parallel" (P-EAGLE: masked slots read `mask_token_id` and
`mask_g() = fuse(mask_hidden)`) and "chain" (EAGLE-3: each later step feeds the drafter's
own last hidden state back as g, bypassing fc; see `DrafterModel.feedback`).

Parameter names follow the checkpoint keys (`layers.0.*` is vLLM's `midlayer.*`), so the
import/export maps in `peagle_jax.formats.checkpoints` are one line per tensor. A drafter's state as
plain arrays is `{path tuple: array}` (`flat_state`, `state_from_arrays`, `init_arrays`): the
form every checkpoint format reads and writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels
from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.dtypes import numpy_dtype
from peagle_jax.config.target_config import NUM_AUX
from peagle_jax.models.abstract import abstract_module
from peagle_jax.models.dflash import DFlashModel
from peagle_jax.models.head import (  # noqa: F401 - the vocabulary helpers are re-exported
    DrafterOutput,
    DraftHead,
    VocabMap,
    check_d2t,
    d2t_from_ids,
    draft_to_target,
    draft_vocab_ids,
    layer_attention,
    select_draft_vocab,
    t2d_from_d2t,
)
from peagle_jax.models.layers import MLP, Linear, RMSNorm, pick_rows


# ---------------------------------------------------------------------------------------
# the network
class DrafterLayer(nnx.Module):
    """Layer `index` of the head. Layer 0 (fused): q/k/v read concat(input_layernorm(embed),
    hidden_norm(g)). Later layers: the plain pre-norm Llama block. A sliding layer
    (`cfg.window(index)`) applies its window in every attention call (COD rows, cache)."""

    def __init__(self, cfg: DrafterConfig, index: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        fused = index == 0

        def norm():
            return RMSNorm(h, cfg.rms_norm_eps, param_dtype=param_dtype)

        self.fused = fused
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = norm()
        if fused:
            self.hidden_norm = norm()
        self.self_attn = layer_attention(
            cfg, index, 2 * h if fused else h, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.post_attention_layernorm = norm()
        self.mlp = MLP(h, cfg.intermediate_size, cfg.hidden_act, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(
        self, x, positions, kv_cache=None, spec=None, backend="dense", embeds=None, context=None, source=None, slot=None
    ):
        """Layer 0 with `source` (see `DrafterModel.__call__`): x and embeds are per position,
        `slot` = (embed, g) [1, 1, H] of the mask slot; each row picks its residual and its q, k, v
        (before RoPE) from its position's or the slot's, so they are computed once per input."""
        if not self.fused:
            residual, z = x, self.input_layernorm(x)
            attn, kv_cache = self.self_attn(z, positions, kv_cache, spec, backend, context)
        else:
            residual, heads = (None, None) if x is None else self.fused_inputs(embeds, x)
            if source is not None and slot_rows(x, kv_cache, spec, backend, context):
                slot_residual, slot_heads = self.fused_inputs(*slot)
                attn = self.self_attn.attend_slots(heads, slot_heads, spec, backend)
                residual = pick_rows(residual, slot_residual.reshape(-1), source)
            else:
                if source is not None:
                    residual, heads = pick_inputs(residual, heads, *self.fused_inputs(*slot), source)
                attn, kv_cache = self.self_attn.attend(heads, positions, kv_cache, spec, backend, context)
        x = residual + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache

    def fused_inputs(self, embeds, g):
        """Layer 0's residual and (q, k, v) before RoPE, from concat(input_layernorm(embeds), hidden_norm(g))."""
        hn = self.hidden_norm(g)
        residual = hn if self.norm_before_residual else g
        z = jnp.concatenate([self.input_layernorm(embeds).astype(hn.dtype), hn], axis=-1)
        return residual, self.self_attn.heads(z)


def slot_rows(x, kv_cache, spec, backend, context) -> bool:
    """Whether layer 0 attends the COD rows of `source` through `Attention.attend_slots`: rows
    over positions, no cache or context, a spec whose `chain_depth` (>= 1) bounds the rows'
    depths, a blockwise backend."""
    blockwise = backend not in ("dense", "reference")
    return (
        x is not None
        and kv_cache is None
        and context is None
        and spec is not None
        and spec.chain_depth > 0
        and blockwise
    )


def pick_inputs(residual, heads, slot_residual, slot_heads, source):
    """(residual, (q, k, v)) per row from per-position ones (None: no positions) and the slot's
    (`layers.pick_rows`), the four picked as one [B, L, H + (Hq + 2 Hkv) D] array."""
    slot_parts = (slot_residual, *slot_heads)
    dtype = slot_heads[0].dtype
    widths = [int(np.prod(p.shape[2:])) for p in slot_parts]
    slot = jnp.concatenate([p.reshape(-1).astype(dtype) for p in slot_parts])
    if residual is None:
        per_position = jnp.zeros((source.shape[0], 0, slot.shape[0]), dtype)
    else:
        parts = (residual, *heads)
        per_position = jnp.concatenate([p.reshape(*p.shape[:2], w).astype(dtype) for p, w in zip(parts, widths)], -1)
    rows = jnp.split(pick_rows(per_position, slot, source), np.cumsum(widths)[:-1], axis=-1)
    out = [r.reshape(*source.shape, *p.shape[2:]).astype(p.dtype) for r, p in zip(rows, slot_parts)]
    return out[0], tuple(out[1:])


class DrafterModel(DraftHead):
    """The drafter network. Parameters (checkpoint names): embed_tokens [V, H], fc [3Ht -> H],
    input_norm [3Ht] (norm_before_fc), fc_norm.{0,1,2} [Ht] (fc_norm), layers.*, norm [H],
    lm_head [H -> Vd], mask_hidden [1, 1, 3Ht] (mode parallel), d2t [Vd] (VocabMap, int32)."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nnx.Embed(cfg.vocab_size, h, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.fc_in, cfg.rms_norm_eps, param_dtype=param_dtype)
        if cfg.fc_norm:
            self.fc_norm = nnx.List(
                [RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype) for _ in range(NUM_AUX)]
            )
        self.fc = Linear(cfg.fc_in, h, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List(
            [DrafterLayer(cfg, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = Linear(h, cfg.draft_vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if cfg.mode == "parallel":
            self.mask_hidden = nnx.Param(jax.random.normal(rngs.params(), (1, 1, cfg.fc_in), param_dtype))
        self.d2t = VocabMap(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))

    # -- inputs ------------------------------------------------------------------------
    def fuse(self, aux: jax.Array) -> jax.Array:
        """[..., 3*Ht] target aux states -> [..., H] (input_norm / fc_norm, then fc)."""
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            chunks = jnp.split(aux, NUM_AUX, axis=-1)
            aux = jnp.concatenate([norm(c) for norm, c in zip(self.fc_norm, chunks)], axis=-1)
        return self.fc(aux)

    def mask_g(self) -> jax.Array:
        """[H]: the hidden input of every masked (parallel) slot, fuse(mask_hidden)."""
        if self.config.mode != "parallel":
            raise ValueError("mask_g: a chain-mode (EAGLE-3) drafter has no mask_hidden")
        return self.fuse(self.mask_hidden[...])[0, 0]

    def feedback(self, prenorm: jax.Array) -> jax.Array:
        """The hidden input of the next chain (EAGLE-3) step: the pre-norm state, or its
        final-norm output when the head was trained with `norm_output` (EAGLE 3.1; vLLM does
        the same)."""
        return self.norm(prenorm) if self.config.norm_output else prenorm

    def empty_context(self, batch: int, dtype) -> tuple:
        """Per layer (k, v) of no rows [B, 0, Hkv, D]: the `context` of a chain's first call."""
        cfg = self.config
        z = jnp.zeros((batch, 0, cfg.num_kv_heads, cfg.head_dim), dtype)
        return tuple((z, z) for _ in self.layers)

    @staticmethod
    def extend_context(context: tuple, kv: tuple) -> tuple:
        """`context` with one more call's (k, v) per layer appended (its `cache` output)."""
        return tuple(
            (jnp.concatenate([ck, k], 1), jnp.concatenate([cv, v], 1)) for (ck, cv), (k, v) in zip(context, kv)
        )

    # -- forward -----------------------------------------------------------------------
    def __call__(
        self,
        tokens: jax.Array,
        g: jax.Array,
        positions: jax.Array,
        cache: tuple | None = None,
        spec: kernels.AttentionSpec | None = None,
        backend: str = "dense",
        context: tuple | None = None,
        source: jax.Array | None = None,
    ) -> DrafterOutput:
        """tokens [B, T] int, g [B, T, H], positions [B, T] (-1 = padding slot).

        `cache`: per layer (k, v) [B, S, Hkv, D], index = position (written at the
        positions, read whole, causal by position); None = attend within this call.
        `spec` (a `kernels.AttentionSpec`) replaces the causal rule, computed by `kernels.attention`
        with `backend` ("dense" builds the [T, keys] mask; "auto" runs the blockwise / Pallas kernels).
        Sliding layers put their own window into the rule (over a cache: the positional window).
        `context`: per layer (k, v) [B, S, Hkv, D] of rows run by earlier calls (their `cache`
        output), attended before this call's rows, with `spec`'s key metadata over S + T rows: a
        chain of calls computes each row once (training-time test, shared depth-0 rows); the
        output's `cache` is then this call's (k, v) per layer.
        `source` [B, T] int (mode parallel): row i's inputs are tokens / g [B, L] at index
        source[i], or the mask slot's (mask_token_id, mask_g()) where source[i] < 0; tokens and g
        may be None (every row is the slot). Layer 0 then computes its q, k, v once per position
        and once for the slot instead of once per row (COD rows: a depth-0 row reads its position,
        every deeper row the slot). With a `spec` whose `chain_depth` is >= 1, no cache or
        context and a blockwise backend, the rows must be the COD rows of that spec (a depth-0
        row's source is its anchor and its position; a deeper row's position is anchor + depth,
        its depth <= chain_depth; `kernels.mask_slot.check_layout`): layer 0 then attends the slot
        once per position (`Attention.attend_slots`), not once per row.
        """
        embeds = x = slot = None
        if tokens is not None:
            embeds = self.embed_tokens(tokens)
            x = g.astype(embeds.dtype)
        if source is not None:
            # a static row, not a gather of a constant index: sharded (tensor x fsdp) XLA gave that
            # gather's gradient wrong (tests/test_train_mesh.py, mesh 1 x 4 x 2: the mask token's row)
            table = self.embed_tokens.embedding[...]
            embed = table[self.config.mask_token_id][None, None].astype(self.embed_tokens.dtype or table.dtype)
            slot = (embed, self.mask_g()[None, None].astype(embed.dtype))
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(
                x,
                positions,
                None if cache is None else cache[i],
                spec,
                backend,
                embeds=embeds if i == 0 else None,
                context=None if context is None else context[i],
                source=source if i == 0 else None,
                slot=slot if i == 0 else None,
            )
            new_cache.append(kv)
        logits = self.head(x)
        keep = cache is not None or context is not None
        return DrafterOutput(logits, x, tuple(new_cache) if keep else None)


def drafter_apply(graphdef, state, tokens, g, positions, cache=None, spec=None) -> DrafterOutput:
    """Pure form of `DrafterModel.__call__` (jit it with `graphdef` static)."""
    return nnx.merge(graphdef, state)(tokens, g, positions, cache, spec)


def drafter_fuse(graphdef, state, aux) -> jax.Array:
    """Pure form of `DrafterModel.fuse`."""
    return nnx.merge(graphdef, state).fuse(aux)


# ---------------------------------------------------------------------------------------
# COD training rows
def peagle_mask(anchor: jax.Array, depth: jax.Array, doc: jax.Array, sliding_window: int | None = None) -> jax.Array:
    """The P-EAGLE attention rule as a dense bool mask [..., N, N] (True = query may attend key).

    Query q sees key k when both are in the same document (doc >= 0; -1 = padding) and
    (depth_k == 0 and anchor_k <= anchor_q and, with a window, anchor_q + depth_q - anchor_k <
    sliding_window) or (anchor_k == anchor_q and depth_k <= depth_q): a sliding layer sees the
    depth-0 rows within the window of the row's reference position, and its own chain.
    Dense, so for small N only (tests, short rows); kernels/ computes it block by block.
    """
    return kernels.visible(
        anchor[..., :, None],
        depth[..., :, None],
        doc[..., :, None],
        anchor[..., None, :],
        depth[..., None, :],
        doc[..., None, :],
        sliding_window,
    )


def cod_rows_forward(
    model: DrafterModel,
    tokens: jax.Array,
    aux: jax.Array,
    anchor: jax.Array,
    depth: jax.Array,
    doc: jax.Array,
    mask: str = "dense",
    chain_depth: int = 0,
) -> jax.Array:
    """Logits [B, N, Vd] over COD rows, no cache: `cod_rows_states(...).logits`."""
    return cod_rows_states(model, tokens, aux, anchor, depth, doc, mask, chain_depth).logits


def cod_rows_states(
    model: DrafterModel,
    tokens: jax.Array,
    aux: jax.Array,
    anchor: jax.Array,
    depth: jax.Array,
    doc: jax.Array,
    mask: str = "dense",
    chain_depth: int = 0,
) -> DrafterOutput:
    """The drafter's output over COD rows, no cache (a trainer that fuses the head into its loss
    reads `prenorm`; unused logits are never computed under jit).

    tokens [B, L]: the (already shifted) token of each position; aux [B, L, 3Ht]: the aux state
    of each position; anchor, depth, doc [B, N] (doc -1 = padding row). A row of depth 0 reads
    the inputs of its position `anchor`; rows with depth > 0 read `mask_token_id` and
    `mask_g()` = fuse(mask_hidden) (fc and its norms run once per position and once for the
    slot, and so do layer 0's q, k, v: `DrafterModel.__call__`'s `source`); position id =
    ref = anchor + depth; attention = the P-EAGLE rule of
    `kernels.AttentionSpec.peagle(anchor, depth, doc)` (each sliding layer with its window,
    counted from the reference position); `mask`
    "dense" (or None) builds it as one [B, N, N] mask (short rows, tests); "kernels" computes it
    block by block from the row metadata (`kernels.attention`, backend auto: memory linear in N,
    the path for long sequences); `chain_depth`: `kernels.AttentionSpec.chain_depth` (K - 1 for
    rows of depths < K: the kernels gather each row's chain instead of visiting its blocks).
    With "kernels" and chain_depth >= 1 the rows must be a COD layout of depths <= chain_depth
    (`kernels.mask_slot.check_layout`; `train.cod` and `kernels.layouts.cod_layout` make them): the
    first layer then attends the mask slot once per position (`kernels.slot_attention`: 2L
    instead of N queries in its block loop), exact for such rows.
    """
    cfg = model.config
    if cfg.mask_token_id is None:
        raise ValueError("cod_rows_states: the drafter has no mask_token_id (mode 'chain')")
    source = jnp.where((depth == 0) & (doc >= 0), jnp.clip(anchor, 0, tokens.shape[1] - 1), -1)
    positions = jnp.where(doc >= 0, anchor + depth, -1)
    if mask not in (None, "dense", "kernels"):
        raise ValueError(f"cod_rows_states: mask must be 'dense' or 'kernels', got {mask!r}")
    spec = kernels.AttentionSpec.peagle(anchor, depth, doc, chain_depth=chain_depth)
    backend = "auto" if mask == "kernels" else "dense"
    g = model.fuse(aux.astype(model.mask_hidden.dtype))
    return model(tokens, g, positions, None, spec, backend, source=source)


# ---------------------------------------------------------------------------------------
# state as arrays
def abstract_drafter(config: DrafterConfig, dtype="float32"):
    """(graphdef, abstract state) of the config's network (a DrafterModel, or a DFlashModel for
    mode "dflash"): shapes only, nothing allocated."""
    return abstract_module(DFlashModel if config.mode == "dflash" else DrafterModel, config, dtype)


def param_key(path: Sequence) -> str:
    """The dotted name of a variable path: ("layers", 0, "mlp") -> "layers.0.mlp". The one
    spelling of a parameter's name as a string (the trainer's flat dicts, checkpoints, messages)."""
    return ".".join(map(str, path))


def param_path(key: str) -> tuple:
    """The variable path of a dotted name: "layers.0.mlp" -> ("layers", 0, "mlp")."""
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


def flat_state(state) -> dict[tuple, Any]:
    """{path tuple: Variable} of a drafter state."""
    return {tuple(path): var for path, var in nnx.to_flat_state(state)}


def state_from_arrays(config: DrafterConfig, arrays: dict[tuple, Any], dtype="float32", where: str = ""):
    """(graphdef, state) with every variable taken from `arrays` {path tuple: array}.

    Float parameters are cast to `dtype`; d2t to int32. Every path must be given with its shape.
    """
    d = numpy_dtype(dtype)
    graphdef, abstract = abstract_drafter(config, d)
    flat = flat_state(abstract)
    missing = sorted(param_key(p) for p in set(flat) - set(arrays))
    extra = sorted(param_key(p) for p in set(arrays) - set(flat))
    if missing or extra:
        raise ValueError(f"{where}drafter state mismatch: missing {missing}, unexpected {extra}")
    for path, var in flat.items():
        arr = arrays[path]
        if tuple(arr.shape) != tuple(var.shape):
            raise ValueError(f"{where}{param_key(path)}: shape {tuple(arr.shape)}, expected {tuple(var.shape)}")
        want = jnp.int32 if isinstance(var, VocabMap) else d
        flat[path] = var.replace(jnp.asarray(np.asarray(arr), dtype=want))
    return graphdef, nnx.from_flat_state(list(flat.items()))


INIT_STD = 0.02  # transformers' Llama initializer_range (what speculators' fresh heads use)


def init_arrays(config: DrafterConfig, seed: int, given: dict | None = None) -> dict[tuple, np.ndarray]:
    """{path: array} of a fresh DrafterModel, drawn on the host with numpy (an XLA-compiled
    init takes seconds even for a tiny head): kernels and embeddings ~ N(0, 0.02), norm
    weights 1, biases 0, mask_hidden ~ N(0, 1), d2t 0. `given` {path: array} supplies some
    variables (not drawn)."""
    rng = np.random.default_rng(seed)
    _, abstract = abstract_drafter(config)
    arrays = dict(given or {})
    for path, var in flat_state(abstract).items():
        name = path[-1]
        if path in arrays:
            continue
        if name in ("kernel", "embedding"):
            arrays[path] = rng.normal(0.0, INIT_STD, var.shape).astype(np.float32)
        elif name == "mask_hidden":
            arrays[path] = rng.standard_normal(var.shape).astype(np.float32)
        elif name == "weight":  # RMSNorm
            arrays[path] = np.ones(var.shape, np.float32)
        else:  # biases, d2t
            arrays[path] = np.zeros(var.shape, np.float32 if name == "bias" else np.int32)
    return arrays
