"""The target model handle: load a Hugging Face folder, run it functionally, generate greedily.

```python
target = pj.load_target(path, dtype="bfloat16", aux_layer_ids=None)
out = target.forward(input_ids)            # logits [B,T,V] f32, aux_hidden [B,T,3H], hidden [B,T,H]
cache = target.init_cache(batch, max_len)  # per layer (k, v) [B, S, Hkv, D] in the target dtype
out = target.apply(tokens, positions, cache, logits_at=None)  # jitted, cache donated
```
`target_apply` is the pure form for use inside `jax.jit` (the speculative engine): one forward
over any number of tokens (prefill, a K+1-token verification, one decode step). Generation
(greedy or speculative) is `peagle_jax.engine.generation`.

Positions convention: the cache index of a token is its position; position -1 marks a
padding slot (its K/V is not written, its outputs are meaningless). Rows of a batch may be
at different lengths.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from peagle_jax.config.fields import GENERATION_FIELDS, ConfigError, check_fields, read_json
from peagle_jax.config.target_config import TargetConfig, validate_aux_layer_ids
from peagle_jax.engine import cache as kv
from peagle_jax.formats import refuse_head
from peagle_jax.models.decoder import DecoderOutput, embedding_arrays
from peagle_jax.models.presets import PRESETS, preset_fields
from peagle_jax.models.registry import target_config
from peagle_jax.runtime.command_line import one_line
from peagle_jax.runtime.sharding import shard_state
from peagle_jax.sources.dummy import LOAD_FORMATS, dummy_params
from peagle_jax.sources.hub import resolve
from peagle_jax.sources.weights import TOKENIZER_FILES, WeightsError, export_target, load_params

__all__ = [
    "Target",
    "folder_config",
    "load_target",
    "target_apply",
    "target_source",
    "DecoderOutput",
]

# the JSON files transformers reads to build a tokenizer (a corrupt one is named on failure)
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


# ---------------------------------------------------------------------------------------
# pure functions
def target_apply(
    graphdef,
    state,
    tokens: jax.Array,
    positions: jax.Array,
    cache: tuple | None = None,
    *,
    aux_layer_ids: tuple[int, ...] = (),
    logits_at: jax.Array | None = None,
    compute_logits: bool = True,
) -> DecoderOutput:
    """One forward of the target over tokens [B, T] at positions [B, T] (-1 = padding).

    `cache` (per layer (k, v) [B, S, Hkv, D]) is written at the positions and read whole;
    None attends within this call only. `logits_at` [B, n] selects the rows that get
    logits. Returns DecoderOutput(logits f32, aux_hidden [B, T, 3H], hidden [B, T, H], cache).
    Pure: call it inside `jax.jit` with `graphdef` static.
    """
    model = nnx.merge(graphdef, state)
    return model(
        tokens,
        positions,
        cache,
        aux_layer_ids=tuple(aux_layer_ids),
        logits_at=logits_at,
        compute_logits=compute_logits,
    )


_apply_jit = jax.jit(
    target_apply,
    static_argnums=(0,),
    static_argnames=("aux_layer_ids", "compute_logits"),
    donate_argnames=("cache",),
)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("aux_layer_ids",))
def _forward_jit(graphdef, state, tokens, *, aux_layer_ids):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return target_apply(graphdef, state, tokens, positions, None, aux_layer_ids=aux_layer_ids)


# ---------------------------------------------------------------------------------------
# the handle
class Target:
    """A loaded target model: config, NNX graphdef + params state, jitted entry points."""

    def __init__(
        self,
        config: TargetConfig,
        graphdef,
        state,
        *,
        aux_layer_ids: Sequence[int] | None = None,
        path: str | os.PathLike | None = None,
    ):
        self.config = config
        self.graphdef = graphdef
        self.state = state
        self.aux_layer_ids = validate_aux_layer_ids(
            config.default_aux_layer_ids() if aux_layer_ids is None else aux_layer_ids, config.num_layers
        )
        self.path = None if path is None else Path(path)
        leaves = jax.tree.leaves(state)
        self.dtype = leaves[0].dtype if leaves else jnp.dtype(jnp.float32)
        self._tokenizer = None
        self._tokenizer_loaded = False
        self.mesh = None  # set by load_target(mesh=...)
        self.load_format = "auto"  # "dummy": random weights (load_target(load_format="dummy"))

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Target({c.model_type}, layers={c.num_layers}, hidden={c.hidden_size}, vocab={c.vocab_size}, "
            f"dtype={self.dtype}, aux_layer_ids={self.aux_layer_ids}, path={str(self.path)!r}"
            + (", load_format='dummy')" if self.load_format == "dummy" else ")")
        )

    @property
    def model(self):
        """The NNX Decoder (merged on demand; the state is shared, not copied)."""
        return nnx.merge(self.graphdef, self.state)

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state))

    @property
    def param_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.state))

    @property
    def tokenizer(self):
        """transformers AutoTokenizer of the folder, or None when it has no tokenizer files
        (`load_tokenizer`: ConfigError naming the file when one is corrupt)."""
        if not self._tokenizer_loaded:
            self._tokenizer = None if self.path is None else load_tokenizer(self.path)
            self._tokenizer_loaded = True
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        """Another tokenizer than the folder's (a dummy target without one: synthetic token ids)."""
        self._tokenizer, self._tokenizer_loaded = tokenizer, True

    def _check_tokens(self, tokens, name="input_ids") -> np.ndarray | jax.Array:
        if isinstance(tokens, jax.Array):
            arr = tokens
        else:
            arr = np.asarray(tokens)
        if arr.ndim != 2 or not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name}: expected an int array [batch, tokens], got shape {arr.shape} {arr.dtype}")
        if arr.shape[0] == 0 or arr.shape[1] == 0:
            raise ValueError(f"{name}: no tokens (shape {arr.shape}); give at least one token per row")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.config.vocab_size):
            raise ValueError(f"{name}: token ids must lie in [0, {self.config.vocab_size})")
        return arr

    def forward(self, input_ids) -> DecoderOutput:
        """Full forward without a cache: int [B, T] -> logits [B, T, V] (f32), aux_hidden
        [B, T, 3H], hidden [B, T, H] (cache None). Jitted; recompiles per shape."""
        tokens = jnp.asarray(self._check_tokens(input_ids), jnp.int32)
        return _forward_jit(self.graphdef, self.state, tokens, aux_layer_ids=self.aux_layer_ids)

    def apply(self, tokens, positions, cache=None, *, logits_at=None, compute_logits=True) -> DecoderOutput:
        """`target_apply` jitted with this target's aux ids; the cache buffers are donated.

        Raises ValueError when a position does not fit the cache (it would be dropped)."""
        if cache is not None:
            try:
                concrete = np.asarray(positions)
            except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
                concrete = None  # traced (called inside jit): not checked
            size = cache[0][0].shape[1]
            top = int(concrete.max()) if concrete is not None and concrete.size else -1
            if top >= size:
                raise ValueError(f"positions: position {top} does not fit a KV cache of {size} slots")
        return _apply_jit(
            self.graphdef,
            self.state,
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(positions, jnp.int32),
            cache,
            aux_layer_ids=self.aux_layer_ids,
            logits_at=None if logits_at is None else jnp.asarray(logits_at, jnp.int32),
            compute_logits=compute_logits,
        )

    def init_cache(self, batch: int, max_len: int, dtype=None) -> tuple:
        """Empty KV cache: per layer (k, v), each [batch, max_len, Hkv, D], in the target dtype."""
        return kv.init(self.config, batch, max_len, self.dtype if dtype is None else dtype)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a generation: config.json's `eos_token_id` merged with
        generation_config.json's, as Hugging Face `generate` does (Gemma 3's chat turns end with
        `<end_of_turn>`, which only the generation config names)."""
        ids = list(self.config.eos_token_id)
        if self.path is not None:
            ids += generation_eos_ids(self.path, self.config.vocab_size)
        return tuple(sorted({int(i) for i in ids}))

    def embedding_arrays(self, scaled: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(input embedding [V, H] as the first layer sees it, lm_head weight [V, H]), float32
        host copies: what a new drafter head starts from. `scaled=False`: the stored embedding
        rows, without Gemma's sqrt(H) (a DFlash head's embedding)."""
        return embedding_arrays(self.graphdef, self.state, scaled)

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Exports a Hugging Face folder (config.json + model.safetensors, plus the source
        folder's tokenizer files when it has them)."""
        extra = []
        if self.path is not None:
            extra = [self.path / f for f in TOKENIZER_FILES if (self.path / f).exists()]
        return export_target(self.config, self.state, path, overwrite=overwrite, extra_files=extra)


def generation_eos_ids(folder: Path, vocab_size: int) -> list[int]:
    """The `eos_token_id` of the folder's generation_config.json ([] without one), its token
    ids checked against `config.GENERATION_FIELDS`: ConfigError naming the file and the key."""
    gen = Path(folder) / "generation_config.json"
    if not gen.is_file():
        return []
    raw = read_json(gen)
    check_fields(raw, GENERATION_FIELDS, str(gen), bounds={"vocab_size": vocab_size})
    value = raw.get("eos_token_id")
    return [value] if isinstance(value, int) else list(value or [])


def load_tokenizer(folder: str | os.PathLike):
    """transformers' AutoTokenizer of `folder`, or None when it has neither tokenizer.json nor
    tokenizer.model. A tokenizer transformers cannot build is a ConfigError of one line naming
    the file at fault (`_tokenizer_problem`), not the library's bare JSON or Rust error."""
    folder = Path(folder)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:  # noqa: BLE001 - transformers and tokenizers raise many kinds
        raise ConfigError(_tokenizer_problem(folder, err)) from None


def _tokenizer_problem(folder: Path, err: Exception) -> str:
    """Why the tokenizer of `folder` failed to load: the first JSON file that does not parse,
    else a tokenizer.json the tokenizers library rejects, else transformers' own error."""
    for name in TOKENIZER_JSON_FILES:
        path = folder / name
        if path.is_file():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as bad:
                return f"{path}: unreadable tokenizer file, invalid JSON ({one_line(bad)})"
    path = folder / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(path))
        except Exception as bad:  # noqa: BLE001 - the Rust library raises a plain Exception
            return f"{path}: not a tokenizer the tokenizers library can read ({one_line(bad)})"
    culprit = path if path.is_file() else folder / "tokenizer.model"
    return f"{culprit}: transformers cannot build a tokenizer from it ({type(err).__name__}: {one_line(err)})"


def default_dtype() -> str:
    """float32 on CPU (bf16 matmuls are emulated and slow there), bfloat16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def folder_config(folder: str | os.PathLike) -> TargetConfig:
    """The TargetConfig of a target folder's config.json; ConfigError naming a drafter head's
    folder as such (a head given where a target is expected: `formats.head_kind`)."""
    refuse_head(folder)
    return target_config(folder)


def target_source(spec: str | os.PathLike, load_format: str = "auto") -> tuple[TargetConfig, Path | None]:
    """(config, folder) of a target spec, no weight read: a folder or a Hub id (its config.json;
    with `load_format` "dummy" only config.json and the tokenizer files are fetched), or with
    "dummy" also a preset name of `peagle_jax.models.presets` (folder None). ConfigError of one
    line for a spec that is none of these."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r}: expected one of {', '.join(LOAD_FORMATS)}")
    dummy = load_format == "dummy"
    fields = preset_fields(spec) if dummy and not Path(spec).exists() else None
    if fields is not None:
        return target_config(fields), None
    folder = resolve(spec, "config" if dummy else "target")
    if not folder.is_dir():
        presets = f", nor a preset ({', '.join(PRESETS)})" if dummy else ""
        raise WeightsError(f"{folder}: no such folder{presets}")
    return folder_config(folder), folder


def load_target(
    path: str | os.PathLike,
    dtype: str | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    mesh=None,
    *,
    load_format: str = "auto",
    seed: int = 0,
) -> Target:
    """Loads a Hugging Face folder (config.json + safetensors) as a `Target`; `path` may be a Hub id
    ("org/name": downloaded once into the Hugging Face cache, `peagle_jax.sources.hub`; a local folder of
    that name wins).

    load_format: "auto" reads the weights; "dummy" reads none (`peagle_jax.sources.dummy`: random values
    of the right shapes and dtype made on the device from `seed`, as vLLM's `--load-format
    dummy`), and `path` may also be a preset name ("Llama-3.1-8B": `peagle_jax.models.presets`)
    or a folder with only config.json. `Target.load_format` says which.
    mesh: a (data, fsdp, tensor) `jax.sharding.Mesh` (see `peagle_jax.runtime.sharding.make_mesh`):
    the weights are placed on it by the sharding rule table (tensor parallel over `tensor`);
    the jitted entry points and the speculative engine then run sharded, unchanged.

    dtype: "bfloat16" or "float32" (params, activations and KV cache; norms and softmax run
    in f32, logits are f32); None = `default_dtype()` (float32 on CPU, bfloat16 on GPU/TPU).
    aux_layer_ids: 3 distinct layer ids, default (2, L//2, L-3).
    Raises ConfigError / WeightsError (ValueErrors naming the file and key): config.json and
    generation_config.json are checked field by field (`config.TARGET_FIELDS`) before any weight
    is read; the tokenizer is loaded on first use (`Target.tokenizer`).
    """
    cfg, folder = target_source(path, load_format)
    # fail before reading any weight
    validate_aux_layer_ids(cfg.default_aux_layer_ids() if aux_layer_ids is None else aux_layer_ids, cfg.num_layers)
    if folder is not None:
        generation_eos_ids(folder, cfg.vocab_size)
    dtype = default_dtype() if dtype is None else dtype
    if load_format == "dummy":
        graphdef, state = dummy_params(cfg, dtype, seed, mesh)
    else:
        graphdef, state = load_params(folder, cfg, dtype)
        state = state if mesh is None else shard_state(state, mesh)
    target = Target(cfg, graphdef, state, aux_layer_ids=aux_layer_ids, path=folder)
    target.mesh = mesh
    target.load_format = load_format
    return target
