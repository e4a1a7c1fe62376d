"""bench.speculators_recipe on the tiny Llama target (`train.tiny`), with features from our
trainer's feature function (`train.step.features`): speculators' P-EAGLE recipe trains (finite
losses; a repeated example is fitted), its saved head loads with `peagle_jax.load_drafter` with our
draft vocabulary, lm_head frozen at the target's rows, embed_tokens trained; the batch is their
shift of the raw arrays; and their teacher on our final-norm states is the target's logits. Their
DFlash recipe trains with its own defaults and unshifted batches, and its head loads too."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

pytestmark = [pytest.mark.speculators, pytest.mark.filterwarnings("ignore::FutureWarning")]

torch = pytest.importorskip("torch")
pytest.importorskip("speculators", exc_type=ImportError)

LENGTH, PROMPT, N_DRAFT = 48, 12, 40  # one length: our feature function compiles once


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matrices: a second thread only adds contention on shared cores (a step ~5x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def recipe():
    return importlib.import_module("bench.speculators_recipe")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, target, examples, features, draft_ids) of the tiny Llama target."""
    import jax
    import jax.numpy as jnp

    import peagle_jax as pj
    from train.step import features as target_features
    from train.tiny import build_tiny_target

    folder = build_tiny_target(tmp_path_factory.mktemp("recipe") / "tiny")
    target = pj.load_target(folder, dtype="float32")
    vocab = target.config.vocab_size
    rng = np.random.default_rng(0)
    examples = []
    for _ in range(3):
        ids = rng.integers(4, vocab, LENGTH).astype(np.int32)
        mask = np.arange(LENGTH) >= PROMPT  # the answer, as train.data.Example.mask marks it
        examples.append((ids, mask))
    run = jax.jit(lambda t, p: target_features(target.graphdef, target.state, t, p, tuple(target.aux_layer_ids)))
    cache = {}

    def features(i):
        if i not in cache:
            ids = jnp.asarray(examples[i][0])[None]
            aux, y = run(ids, jnp.arange(LENGTH, dtype=jnp.int32)[None])
            cache[i] = (np.asarray(aux[0], np.float32), np.asarray(y[0], np.float32))
        return cache[i]

    draft_ids = np.sort(rng.choice(vocab, N_DRAFT, replace=False))
    return folder, target, examples, features, draft_ids


def test_trains_and_saves_a_head_our_importer_loads(recipe, tiny, tmp_path):
    import peagle_jax as pj
    from peagle_jax.models.eagle import draft_vocab_ids

    folder, target, examples, features, draft_ids = tiny
    out = tmp_path / "head"
    res = recipe.train_speculators(
        folder, examples, features, [0, 1, 2, 0, 1], draft_ids, out, aux_layer_ids=target.aux_layer_ids
    )
    assert len(res["losses"]) == 5 and np.all(np.isfinite(res["losses"]))
    assert res["wall_s"] > 0 and len(res["acc"][0]) == 8
    cfg = res["config"]
    assert cfg["embed_requires_grad"] and cfg["frozen"] == ["lm_head.weight", "verifier_lm_head.weight"]
    assert [g["optimizer"] for g in cfg["optimizer_groups"]] == ["Muon", "AdamW"]
    assert cfg["scheduler"] == {"type": "linear", "warmup_steps": 0, "total_steps": 5}

    head = pj.load_drafter(out)
    np.testing.assert_array_equal(draft_vocab_ids(head.d2t), draft_ids)
    assert head.config.mode == "parallel" and head.config.k_train == 8
    assert head.config.aux_layer_ids == tuple(target.aux_layer_ids)
    assert head.config.mask_token_id == cfg["mask_token_id"]
    arrays = head.arrays()
    emb, lm = (torch.as_tensor(a).bfloat16().float().numpy() for a in target.embedding_arrays())  # saved in bf16
    np.testing.assert_array_equal(np.asarray(arrays[("lm_head", "kernel")], np.float32).T, lm[draft_ids])
    trained = np.asarray(arrays[("embed_tokens", "embedding")], np.float32)
    assert trained.shape == emb.shape and np.mean(trained != emb) > 0.5  # trained (their P-EAGLE default)


def test_a_repeated_example_is_fitted(recipe, tiny, tmp_path):
    folder, target, examples, features, draft_ids = tiny
    res = recipe.train_speculators(
        folder, examples, features, [0] * 15, draft_ids, tmp_path / "head", aux_layer_ids=target.aux_layer_ids
    )
    losses = np.asarray(res["losses"])
    assert np.all(np.isfinite(losses))
    assert losses[-3:].mean() < 0.9 * losses[:3].mean() and losses[-1] < losses[0], losses


def test_overrides_go_through_their_config(recipe, tiny):
    folder, target, _, _, draft_ids = tiny
    over = {"optimizer": "adamw", "embed_requires_grad": False, "fc_norm": True}
    model, args, _ = recipe.build_reference(folder, draft_ids, overrides=over, aux_layer_ids=target.aux_layer_ids)
    assert args.optimizer == "adamw" and model.fc_norm is not None
    assert not model.config.embed_requires_grad and not model.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="unknown speculators recipe fields"):
        recipe.resolve_config(folder, overrides={"no_such_field": 1})
    summary = recipe.recipe_summary(over)
    assert summary["embed_tokens trainable"] is False and summary["optimizer_groups"][0]["optimizer"] == "AdamW"


def test_the_batch_is_their_shift_of_the_raw_arrays(recipe, tiny):
    folder, target, examples, features, draft_ids = tiny
    model, args, _ = recipe.build_reference(folder, draft_ids, aux_layer_ids=target.aux_layer_ids)
    data = recipe._dataset(examples, features, args.total_seq_len, torch.bfloat16)
    batch = recipe._batch(data[0], args, model, torch.bfloat16)
    (ids, mask), (aux, y) = examples[0], features(0)
    bf16 = lambda a: torch.tensor(a).bfloat16()
    # row t: token t+1, aux state at t, teacher state at t+1, loss mask of token t+1
    assert torch.equal(batch["input_ids"][0], torch.as_tensor(ids[1:]).long())
    assert torch.equal(batch["hidden_states"][0], bf16(aux[:-1]))
    assert torch.equal(batch["verifier_last_hidden_states"][0], bf16(y[1:]))
    assert torch.equal(batch["loss_mask"][0], torch.as_tensor(mask[1:]).long())
    assert torch.equal(batch["document_ids"][0], torch.zeros(LENGTH - 1, dtype=torch.long))


def test_their_dflash_recipe_trains_and_saves_a_head_our_importer_loads(recipe, tiny, tmp_path):
    """`--speculator-type dflash` as their CLI resolves it (5 layers, block 16, CE, D-PACE),
    embed_tokens and lm_head frozen; max_anchors at the sequence length takes every anchor, as
    their 512 does, without the padded blocks' cost."""
    import peagle_jax as pj
    from peagle_jax.models.eagle import draft_vocab_ids

    folder, target, examples, features, draft_ids = tiny
    out = tmp_path / "dflash"
    over = {"max_anchors": LENGTH}
    res = recipe.train_speculators(
        folder, examples, features, [0, 1, 2], draft_ids, out, kind="dflash", overrides=over,
        aux_layer_ids=target.aux_layer_ids,
    )  # fmt: skip
    assert len(res["losses"]) == 3 and np.all(np.isfinite(res["losses"]))
    assert len(res["acc"][0]) == 15  # block slots 1..15 (slot 0 is the anchor's own token)
    cfg = res["config"]
    resolved = {k: cfg["train_config"][k] for k in ("num_layers", "block_size", "per_position_loss_weight")}
    assert resolved == {"num_layers": 5, "block_size": 16, "per_position_loss_weight": "dpace"}
    assert cfg["train_call_kwargs"]["loss_config"] == ["ce"] and cfg["train_call_kwargs"]["max_anchors"] == LENGTH
    assert cfg["frozen"] == ["embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"]
    head = pj.load_drafter(out, target=target)
    assert (head.config.mode, head.config.block_size, head.config.num_layers) == ("dflash", 16, 5)
    assert head.config.aux_layer_ids == tuple(target.aux_layer_ids)
    np.testing.assert_array_equal(draft_vocab_ids(head.d2t), draft_ids)


def test_their_dflash_batch_is_the_raw_arrays(recipe, tiny):
    """Their CLI gives dflash no preprocess: row t is token t, its aux and teacher states at t."""
    folder, target, examples, features, draft_ids = tiny
    model, args, _ = recipe.build_reference(folder, draft_ids, kind="dflash", aux_layer_ids=target.aux_layer_ids)
    data = recipe._dataset(examples, features, args.total_seq_len, torch.bfloat16)
    batch = recipe._batch(data[1], args, model, torch.bfloat16)
    (ids, mask), (aux, y) = examples[1], features(1)
    bf16 = lambda a: torch.tensor(a).bfloat16()
    assert torch.equal(batch["input_ids"][0], torch.as_tensor(ids).long())
    assert torch.equal(batch["hidden_states"][0], bf16(aux))
    assert torch.equal(batch["verifier_last_hidden_states"][0], bf16(y))
    assert torch.equal(batch["loss_mask"][0], torch.as_tensor(mask).long())


def test_their_teacher_on_our_final_norm_states_is_the_target(recipe, tiny):
    """Trap 1: with verifier_norm the identity, their teacher on the final-norm states our
    feature function gives is the target's own logits (transformers) at the draft ids."""
    from transformers import AutoModelForCausalLM

    folder, target, examples, features, draft_ids = tiny
    model, _, _ = recipe.build_reference(folder, draft_ids, aux_layer_ids=target.aux_layer_ids)
    assert isinstance(model.verifier_norm, torch.nn.Identity)
    theirs = recipe.teacher_logits(model, torch.as_tensor(features(0)[1])).numpy()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.as_tensor(examples[0][0]).long()[None]).logits[0][:, draft_ids].numpy()
    assert np.abs(theirs - want).max() <= 1e-4
