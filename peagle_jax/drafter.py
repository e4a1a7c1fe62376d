"""The EAGLE-3 / P-EAGLE drafter head (reference/peagle.md section 3) and its handle.

```
g   = fc(aux)                                   # [.., 3*Ht] -> [.., H]; optional norms before fc
layer 0 (fused):  z = concat(input_layernorm(embed(x)), hidden_norm(g))   # width 2H
                  h = res + o_proj(attn(q, k, v = proj(z)))  # res = g (hidden_norm(g) if norm_before_residual)
                  h = h + mlp(post_attention_layernorm(h))
layers 1..N-1:    plain pre-norm Llama blocks
logits = lm_head(norm(h))                       # [.., Vd]; target id = draft id + d2t[draft id]
```
One module serves both modes: "parallel" (P-EAGLE: masked slots read `mask_token_id` and
`mask_g() = fuse(mask_hidden)`) and "chain" (EAGLE-3: each later step feeds the drafter's
own last hidden state back as g, bypassing fc; see `DrafterModel.feedback`).

Parameter names follow the checkpoint keys (`layers.0.*` is vLLM's `midlayer.*`), so the
import/export maps in `peagle_jax.drafter_io` are one line per tensor.

Defaults chosen by `new_drafter` when not given (documented here, reported in the config):
- `mask_token_id`: the target's `pad_token_id` when it has one, else `V - 1` (the last id,
  a reserved/special token in the common vocabularies). Only for mode "parallel".
- For a Gemma target the drafter is still a Llama-architecture head (plain RMSNorm `w * x`,
  SiLU MLP, attention scale head_dim**-0.5): that is what vLLM serves. Its `embed_tokens`
  is initialised to the target's embedding times Gemma's `sqrt(H)` embedding scale, so the
  drafter's first layer sees the same input scale the target's first layer saw.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels
from peagle_jax.config import ConfigError, RopeConfig, read_json
from peagle_jax.folders import atomic_folder, check_destination
from peagle_jax.models.layers import ACTIVATIONS, MLP, Attention, RMSNorm

__all__ = [
    "DrafterConfig",
    "DrafterModel",
    "DrafterOutput",
    "VocabMap",
    "Drafter",
    "new_drafter",
    "load_drafter",
    "init_drafter_cache",
    "draft_to_target",
    "t2d_from_d2t",
    "d2t_from_ids",
    "select_draft_vocab",
    "peagle_mask",
    "cod_rows_forward",
    "drafter_apply",
    "drafter_fuse",
    "abstract_drafter",
    "flat_state",
    "state_from_arrays",
    "OWN_CONFIG_FILE",
]

OWN_CONFIG_FILE = "drafter.json"
OWN_STATE_DIR = "state"
OWN_FORMAT = "peagle_jax.drafter"
OWN_VERSION = 1
MODES = ("parallel", "chain")
NUM_AUX = 3


# ---------------------------------------------------------------------------------------
# config
@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Everything that shapes the drafter network. Hashable (a static jit argument).

    `aux_layer_ids` use the vLLM convention (residual stream entering that target layer).
    `k_train` is the depth the head was trained for (P-EAGLE: COD depths K; EAGLE-3: TTT
    steps); None when unknown. `norm_output` (EAGLE 3.1): chain mode feeds back the
    post-norm state instead of the pre-norm one. `qk_norm`: Qwen3-style per-head q/k
    RMSNorm in every layer (speculators heads built on a Qwen3 layer config).
    `verifier`: the target's name or path as a speculators config records it.
    """

    hidden_size: int
    target_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    mode: str = "parallel"
    mask_token_id: int | None = None
    aux_layer_ids: tuple[int, int, int] | None = None
    k_train: int | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    target_model_type: str | None = None
    verifier: str | None = None

    def __post_init__(self):
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        for name in ("hidden_size", "target_hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "vocab_size", "draft_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"DrafterConfig: {name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.mode not in MODES:
            raise ConfigError(f"DrafterConfig: mode must be one of {MODES}, got {self.mode!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"DrafterConfig: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"DrafterConfig: draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}"
            )
        if self.mask_token_id is not None:
            if not 0 <= int(self.mask_token_id) < self.vocab_size:
                raise ConfigError(
                    f"DrafterConfig: mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})"
                )
            object.__setattr__(self, "mask_token_id", int(self.mask_token_id))
        if self.mode == "parallel" and self.mask_token_id is None:
            raise ConfigError("DrafterConfig: mode 'parallel' needs a mask_token_id")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != NUM_AUX:
            raise ConfigError(f"DrafterConfig: aux_layer_ids must hold {NUM_AUX} ids, got {self.aux_layer_ids}")
        if self.norm_before_fc and self.fc_norm:
            raise ConfigError("DrafterConfig: norm_before_fc and fc_norm are mutually exclusive")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"DrafterConfig: unsupported hidden_act {self.hidden_act!r}")
        if self.k_train is not None:
            object.__setattr__(self, "k_train", int(self.k_train))

    @property
    def attn_scale(self) -> float:
        return float(self.head_dim) ** -0.5

    @property
    def fc_in(self) -> int:
        return NUM_AUX * self.target_hidden_size

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["rope"] = dataclasses.asdict(self.rope)
        out["aux_layer_ids"] = None if self.aux_layer_ids is None else list(self.aux_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict, where: str = "drafter config") -> DrafterConfig:
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}")
        rope = data.get("rope")
        if isinstance(rope, dict):
            rope_known = {f.name for f in dataclasses.fields(RopeConfig)}
            bad = sorted(set(rope) - rope_known)
            if bad:
                raise ConfigError(f"{where}: unknown keys {bad} in 'rope'")
            data["rope"] = RopeConfig(**rope)
        try:
            return cls(**data)
        except TypeError as err:
            raise ConfigError(f"{where}: {err}") from None


# ---------------------------------------------------------------------------------------
# the network
class VocabMap(nnx.Variable):
    """A non-trainable int variable (the draft -> target id offsets `d2t`)."""


class DrafterOutput(NamedTuple):
    logits: jax.Array  # [B, T, Vd] float32
    prenorm: jax.Array  # [B, T, H] last layer output before the final norm
    cache: tuple | None  # per layer (k, v) [B, S, Hkv, D]


class DrafterLayer(nnx.Module):
    """Layer 0 (`fused=True`): q/k/v read concat(input_layernorm(embed), hidden_norm(g)).
    Later layers: the plain pre-norm Llama block."""

    def __init__(self, cfg: DrafterConfig, fused: bool, *, dtype, param_dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size

        def norm():
            return RMSNorm(h, cfg.rms_norm_eps, param_dtype=param_dtype)

        self.fused = fused
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = norm()
        if fused:
            self.hidden_norm = norm()
        self.self_attn = Attention(
            2 * h if fused else h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            rope=cfg.rope, scale=cfg.attn_scale, bias=cfg.attention_bias, out_bias=cfg.attention_bias,
            qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
            dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        )
        self.post_attention_layernorm = norm()
        self.mlp = MLP(h, cfg.intermediate_size, cfg.hidden_act, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache=None, mask=None, embeds=None):
        if self.fused:
            hn = self.hidden_norm(x)
            residual = hn if self.norm_before_residual else x
            z = jnp.concatenate([self.input_layernorm(embeds).astype(hn.dtype), hn], axis=-1)
        else:
            residual, z = x, self.input_layernorm(x)
        attn, kv_cache = self.self_attn(z, positions, kv_cache, mask)
        x = residual + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class DrafterModel(nnx.Module):
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
            self.fc_norm = nnx.List([
                RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype) for _ in range(NUM_AUX)
            ])
        self.fc = nnx.Linear(cfg.fc_in, h, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([
            DrafterLayer(cfg, i == 0, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for i in range(cfg.num_layers)
        ])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = nnx.Linear(h, cfg.draft_vocab_size, use_bias=False, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
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

    def head(self, prenorm: jax.Array) -> jax.Array:
        """Draft-vocabulary logits (float32) of pre-norm states: lm_head(norm(prenorm)).
        Callers that need a few rows gather them first (the [T, Vd] product dominates)."""
        return self.lm_head(self.norm(prenorm)).astype(jnp.float32)

    @property
    def t2d(self) -> jax.Array:
        return t2d_from_d2t(self.d2t[...], self.config.vocab_size)

    # -- forward -----------------------------------------------------------------------
    def __call__(
        self,
        tokens: jax.Array,
        g: jax.Array,
        positions: jax.Array,
        cache: tuple | None = None,
        mask: jax.Array | None = None,
    ) -> DrafterOutput:
        """tokens [B, T] int, g [B, T, H], positions [B, T] (-1 = padding slot).

        `cache`: per layer (k, v) [B, S, Hkv, D], index = position (written at the
        positions, read whole, causal by position); None = attend within this call.
        `mask` [B, T, keys] bool replaces the causal rule (keys = T, or S with a cache).
        """
        embeds = self.embed_tokens(tokens)
        x = g.astype(embeds.dtype)
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, positions, None if cache is None else cache[i], mask,
                          embeds=embeds if i == 0 else None)
            new_cache.append(kv)
        logits = self.head(x)
        return DrafterOutput(logits, x, None if cache is None else tuple(new_cache))


def drafter_apply(graphdef, state, tokens, g, positions, cache=None, mask=None) -> DrafterOutput:
    """Pure form of `DrafterModel.__call__` (jit it with `graphdef` static)."""
    return nnx.merge(graphdef, state)(tokens, g, positions, cache, mask)


def drafter_fuse(graphdef, state, aux) -> jax.Array:
    """Pure form of `DrafterModel.fuse`."""
    return nnx.merge(graphdef, state).fuse(aux)


_apply_jit = jax.jit(drafter_apply, static_argnums=(0,))
_fuse_jit = jax.jit(drafter_fuse, static_argnums=(0,))


def init_drafter_cache(config: DrafterConfig, batch: int, max_len: int, dtype=jnp.float32) -> tuple:
    """An empty static-size cache: per layer (k, v), each [batch, max_len, Hkv, D]."""
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_layers))


# ---------------------------------------------------------------------------------------
# vocabulary
def draft_to_target(d2t, draft_ids: jax.Array) -> jax.Array:
    """target id = draft id + d2t[draft id] (int32)."""
    d2t = d2t[...] if isinstance(d2t, nnx.Variable) else d2t
    ids = jnp.asarray(draft_ids).astype(jnp.int32)
    return ids + jnp.asarray(d2t)[ids].astype(jnp.int32)


def t2d_from_d2t(d2t, vocab_size: int):
    """Bool [V]: which target ids are in the draft vocabulary."""
    d2t = d2t[...] if isinstance(d2t, nnx.Variable) else d2t
    if isinstance(d2t, np.ndarray):
        out = np.zeros((vocab_size,), bool)
        out[np.arange(d2t.shape[0]) + d2t] = True
        return out
    ids = jnp.arange(d2t.shape[0], dtype=jnp.int32) + d2t.astype(jnp.int32)
    return jnp.zeros((vocab_size,), bool).at[ids].set(True)


def d2t_from_ids(used: Sequence[int] | np.ndarray) -> np.ndarray:
    """d2t [Vd] int64 from the sorted target ids of the draft vocabulary."""
    used = np.asarray(used, np.int64)
    return used - np.arange(used.shape[0], dtype=np.int64)


def select_draft_vocab(token_counts, size: int) -> np.ndarray:
    """Top-`size` target ids by count (ties: lower id first), sorted by id."""
    counts = np.asarray(token_counts)
    if counts.ndim != 1:
        raise ValueError(f"token_counts must be 1-D [V], got shape {counts.shape}")
    if not 0 < size <= counts.shape[0]:
        raise ValueError(f"draft vocab size {size} outside [1, {counts.shape[0]}]")
    order = np.lexsort((np.arange(counts.shape[0]), -counts.astype(np.float64)))
    return np.sort(order[:size]).astype(np.int64)


# ---------------------------------------------------------------------------------------
# COD training rows
def peagle_mask(anchor: jax.Array, depth: jax.Array, doc: jax.Array) -> jax.Array:
    """The P-EAGLE attention rule as a dense bool mask [..., N, N] (True = query may attend key).

    Query q sees key k when both are in the same document (doc >= 0; -1 = padding) and
    (depth_k == 0 and anchor_k <= anchor_q) or (anchor_k == anchor_q and depth_k <= depth_q).
    Dense, so for small N only (tests, short rows); kernels/ computes it block by block.
    """
    aq, ak = anchor[..., :, None], anchor[..., None, :]
    dq, dk = depth[..., :, None], depth[..., None, :]
    docq, dock = doc[..., :, None], doc[..., None, :]
    same = (docq == dock) & (docq >= 0) & (dock >= 0)
    return same & (((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq)))


def cod_rows_forward(
    model: DrafterModel,
    tokens: jax.Array,
    aux: jax.Array,
    anchor: jax.Array,
    depth: jax.Array,
    doc: jax.Array,
    mask: jax.Array | str | None = None,
) -> jax.Array:
    """Logits [B, N, Vd] over COD rows, no cache.

    tokens [B, N]: the (already shifted) token at each row's reference position
    ref = anchor + depth; aux [B, N, 3Ht]: the aux state at ref; anchor, depth, doc [B, N]
    (doc -1 = padding row). Rows with depth > 0 read `mask_token_id` and `mask_hidden`
    (selected before fc, so they pass through the same fc and norms); position id = ref;
    attention = `peagle_mask(anchor, depth, doc)` (dense [B, N, N]) unless `mask` is given:
    an explicit [B, N, N] mask, or "kernels" = the same rule computed block by block from the
    row metadata by `kernels.attention` (memory linear in N: the path for long sequences).
    """
    cfg = model.config
    if cfg.mask_token_id is None:
        raise ValueError("cod_rows_forward: the drafter has no mask_token_id (mode 'chain')")
    real = depth == 0
    tok = jnp.where(real, tokens, cfg.mask_token_id)
    hidden = jnp.where(real[..., None], aux.astype(model.mask_hidden.dtype), model.mask_hidden[...][0])
    positions = jnp.where(doc >= 0, anchor + depth, -1)
    if mask is None:
        mask = peagle_mask(anchor, depth, doc)
    elif mask == "kernels":
        mask = kernels.AttentionSpec.peagle(anchor, depth, doc)
    return model(tok, model.fuse(hidden), positions, None, mask).logits


# ---------------------------------------------------------------------------------------
# the handle
def _dtype(dtype) -> jnp.dtype:
    names = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}
    if isinstance(dtype, str):
        if dtype not in names:
            raise ValueError(f"unsupported dtype {dtype!r} (supported: float32, bfloat16)")
        return jnp.dtype(names[dtype])
    return jnp.dtype(dtype)


def abstract_drafter(config: DrafterConfig, dtype="float32"):
    """(graphdef, abstract state) of a DrafterModel: shapes only, nothing allocated."""
    d = _dtype(dtype)
    model = nnx.eval_shape(lambda: DrafterModel(config, dtype=d, param_dtype=d, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def flat_state(state) -> dict[tuple, Any]:
    """{path tuple: Variable} of a drafter state."""
    return {tuple(path): var for path, var in nnx.to_flat_state(state)}


def state_from_arrays(config: DrafterConfig, arrays: dict[tuple, Any], dtype="float32", where: str = ""):
    """(graphdef, state) with every variable taken from `arrays` {path tuple: array}.

    Float parameters are cast to `dtype`; d2t to int32. Every path must be given with its shape.
    """
    d = _dtype(dtype)
    graphdef, abstract = abstract_drafter(config, d)
    flat = flat_state(abstract)
    missing = sorted(".".join(map(str, p)) for p in set(flat) - set(arrays))
    extra = sorted(".".join(map(str, p)) for p in set(arrays) - set(flat))
    if missing or extra:
        raise ValueError(f"{where}drafter state mismatch: missing {missing}, unexpected {extra}")
    for path, var in flat.items():
        arr = arrays[path]
        if tuple(arr.shape) != tuple(var.shape):
            raise ValueError(
                f"{where}{'.'.join(map(str, path))}: shape {tuple(arr.shape)}, expected {tuple(var.shape)}"
            )
        want = jnp.int32 if isinstance(var, VocabMap) else d
        _set_path(abstract, path, var.replace(jnp.asarray(np.asarray(arr), dtype=want)))
    return graphdef, abstract


def _set_path(tree, path: tuple, value) -> None:
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


class Drafter:
    """A drafter: config + (graphdef, state) of its DrafterModel."""

    def __init__(self, config: DrafterConfig, graphdef, state, *, path: str | os.PathLike | None = None):
        self.config = config
        self.graphdef = graphdef
        self.state = state
        self.path = None if path is None else Path(path)

    @property
    def model(self) -> DrafterModel:
        return nnx.merge(self.graphdef, self.state)

    @property
    def dtype(self):
        return self.state["fc"]["kernel"][...].dtype

    @property
    def d2t(self) -> np.ndarray:
        """[Vd] int64 offsets (target id = draft id + d2t[draft id])."""
        return np.asarray(jax.device_get(self.state["d2t"][...])).astype(np.int64)

    @property
    def t2d(self) -> np.ndarray:
        """[V] bool."""
        return t2d_from_d2t(self.d2t, self.config.vocab_size)

    def apply(self, tokens, g, positions, cache=None, mask=None) -> DrafterOutput:
        """Jitted forward (see `DrafterModel.__call__`)."""
        return _apply_jit(self.graphdef, self.state, tokens, g, positions, cache, mask)

    def fuse(self, aux) -> jax.Array:
        """Jitted `DrafterModel.fuse`: [..., 3*Ht] aux states -> [..., H]."""
        return _fuse_jit(self.graphdef, self.state, aux)

    @classmethod
    def random(cls, config: DrafterConfig, seed: int = 0, dtype="float32", draft_ids=None) -> Drafter:
        """A randomly initialised head (no target): norms ones, biases zeros, mask_hidden
        ~ N(0, 1). `draft_ids`: sorted target ids of the draft vocabulary (default 0..Vd-1)."""
        graphdef, state = _random_state(config, str(_dtype(dtype)), seed)
        if draft_ids is not None:
            ids = np.asarray(draft_ids, np.int64)
            if ids.shape != (config.draft_vocab_size,):
                raise ValueError(f"draft_ids has shape {ids.shape}, expected ({config.draft_vocab_size},)")
            state["d2t"] = state["d2t"].replace(jnp.asarray(d2t_from_ids(ids), jnp.int32))
        return cls(config, graphdef, state)

    def arrays(self) -> dict[tuple, np.ndarray]:
        """{path tuple: numpy array} of every variable (host copies)."""
        return {p: np.asarray(jax.device_get(v[...])) for p, v in flat_state(self.state).items()}

    def __repr__(self) -> str:
        c = self.config
        return (f"Drafter(mode={c.mode}, layers={c.num_layers}, hidden={c.hidden_size}, vocab={c.vocab_size}, "
                f"draft_vocab={c.draft_vocab_size}, mask_token_id={c.mask_token_id}, dtype={self.dtype})")

    def save(self, path: str | os.PathLike) -> Path:
        """Own checkpoint: path/drafter.json (config) + path/state (orbax). Written to a
        temporary sibling folder, then renamed into place; an existing drafter checkpoint
        (or empty folder) at `path` is replaced, anything else is refused."""
        import orbax.checkpoint as ocp

        dest = Path(path).absolute()
        check_destination(dest, overwrite=True, marker=OWN_CONFIG_FILE)  # replaces only a drafter checkpoint
        with atomic_folder(dest) as tmp:
            meta = {"format": OWN_FORMAT, "version": OWN_VERSION, "dtype": str(self.dtype),
                    "config": self.config.to_dict()}
            (tmp / OWN_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(tmp / OWN_STATE_DIR, nnx.to_pure_dict(self.state))
                ckptr.wait_until_finished()
        self.path = dest
        return dest


INIT_STD = 0.02  # transformers' Llama initializer_range (what speculators' fresh heads use)


def _random_state(config: DrafterConfig, dtype: str, seed: int, given: dict | None = None):
    """(graphdef, state) of a fresh DrafterModel, initialised on the host with numpy (an
    XLA-compiled init takes seconds even for a tiny head): kernels and embeddings
    ~ N(0, 0.02), norm weights 1, biases 0, mask_hidden ~ N(0, 1), d2t 0. `given`
    {path: array} supplies some variables (not drawn)."""
    rng = np.random.default_rng(seed)
    _, abstract = abstract_drafter(config, dtype)
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
    return state_from_arrays(config, arrays, dtype)


def _load_own(path: Path, dtype=None) -> Drafter:
    import orbax.checkpoint as ocp

    cfg_file = path / OWN_CONFIG_FILE
    meta = read_json(cfg_file)
    if meta.get("format") != OWN_FORMAT:
        raise ConfigError(f"{cfg_file}: key 'format' is {meta.get('format')!r}, expected {OWN_FORMAT!r}")
    if meta.get("version") != OWN_VERSION:
        raise ConfigError(f"{cfg_file}: unsupported version {meta.get('version')!r} (this build reads {OWN_VERSION})")
    config = DrafterConfig.from_dict(meta.get("config") or {}, f"{cfg_file} key 'config'")
    d = _dtype(dtype or meta.get("dtype", "float32"))
    state_dir = path / OWN_STATE_DIR
    if not state_dir.is_dir():
        raise FileNotFoundError(f"{state_dir}: missing (a drafter checkpoint holds drafter.json and state/)")
    graphdef, abstract = abstract_drafter(config, meta.get("dtype", "float32"))
    with ocp.StandardCheckpointer() as ckptr:
        try:
            restored = ckptr.restore(state_dir.absolute(), nnx.to_pure_dict(abstract))
        except Exception as err:  # orbax raises many types; name the folder
            raise ValueError(f"{state_dir}: cannot restore the drafter state ({err})") from None
    flat = {}
    for path_, value in _flatten_pure(restored):
        flat[path_] = value
    graphdef, state = state_from_arrays(config, flat, d, where=f"{state_dir}: ")
    return Drafter(config, graphdef, state, path=path)


def _flatten_pure(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten_pure(v, prefix + (int(k) if isinstance(k, str) and k.isdigit() else k,))
    else:
        yield prefix, tree


def load_drafter(path: str | os.PathLike, *, target=None, dtype=None) -> Drafter:
    """An own checkpoint (drafter.json), or a vLLM-native or speculators folder (config.json +
    safetensors; see `peagle_jax.drafter_io`). `target` (a Target) supplies embed_tokens for an
    EAGLE-3 chain head that ships none. `dtype` None = the checkpoint's own (imports: float32)."""
    p = Path(path)
    if (p / OWN_CONFIG_FILE).exists():
        return _load_own(p, dtype)
    from peagle_jax import drafter_io

    return drafter_io.import_drafter(p, target=target, dtype=dtype or "float32")


# ---------------------------------------------------------------------------------------
# a new head for a target
def _target_arrays(target) -> tuple[np.ndarray, np.ndarray]:
    """(embedding [V, H] as the target's first layer sees it, lm_head weight [V, H])."""
    model = nnx.merge(target.graphdef, target.state)
    raw = model.embed_tokens.embedding[...]
    emb = np.asarray(jax.device_get(raw)).astype(np.float32)
    tc = target.config
    if tc.tie_word_embeddings:
        head = emb
    else:
        head = np.asarray(jax.device_get(model.lm_head.kernel[...])).astype(np.float32).T
    scale = getattr(tc, "embed_scale", 1.0)
    if scale != 1.0:  # Gemma scales its embeddings by sqrt(H), the scale cast to the weight dtype first
        emb = emb * np.float32(jnp.asarray(scale, raw.dtype))
    return emb, head


def new_drafter(
    target,
    num_layers: int = 1,
    mode: str = "parallel",
    draft_vocab=None,
    mask_token_id: int | None = None,
    seed: int = 0,
    k_train: int | None = 8,
    *,
    token_counts=None,
    dtype="float32",
    **flags,
) -> Drafter:
    """A fresh head for `target` (a Target: .config, .graphdef, .state, .aux_layer_ids).

    Shapes (H, heads, kv heads, head_dim, intermediate, rope, max positions, eps) follow the
    target. embed_tokens starts as the target's embedding; lm_head as the target's lm_head
    (or tied embedding) rows of the draft vocabulary; mask_hidden ~ N(0, 1); the rest random.
    draft_vocab: None = the full vocabulary (d2t zeros); an int Vd = the top-Vd ids of
    `token_counts` [V]; or an explicit array of target ids (sorted, unique).
    mask_token_id (parallel only): None = the target's pad token, else V - 1.
    flags: norm_before_residual, norm_before_fc, fc_norm, norm_output, attention_bias,
    qk_norm, rope (a RopeConfig to use instead of the target's).
    """
    tc = target.config
    v = tc.vocab_size
    if draft_vocab is None:
        used = np.arange(v, dtype=np.int64)
    elif isinstance(draft_vocab, (int, np.integer)) and not isinstance(draft_vocab, bool):
        if token_counts is None:
            if int(draft_vocab) != v:
                raise ValueError("new_drafter: an int draft_vocab needs token_counts [V] to pick the ids")
            used = np.arange(v, dtype=np.int64)
        else:
            if np.shape(token_counts) != (v,):
                raise ValueError(f"new_drafter: token_counts has shape {np.shape(token_counts)}, expected ({v},)")
            used = select_draft_vocab(token_counts, int(draft_vocab))
    else:
        used = np.asarray(draft_vocab, np.int64)
        if used.ndim != 1 or used.size == 0 or np.any(np.diff(used) <= 0) or used[0] < 0 or used[-1] >= v:
            raise ValueError(f"new_drafter: draft_vocab must be sorted unique ids in [0, {v})")
    if mode == "parallel" and mask_token_id is None:
        mask_token_id = tc.pad_token_id if tc.pad_token_id is not None else v - 1
    if mode == "chain":
        mask_token_id = None
    rope = flags.pop("rope", tc.rope)
    known = {"norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "attention_bias", "qk_norm"}
    bad = sorted(set(flags) - known)
    if bad:
        raise TypeError(f"new_drafter: unknown flags {bad} (known: {sorted(known)})")
    config = DrafterConfig(
        hidden_size=tc.hidden_size,
        target_hidden_size=tc.hidden_size,
        num_layers=num_layers,
        num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim,
        intermediate_size=tc.intermediate_size,
        vocab_size=v,
        draft_vocab_size=int(used.shape[0]),
        rms_norm_eps=tc.rms_norm_eps,
        rope=rope,
        max_position_embeddings=tc.max_position_embeddings,
        mode=mode,
        mask_token_id=mask_token_id,
        aux_layer_ids=tuple(target.aux_layer_ids),
        k_train=k_train,
        target_model_type=tc.model_type,
        verifier=None if getattr(target, "path", None) is None else str(target.path),
        **{k: bool(val) for k, val in flags.items()},
    )
    emb, head = _target_arrays(target)
    given = {
        ("embed_tokens", "embedding"): emb,
        ("lm_head", "kernel"): np.ascontiguousarray(head[used].T),
        ("d2t",): d2t_from_ids(used).astype(np.int32),
    }
    graphdef, state = _random_state(config, str(_dtype(dtype)), seed, given)
    return Drafter(config, graphdef, state)
