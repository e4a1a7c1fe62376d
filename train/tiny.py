"""The tiny preset's target: a random tiny Llama with a word-level tokenizer, built offline.

Vocabulary (64): <pad> <eos> <bos> <unk>, the plain-format words User / Assistant / System / ':',
then words w0..w55 (what `train.data.synthetic_conversations` writes). The weights are drawn
with a large initializer range so the target's next-token distribution is peaked and depends
on the context (a 0.02 init gives a nearly uniform teacher with nothing to learn).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["build_tiny_target", "TINY_WORDS"]

TINY_WORDS = 56
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "User", "Assistant", "System", ":"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(TINY_WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def build_tiny_target(folder: Path, seed: int = 0) -> Path:
    """A Hugging Face folder (config, safetensors, tokenizer) at `folder` (rebuilt only when
    missing), written like every other folder of the project (`peagle_jax.runtime.folders.atomic_folder`:
    a temporary sibling renamed into place, files with the umask's ordinary modes)."""
    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from peagle_jax.runtime.folders import atomic_folder

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(SPECIALS) + TINY_WORDS,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.15,
        rms_norm_eps=1e-6,
    )
    model = LlamaForCausalLM(cfg).eval()
    with atomic_folder(folder) as tmp:  # safetensors' writer leaves model.safetensors 0600
        model.save_pretrained(tmp)
        tokenizer().save_pretrained(tmp)
        meta = {"built_by": "train.tiny", "seed": seed}
        (tmp / "tiny_target.json").write_text(json.dumps(meta))
    return folder
