"""Regenerate the golden P-EAGLE vectors (the layout of tests/golden/peagle-tiny) from speculators.

    python tests/golden/regenerate.py OUT_DIR [--seed N]

writes OUT_DIR/peagle-tiny/ with new random weights and the layout, file names, array names, shapes,
dtypes and semantics of the committed set (tests/golden/README.md), all in float32 on the CPU:

- `target/`: a random transformers `LlamaForCausalLM` (V 256, H 64, 8 layers, 4 heads, 2 KV heads),
  saved with `save_pretrained` (safetensors, config.json, generation_config.json).
- `drafter-speculators/`: a random 2-layer speculators 0.9.0 `PEagleDraftModel` (draft vocabulary
  128 of 256 with `d2t`/`t2d`, mask token 255, aux layers [2, 4, 5], verifier `../target`), saved
  with `save_pretrained`; its teacher (`verifier_lm_head`, `verifier_norm`) is loaded by
  speculators' `load_verifier_weights` from the saved target, so the loss is the saved target's.
- `train_rows.npz`: one 16-token sequence (the first 3 positions unsupervised), the target's aux
  hidden states (the residual stream entering layers 2, 4, 5 = `output_hidden_states[i]`) and its
  last hidden state before the final norm; 32 COD rows of depths 0..3 from speculators'
  `generate_cod_sample_indices`; the attention mask, draft logits and forward-KL loss that
  `PEagleDraftModel.forward` (eager attention, eager `kl_div_loss`) computes on those rows. The
  forward reads row r's inputs at ref = anchor + depth (`input_ids[ref]` and `aux_hidden[ref]` at
  depth 0, the mask token and `mask_hidden` deeper, position id ref): the arrays are fed unshifted.
- `propose.npz`: vLLM's single pass after prefilling a 12-token prompt (slots `prompt[1:] + [bonus]`
  with `aux_hidden[0..11]`, then 4 mask slots), run through the same forward as one COD chain.
- `summary.json`: aux layers, mask token, k, loss and [bonus, *drafts].
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import numpy as np
import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses.eager import kl_div_loss
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
from speculators.models.peagle import core as peagle_core
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig, LlamaForCausalLM

ARCH = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TARGET_LAYERS, DRAFT_LAYERS = 8, 2
AUX_LAYERS = [2, 4, 5]  # (2, L // 2, L - 3), vLLM's default for L = 8
DRAFT_VOCAB, MASK_ID, K = 128, 255, 5
SEQ_LEN, UNSUPERVISED, NUM_DEPTHS = 16, 3, 4  # 13 supervised positions -> rows per depth 16, 8, 5, 3
PROMPT_LEN = 12
TARGET_SCALE, DRAFT_SCALE = 0.05, 0.1  # weight std; norm weights are 1 + scale * N(0, 1)


def randomize(model: torch.nn.Module, scale: float, skip: tuple[str, ...] = ()) -> None:
    """Draw every parameter not named in `skip` from the global torch RNG: norm weights around 1,
    the rest N(0, scale^2), so that the logits vary more than the default init lets them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(skip):
                continue
            noise = torch.randn(p.shape)
            p.copy_(1 + scale * noise if "norm" in name else scale * noise)


def build_target(folder: Path) -> LlamaForCausalLM:
    config = LlamaConfig(
        **ARCH, num_hidden_layers=TARGET_LAYERS, bos_token_id=None, eos_token_id=None, attn_implementation="eager"
    )
    target = LlamaForCausalLM(config).eval()
    randomize(target, TARGET_SCALE)
    target.save_pretrained(folder)
    return target


def target_features(target: LlamaForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(aux hidden [T, 3H], last hidden before the final norm [T, H], logits [T, V]) for ids [T]."""
    captured = []
    hook = target.model.norm.register_forward_pre_hook(lambda _module, args: captured.append(args[0]))
    try:
        out = target(ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    aux = torch.cat([out.hidden_states[i] for i in AUX_LAYERS], dim=-1)
    return aux[0], captured[0][0], out.logits[0]


def drafter_config() -> PEagleSpeculatorConfig:
    layer = LlamaConfig(**ARCH, num_hidden_layers=DRAFT_LAYERS)
    layer._attn_implementation = "eager"  # simple_flex_attention is speculators' default; eager is the reference
    verifier = VerifierConfig(name_or_path="../target", architectures=["LlamaForCausalLM"])
    return PEagleSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=DRAFT_VOCAB,
        eagle_aux_hidden_state_layer_ids=AUX_LAYERS,
        mask_token_id=MASK_ID,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=K)],
            default_proposal_method="greedy",
            verifier=verifier,
        ),
    )


def save_drafter(drafter: PEagleDraftModel, folder: Path) -> None:
    """`save_pretrained`, normalised to the committed set's files and keys (written with transformers
    5.19): newer transformers (5.24 here) also save speculators' config class as custom code
    (config.py and `auto_map`; speculators sets `_auto_class` to "", not None) and a nested
    `transformers_version`."""
    drafter.save_pretrained(folder)
    (folder / "config.py").unlink(missing_ok=True)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop("auto_map", None)
    config["transformer_layer_config"].pop("transformers_version", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def build_drafter(folder: Path) -> PEagleDraftModel:
    """A random head with a random draft vocabulary, saved to `folder` beside `../target`, then given
    its teacher from the saved target by speculators' own loader."""
    drafter = PEagleDraftModel(drafter_config()).eval()
    randomize(drafter, DRAFT_SCALE, skip=("verifier_", "mask_hidden"))  # mask_hidden: randn at init
    draft_ids = torch.randperm(ARCH["vocab_size"])[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(ARCH["vocab_size"], dtype=torch.bool)
    t2d[draft_ids] = True
    drafter.load_vocab_mappings(t2d, draft_ids - torch.arange(DRAFT_VOCAB))
    save_drafter(drafter, folder)
    with contextlib.chdir(folder):  # verifier.name_or_path is relative to the drafter folder
        drafter.load_verifier_weights()
    return drafter


@contextlib.contextmanager
def pinned_rows(anchor: torch.Tensor, depth: torch.Tensor):
    """Make `PEagleDraftModel.forward` use these COD rows instead of sampling its own."""
    sampler = peagle_core.generate_cod_sample_indices
    peagle_core.generate_cod_sample_indices = lambda **_: (anchor, depth)
    try:
        yield
    finally:
        peagle_core.generate_cod_sample_indices = sampler


def run_rows(drafter, anchor, depth, ids, aux, last_hidden, loss_mask, num_depths):
    """speculators' training forward on the given COD rows: (draft logits [N, Vd], the attention
    mask it built [N, N] (True = may attend), the loss)."""
    seen = {}

    def keep_mask(_module, _args, kwargs):
        seen["mask"] = kwargs["attention_mask"]

    def keep_logits(_module, _args, out):
        seen["logits"] = out

    hooks = [
        drafter.layers[0].register_forward_pre_hook(keep_mask, with_kwargs=True),
        drafter.lm_head.register_forward_hook(keep_logits),
    ]
    try:
        with pinned_rows(anchor, depth):
            _, loss, _ = drafter(
                hidden_states=aux[None],
                input_ids=ids[None],
                document_ids=torch.zeros(1, ids.shape[0], dtype=torch.long),
                loss_mask=loss_mask[None],
                verifier_last_hidden_states=last_hidden[None],
                num_depths=num_depths,
                loss_config={"kl_div": (kl_div_loss, 1.0)},  # eager: the default is a Triton kernel
            )
    finally:
        for hook in hooks:
            hook.remove()
    return seen["logits"][0], seen["mask"][0, 0] == 0, loss


def train_rows(target: LlamaForCausalLM, drafter: PEagleDraftModel) -> dict[str, np.ndarray]:
    ids = torch.randint(0, MASK_ID, (SEQ_LEN,))
    aux, prenorm, _ = target_features(target, ids)
    loss_mask = (torch.arange(SEQ_LEN) >= UNSUPERVISED).float()
    anchor, depth = peagle_core.generate_cod_sample_indices(
        seq_length=SEQ_LEN, loss_mask=loss_mask[None], num_depths=NUM_DEPTHS
    )
    logits, mask, loss = run_rows(drafter, anchor, depth, ids, aux, prenorm, loss_mask, NUM_DEPTHS)
    arrays = dict(
        input_ids=ids,
        aux_hidden=aux,
        prenorm_last_hidden=prenorm,
        loss_mask=loss_mask,
        anchor=anchor,
        depth=depth,
        mask=mask,
        draft_logits=logits,
        loss=loss,
    )
    return {k: v.numpy() for k, v in arrays.items()}


def propose(target: LlamaForCausalLM, drafter: PEagleDraftModel) -> dict[str, np.ndarray]:
    """vLLM's single pass as one COD chain: slots 0..11 are depth-0 rows (token prompt[i + 1], or the
    bonus at 11, with aux[i]), slots 12..15 the chain of anchor 11 at depths 1..4 (mask token and
    mask_hidden); positions = slot index and the COD rule is causal over the 16 slots."""
    prompt = torch.randint(0, MASK_ID, (PROMPT_LEN,))
    aux, _, target_logits = target_features(target, prompt)
    bonus = target_logits[-1].argmax()
    slots = PROMPT_LEN + K - 1
    ids = torch.cat([prompt[1:], bonus[None], torch.full((K - 1,), MASK_ID)])
    anchor = torch.cat([torch.arange(PROMPT_LEN), torch.full((K - 1,), PROMPT_LEN - 1)])
    depth = torch.cat([torch.zeros(PROMPT_LEN, dtype=torch.long), torch.arange(1, K)])
    padded = torch.cat([aux, torch.zeros(K - 1, aux.shape[1])])  # the mask slots read mask_hidden
    logits, mask, _ = run_rows(
        drafter, anchor, depth, ids, padded, torch.zeros(slots, ARCH["hidden_size"]), torch.zeros(slots), K
    )
    assert torch.equal(mask, torch.ones(slots, slots, dtype=torch.bool).tril()), "the single pass is causal"
    slot_logits = logits[PROMPT_LEN - 1 :]
    best = slot_logits.argmax(-1)
    drafts = best + drafter.d2t[best]
    return {
        "prompt": prompt.numpy(),
        "bonus": bonus.numpy(),
        "drafts": drafts.numpy(),
        "slot_logits": slot_logits.numpy(),
        "aux_hidden": aux.numpy(),
    }


def regenerate(out: Path, seed: int) -> Path:
    folder = out / "peagle-tiny"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        target = build_target(folder / "target")
        drafter = build_drafter(folder / "drafter-speculators")
        rows = train_rows(target, drafter)
        prop = propose(target, drafter)
    np.savez(folder / "train_rows.npz", **rows)
    np.savez(folder / "propose.npz", **prop)
    summary = {
        "aux_layer_ids": AUX_LAYERS,
        "mask_token_id": MASK_ID,
        "k": K,
        "loss": float(rows["loss"]),
        "propose": [int(prop["bonus"]), *prop["drafts"].tolist()],
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    return folder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path, help="the set is written to OUT_DIR/peagle-tiny")
    ap.add_argument("--seed", type=int, default=0, help="torch seed for the weights, tokens and COD rows")
    a = ap.parse_args(argv)
    folder = regenerate(a.out_dir, a.seed)
    summary = json.loads((folder / "summary.json").read_text())
    print(f"wrote {folder}: loss {summary['loss']:.7f}, bonus + drafts {summary['propose']}")


if __name__ == "__main__":
    main()
