"""The drafter handle users hold: `new_drafter`, `load_drafter`, `Drafter.save`.

The network is `peagle_jax.models.eagle`; every checkpoint format (our own, vLLM's,
speculators') is `peagle_jax.formats.checkpoints`, which works on (config, arrays) and never sees
this handle. Defaults chosen by `new_drafter` when not given (reported in the config):
- `mask_token_id`: the target's `pad_token_id` when it has one, else `V - 1` (the last id,
  a reserved/special token in the common vocabularies). Only for mode "parallel".
- For a Gemma target the drafter is still a Llama-architecture head (plain RMSNorm `w * x`,
  SiLU MLP, attention scale head_dim**-0.5): that is what vLLM serves. Its `embed_tokens`
  is initialised to the target's embedding times Gemma's `sqrt(H)` embedding scale, so the
  drafter's first layer sees the same input scale the target's first layer saw.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.dtypes import dtype_name
from peagle_jax.config.target_config import dflash_aux_layer_ids, validate_aux_layer_ids
from peagle_jax.formats import read_drafter, write_own
from peagle_jax.handles.drafter_init import target_layer_arrays
from peagle_jax.models.eagle import (
    DrafterModel,
    DrafterOutput,
    d2t_from_ids,
    drafter_apply,
    drafter_fuse,
    flat_state,
    init_arrays,
    select_draft_vocab,
    state_from_arrays,
    t2d_from_d2t,
)
from peagle_jax.sources.hub import repo_id_of, resolve

__all__ = ["Drafter", "DrafterConfig", "new_drafter", "head_config", "load_drafter"]

_apply_jit = jax.jit(drafter_apply, static_argnums=(0,))
_fuse_jit = jax.jit(drafter_fuse, static_argnums=(0,))


class Drafter:
    """A drafter: config + (graphdef, state) of its DrafterModel."""

    def __init__(self, config: DrafterConfig, graphdef, state, *, path: str | os.PathLike | None = None):
        self.config = config
        self.graphdef = graphdef
        self.state = state
        self.path = None if path is None else Path(path)

    @classmethod
    def from_arrays(
        cls, config: DrafterConfig, arrays: dict, dtype="float32", *, path=None, where: str = ""
    ) -> Drafter:
        graphdef, state = state_from_arrays(config, arrays, dtype, where=where)
        return cls(config, graphdef, state, path=path)

    @classmethod
    def random(cls, config: DrafterConfig, seed: int = 0, dtype="float32", draft_ids=None) -> Drafter:
        """A randomly initialised head (no target): norms ones, biases zeros, mask_hidden
        ~ N(0, 1). `draft_ids`: sorted target ids of the draft vocabulary (default 0..Vd-1)."""
        given = {}
        if draft_ids is not None:
            ids = np.asarray(draft_ids, np.int64)
            if ids.shape != (config.draft_vocab_size,):
                raise ValueError(f"draft_ids has shape {ids.shape}, expected ({config.draft_vocab_size},)")
            given[("d2t",)] = d2t_from_ids(ids).astype(np.int32)
        return cls.from_arrays(config, init_arrays(config, seed, given), dtype)

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

    def apply(self, tokens, g, positions, cache=None, spec=None) -> DrafterOutput:
        """Jitted forward (see `DrafterModel.__call__`)."""
        return _apply_jit(self.graphdef, self.state, tokens, g, positions, cache, spec)

    def fuse(self, aux) -> jax.Array:
        """Jitted `DrafterModel.fuse`: [..., 3*Ht] aux states -> [..., H]."""
        return _fuse_jit(self.graphdef, self.state, aux)

    def arrays(self) -> dict[tuple, np.ndarray]:
        """{path tuple: numpy array} of every variable (host copies)."""
        return {p: np.asarray(jax.device_get(v[...])) for p, v in flat_state(self.state).items()}

    def fingerprint(self) -> str:
        """A short content hash of the head's weights (its arrays in path order, with their shapes
        and dtypes): which head a server runs, whatever folder it came from."""
        digest = hashlib.sha256()
        for path, array in sorted(self.arrays().items(), key=lambda item: str(item[0])):
            digest.update(f"{path}{array.shape}{array.dtype}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()[:12]

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Drafter(mode={c.mode}, layers={c.num_layers}, hidden={c.hidden_size}, vocab={c.vocab_size}, "
            f"draft_vocab={c.draft_vocab_size}, mask_token_id={c.mask_token_id}, dtype={self.dtype})"
        )

    def save(self, path: str | os.PathLike, *, allow_non_finite: bool = False) -> Path:
        """Own checkpoint: path/drafter.json (config) + path/state (orbax). Written to a
        temporary sibling folder, then renamed into place; an existing drafter checkpoint
        (or empty folder) at `path` is replaced, anything else is refused. A head with NaN / Inf
        weights is refused (ValueError naming the tensor) unless `allow_non_finite=True`."""
        self.path = write_own(
            path, self.config, self.arrays(), dtype_name(self.dtype), allow_non_finite=allow_non_finite
        )
        return self.path


def load_drafter(path: str | os.PathLike, *, target=None, dtype=None) -> Drafter:
    """An own checkpoint (drafter.json), or a vLLM-native or speculators folder (config.json +
    safetensors; see `peagle_jax.formats.checkpoints`). `target` (a Target) supplies embed_tokens for an
    EAGLE-3 chain head that ships none, and embed_tokens / lm_head for a DFlash head (speculators
    saves neither for a full vocabulary). `dtype` None = the checkpoint's own (imports: float32).
    `path` may be a Hub id ("org/name", `peagle_jax.sources.hub`; a local folder of that name wins)."""
    path = resolve(path, "head")
    embeddings = weights = None
    if target is not None:
        embeddings = lambda: target.embedding_arrays()[0]  # noqa: E731
        weights = lambda: target.embedding_arrays(scaled=False)  # noqa: E731 - what a DFlash head shares
    config, arrays, stored = read_drafter(path, embeddings=embeddings, target_weights=weights)
    d = dtype or stored
    return Drafter.from_arrays(config, arrays, d, path=Path(path), where=f"{path}: ")


def draft_ids(draft_vocab, token_counts, v: int) -> np.ndarray:
    """The target ids of a head's draft vocabulary (`new_drafter`'s `draft_vocab`): all `v`, the
    top-Vd of `token_counts`, or an explicit sorted array."""
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
    return used


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
    dtype=None,
    sliding_window: int | None = None,
    layer_types=None,
    block_size: int = 8,
    aux_layer_ids=None,
    init_layer: int | None = None,
    **flags,
) -> Drafter:
    """A fresh head for `target` (a Target: .config, .graphdef, .state, .aux_layer_ids).

    Shapes (H, heads, kv heads, head_dim, intermediate, rope, max positions, eps) follow the
    target. embed_tokens starts as the target's embedding; lm_head as the target's lm_head
    (or tied embedding) rows of the draft vocabulary; mask_hidden ~ N(0, 1); the rest random.
    draft_vocab: None = the full vocabulary (d2t zeros); an int Vd = the top-Vd ids of
    `token_counts` [V]; or an explicit array of target ids (sorted, unique).
    mask_token_id (parallel only): None = the target's pad token, else V - 1.
    dtype: the parameter dtype; None = the target's.
    sliding_window: a window (tokens) for the drafter layers `layer_types` names
    "sliding_attention"; layer_types None = every layer slides when a window is given (the
    speculators default), else all full attention.
    flags: norm_before_residual, norm_before_fc, fc_norm, norm_output, attention_bias,
    qk_norm, rope (a RopeConfig to use instead of the target's); DFlash: sliding_window_non_causal.
    init_layer: start layer 0 from this target layer (negative: from the end) instead of random
    (`peagle_jax.handles.drafter_init`: attention, MLP and norms carried over; P-EAGLE / EAGLE-3).
    Mode "dflash": a block of `block_size` (B - 1 drafts a pass); `aux_layer_ids` None = DFlash's
    default context layers, one per head layer (`config.dflash_aux_layer_ids`); Qwen3 layers
    (q/k norms); embed_tokens is the target's raw embedding (no Gemma scale), as speculators
    and vLLM give a DFlash head.
    """
    used = draft_ids(draft_vocab, token_counts, target.config.vocab_size)
    config = head_config(
        target,
        num_layers,
        mode,
        int(used.shape[0]),
        mask_token_id,
        k_train,
        sliding_window=sliding_window,
        layer_types=layer_types,
        block_size=block_size,
        aux_layer_ids=aux_layer_ids,
        **flags,
    )
    dflash = mode == "dflash"
    emb, head = target.embedding_arrays(scaled=not dflash)
    given = {
        ("embed_tokens", "embedding"): emb,
        ("lm_head", "kernel"): np.ascontiguousarray(head[used].T),
        ("d2t",): d2t_from_ids(used).astype(np.int32),
    }
    dtype = dtype_name(getattr(target, "dtype", "float32") if dtype is None else dtype)
    arrays = init_arrays(config, seed, given)
    if init_layer is not None:
        arrays.update(target_layer_arrays(target, init_layer, arrays, config))
    return Drafter.from_arrays(config, arrays, dtype)


def head_config(
    target,
    num_layers: int,
    mode: str,
    draft_vocab_size: int,
    mask_token_id: int | None = None,
    k_train: int | None = 8,
    *,
    sliding_window: int | None = None,
    layer_types=None,
    block_size: int = 8,
    aux_layer_ids=None,
    **flags,
) -> DrafterConfig:
    """The DrafterConfig `new_drafter` gives a head of `draft_vocab_size` ids for `target` (its
    .config, .aux_layer_ids and .path only: no weight is read; `peagle_jax.plan` builds abstract
    heads from it)."""
    tc = target.config
    v = tc.vocab_size
    dflash = mode == "dflash"
    if dflash:
        flags["qk_norm"] = True
        if aux_layer_ids is None:
            aux_layer_ids = dflash_aux_layer_ids(tc.num_layers, num_layers)
        aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, tc.num_layers, "new_drafter: aux_layer_ids", count=None)
    elif aux_layer_ids is not None:
        raise ValueError("new_drafter: aux_layer_ids is a DFlash setting; P-EAGLE / EAGLE-3 heads read the target's")
    if mode in ("parallel", "dflash") and mask_token_id is None:
        mask_token_id = tc.pad_token_id if tc.pad_token_id is not None else v - 1
    if mode == "chain":
        mask_token_id = None
    rope = flags.pop("rope", tc.rope)
    known = {"norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "attention_bias", "qk_norm"}
    known |= {"sliding_window_non_causal"}  # DFlash only (DrafterConfig checks the mode)
    bad = sorted(set(flags) - known)
    if bad:
        raise TypeError(f"new_drafter: unknown flags {bad} (known: {sorted(known)})")
    default_type = "sliding_attention" if sliding_window is not None else "full_attention"
    return DrafterConfig(
        hidden_size=tc.hidden_size,
        target_hidden_size=tc.hidden_size,
        num_layers=num_layers,
        num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim,
        intermediate_size=tc.intermediate_size,
        vocab_size=v,
        draft_vocab_size=draft_vocab_size,
        rms_norm_eps=tc.rms_norm_eps,
        rope=rope,
        max_position_embeddings=tc.max_position_embeddings,
        mode=mode,
        mask_token_id=mask_token_id,
        aux_layer_ids=tuple(aux_layer_ids) if dflash else tuple(target.aux_layer_ids),
        k_train=block_size - 1 if dflash else k_train,
        target_model_type=tc.model_type,
        verifier=None if getattr(target, "path", None) is None else repo_id_of(target.path) or str(target.path),
        layer_types=tuple(layer_types) if layer_types is not None else (default_type,) * num_layers,
        sliding_window=sliding_window,
        block_size=block_size if dflash else None,
        dummy_target=getattr(target, "load_format", "auto") == "dummy",
        **{k: bool(val) for k, val in flags.items()},
    )
