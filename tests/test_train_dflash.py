"""DFlash training (`--model.mode dflash`, train/blocks.py): the loss equals speculators 0.9.0's
`DFlashDraftModel.forward` (eager KL, CE and their weighted mix, pinned anchors, the same verifier states, norm and
lm_head), the anchors follow speculators' rule per document and are seeded per (seed, step), and
`python -m train --preset tiny --model.mode dflash` learns, exports, loads, is scored by the
held-out acceptance and resumes exactly."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.blocks import BlockBatch, anchor_candidates, block_loss_and_metrics, block_stats, make_block_batch
from train.data import Example
from train.flags import parse_args
from train.loop import run
from train.spec import LossSpec
from train.step import split_params
from train.trainer import Hook

B = 8


# ---------------------------------------------------------------------------------------
# the loss against speculators
def speculators_pieces():
    """(test_dflash_parity's builders, torch, eager losses, dflash core): skips without speculators."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("speculators", exc_type=ImportError)
    parity = pytest.importorskip("test_dflash_parity")
    from speculators.losses import eager
    from speculators.models.dflash import core

    return parity, torch, eager, core


def speculators_loss(model, torch, core, loss_config, aux, ids, mask, hidden, anchors, valid, monkeypatch, **kw):
    """speculators' DFlash loss and metrics on one sequence with our anchors (`kw`: more of its
    forward's keywords, e.g. per_position_loss_weight)."""
    n = len(anchors)
    monkeypatch.setattr(
        core, "select_anchors", lambda *a, **k: (torch.as_tensor(anchors), torch.as_tensor(valid, dtype=torch.bool))
    )
    with torch.no_grad():
        _, loss, metrics = model(
            hidden_states=torch.as_tensor(aux)[None],
            input_ids=torch.as_tensor(ids)[None],
            loss_mask=torch.as_tensor(mask, dtype=torch.float32)[None],
            verifier_last_hidden_states=torch.as_tensor(hidden)[None],
            document_ids=torch.zeros(1, len(ids), dtype=torch.long),
            max_anchors=n,
            loss_config=loss_config,
            **kw,
        )
    return float(loss), {k: float(v) for k, v in metrics.items()}


def block_batch(ids, mask, anchors, valid) -> tuple[BlockBatch, dict]:
    """The BlockBatch of one sequence (one document) with its anchors, and the loss's arrays of it."""
    length = len(ids)
    batch = BlockBatch(
        np.asarray(ids, np.int32)[None],
        np.arange(length, dtype=np.int32)[None],
        np.asarray(mask, bool)[None],
        np.zeros((1, length), np.int32),
        np.asarray(anchors, np.int32)[None],
        np.asarray(valid, bool)[None],
        length,
    )
    return batch, {k: jnp.asarray(v) for k, v in dataclasses.asdict(batch).items() if k != "n_tokens"}


def our_loss(drafter, aux, y, head_w, ids, mask, anchors, valid, ce_weight: float, attention: str = "dense"):
    parts, params, frozen = split_params(drafter, True, True)
    batch, arrays = block_batch(ids, mask, anchors, valid)
    spec = LossSpec(mode="dflash", dflash_gamma=4.0, ce_weight=ce_weight, softcap=None, attention=attention)
    loss, m = jax.jit(functools.partial(block_loss_and_metrics, parts, spec=spec))(
        params, frozen, aux[None], y[None], head_w, arrays
    )
    return float(loss), block_stats(m, batch)


@pytest.mark.speculators
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    "case,ce_weight", [("tiny", 0.0), ("tiny", 1.0), ("tiny-Vd<V", 0.0), ("tiny-Vd<V", 1.0), ("tiny-Vd<V", 0.3),
                       ("gemma-shaped", 0.0)]
)  # fmt: skip
def test_dflash_loss_equals_speculators(case, ce_weight, monkeypatch):
    """ce_weight 0: their kl_div; 1: their ce; 0.3: their weighted combination {kl_div: 0.7, ce: 0.3}."""
    parity, torch, eager, core = speculators_pieces()
    c = parity.CASES[case]
    model = parity.speculators_model(c)
    drafter = parity.our_drafter(c, model)
    aux, ids = parity.inputs(c)
    rng = np.random.default_rng(7)
    length = len(ids)
    mask = rng.random(length) < 0.75  # some drafted tokens unsupervised
    hidden = rng.standard_normal((length, c["hidden"])).astype(np.float32)
    anchors = np.asarray(parity.ANCHORS)
    valid = np.ones(len(anchors), bool)
    valid[-1] = False  # a padding block
    both = {"kl_div": (eager.kl_div_loss, 1.0 - ce_weight), "ce": (eager.ce_loss, ce_weight)}
    loss_config = {name: fw for name, fw in both.items() if fw[1] > 0}
    want, metrics = speculators_loss(
        model, torch, core, loss_config, aux, ids, mask, hidden, anchors, valid, monkeypatch
    )
    with torch.no_grad():  # the teacher from the same tensors speculators reads: verifier_norm, verifier_lm_head
        y = model.verifier_norm(torch.as_tensor(hidden)).numpy()
    head_w = jnp.asarray(model.verifier_lm_head.weight.detach().numpy())
    got, stats = our_loss(drafter, jnp.asarray(aux), jnp.asarray(y), head_w, ids, mask, anchors, valid, ce_weight)
    assert want > 0 and abs(got - want) <= 1e-5 * abs(want), (case, ce_weight, got, want)
    for k in range(1, c["block"]):  # per-slot accuracy and speculators' eal, the same counts
        assert stats["correct"][k - 1] == metrics[f"position_{k}_acc_sum"], k
        assert stats["total"][k - 1] == metrics[f"position_{k}_acc_total"], k
    assert stats["eal_sum"] == pytest.approx(metrics["eal_sum"]) and stats["eal_blocks"] == metrics["eal_total"]


def test_the_loss_is_the_mean_over_sequences_and_kernels_give_dense_gradients():
    """Two sequences: the mean of their own losses; the blockwise kernels' loss and gradients
    equal the dense mask's, finite with padding blocks."""
    import peagle_jax as pj

    cfg = pj.DrafterConfig(
        hidden_size=32, target_hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=64, draft_vocab_size=64, mode="dflash", mask_token_id=62,
        aux_layer_ids=(1, 2), qk_norm=True, block_size=4,
    )  # fmt: skip
    drafter = pj.Drafter.random(cfg, seed=3)
    rng = np.random.default_rng(0)
    length = 20
    ids = rng.integers(0, 62, (2, length))
    mask = rng.random((2, length)) < 0.8
    aux = jnp.asarray(rng.standard_normal((2, length, 64)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((2, length, 32)), jnp.float32)
    head_w = jnp.asarray(rng.standard_normal((64, 32)) / 6, jnp.float32)
    anchors = np.array([[1, 5, 9, 0], [2, 3, 11, 0]])
    valid = np.array([[True, True, True, False], [True, True, True, False]])
    each = [our_loss(drafter, aux[i], y[i], head_w, ids[i], mask[i], anchors[i], valid[i], 0.0)[0] for i in range(2)]

    parts, params, frozen = split_params(drafter, True, True)
    batch = {
        "tokens": jnp.asarray(ids, jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (2, length)),
        "sup": jnp.asarray(mask),
        "doc": jnp.zeros((2, length), jnp.int32),
        "anchor": jnp.asarray(anchors, jnp.int32),
        "anchor_valid": jnp.asarray(valid),
    }

    def loss(p, attention):
        spec = LossSpec(mode="dflash", dflash_gamma=4.0, ce_weight=0.0, softcap=None, attention=attention)
        return block_loss_and_metrics(parts, p, frozen, aux, y, head_w, batch, spec)[0]

    dense, g_dense = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, "dense")
    blocked, g_blocked = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, "kernels")
    assert float(dense) == pytest.approx(np.mean(each), rel=1e-5)
    assert float(blocked) == pytest.approx(float(dense), rel=1e-5)
    for name in g_dense:
        assert np.all(np.isfinite(g_blocked[name])), name
        np.testing.assert_allclose(g_blocked[name], g_dense[name], rtol=2e-4, atol=1e-6, err_msg=name)
    assert any(float(jnp.abs(g).max()) > 0 for g in g_dense.values())


# ---------------------------------------------------------------------------------------
# anchors
def examples(n: int = 3, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        m = int(rng.integers(30, 60))
        mask = np.zeros(m, bool)
        mask[int(rng.integers(3, 10)) :] = True  # an answer after a prompt
        mask[rng.random(m) < 0.1] = False  # and a few unsupervised tokens inside it
        out.append(Example(rng.integers(1, 60, m).astype(np.int32), mask, 100 + i))
    return out


def test_anchors_are_seeded_supervised_inside_the_document_and_sorted():
    exs = examples()
    kw = dict(seed=5, length=64, block_size=B, max_anchors=12)
    a = make_block_batch(exs, step=3, **kw)
    again = make_block_batch(exs, step=3, **kw)
    other = make_block_batch(exs, step=4, **kw)
    np.testing.assert_array_equal(a.anchor, again.anchor)  # a function of (seed, step, row)
    assert not np.array_equal(a.anchor, other.anchor)
    rows = make_block_batch(exs[1:], step=3, first_row=1, **kw)  # a process's rows of the batch
    np.testing.assert_array_equal(rows.anchor, a.anchor[1:])
    for i, e in enumerate(exs):
        n = len(e.ids)
        got = a.anchor[i][a.anchor_valid[i]]
        assert len(got) == 12 and np.all(np.diff(got) > 0)
        assert np.all(e.mask[got]) and np.all(got + B < n)  # supervised, never in the last block
        assert not np.any(a.anchor_valid[i][12:]) and np.all(a.anchor[i][~a.anchor_valid[i]] == 0)
    few = make_block_batch(exs, step=3, seed=5, length=64, block_size=B, max_anchors=None)
    assert few.anchor.shape[1] == 64 - B  # one slot per position that can hold a block
    for i, e in enumerate(exs):  # every candidate fits: all of them taken
        want = np.flatnonzero(e.mask[: len(e.ids) - B])
        np.testing.assert_array_equal(few.anchor[i][few.anchor_valid[i]], want)


def test_no_anchor_block_crosses_a_document():
    doc = np.array([0] * 12 + [1] * 9 + [2] * 15 + [-1] * 4)
    ok = anchor_candidates(np.ones(len(doc), bool), doc, 4)
    starts = np.flatnonzero(ok)
    assert len(starts) > 0
    assert np.all(doc[starts + 4] == doc[starts])  # the block and the token after it: one document
    want = [a for a in range(len(doc) - 4) if doc[a] >= 0 and doc[a + 4] == doc[a]]
    np.testing.assert_array_equal(starts, want)


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--loop.ce_weight", "1.5", r"loop.ce_weight must be a number in \[0, 1\]"),
        ("--model.block_size", "1", "model.block_size must be >= 2"),
        ("--loop.dflash_gamma", "0", "loop.dflash_gamma must be"),
        ("--eval.ks", "8", r"eval.ks \[8\]: a DFlash head of model.block_size 8 drafts at most 7"),
        ("--loop.segments", "2", "loop.segments=2 splits COD rows"),
    ],
)
def test_bad_dflash_flags_are_refused_in_one_line(flag, value, message):
    from peagle_jax.runtime.command_line import UsageError

    with pytest.raises(UsageError, match=message):
        parse_args(["--preset", "tiny", "--model.mode", "dflash", flag, value])


# ---------------------------------------------------------------------------------------
# python -m train --model.mode dflash
class StopAt(Hook):
    """Raises after step `step` (a run killed there: its last checkpoint stays the latest)."""

    def __init__(self, step: int):
        self.step = step

    def after_step(self, trainer, rec):
        if trainer.step == self.step:
            raise RuntimeError("killed")


def flags(out, target, *extra):
    return parse_args(
        [
            "--preset", "tiny", "--model.mode", "dflash", "--out", str(out), "--model.target", str(target),
            "--loop.steps", "16", "--loop.checkpoint_every", "5", "--loop.progress", "false", *extra,
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory):
    from train.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("dflash")
    target = build_tiny_target(root / "target")
    return root, target, run(flags(root / "a", target))


def steps_of(out):
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r]


def test_a_dflash_run_learns_exports_and_is_scored(dflash_run):
    import peagle_jax as pj
    from train.evaluate import HeldoutSet
    from train.loop import load_data
    from train.step import features

    root, target_dir, summary = dflash_run
    out = root / "a"
    steps = steps_of(out)
    assert summary["mode"] == "dflash" and summary["k_train"] == B - 1 and len(steps) == 16
    first, last = steps[0]["loss"], np.mean([r["loss"] for r in steps[-4:]])
    assert last < 0.8 * first, (first, last)
    assert len(steps[-1]["acc"]) == B - 1 and 1.0 <= steps[-1]["eal"] <= B
    assert summary["heldout"]["eval_loss"] > 0 and "eval_eal" in summary["heldout"]
    assert summary["eval"] is not None and summary["eval"]["acceptance_length"] >= 1.0
    head = pj.load_drafter(out / "head")
    assert head.config.mode == "dflash" and head.config.block_size == B
    assert (out / "vllm" / "config.json").exists(), summary.get("export_warnings")

    target = pj.load_target(target_dir, dtype="float32")
    held = load_data(flags(out, target_dir), target.tokenizer, out).heldout
    aux_ids = tuple(head.config.aux_layer_ids)

    def feats(e):
        tok, pos = np.zeros((1, 64), np.int32), np.full((1, 64), -1, np.int32)
        tok[0, : len(e.ids)], pos[0, : len(e.ids)] = e.ids, np.arange(len(e.ids))
        aux, y = features(target.graphdef, target.state, tok, pos, aux_ids)
        return np.asarray(aux[0]), np.asarray(y[0])

    scored = HeldoutSet(target, held, feats, k=3, max_len=64, block_size=B)
    score = scored.acceptance(head)
    assert score["anchors"] > 0 and 1.0 <= score["acceptance"] <= 4.0, score
    fresh = pj.new_drafter(target, mode="dflash", block_size=B, seed=1)  # the same anchors, whatever it drafts
    assert scored.acceptance(fresh)["anchors"] == score["anchors"]
    with pytest.raises(ValueError, match="block_size"):
        HeldoutSet(target, held, feats, k=3, max_len=64).acceptance(head)  # P-EAGLE rows: refused


def test_a_dflash_run_resumes_exactly(dflash_run):
    import peagle_jax as pj

    root, target, _ = dflash_run
    out = root / "b"
    with pytest.raises(RuntimeError, match="killed"):
        run(flags(out, target, "--eval.enabled", "false"), hooks=[StopAt(12)])
    summary = run(flags(out, target, "--eval.enabled", "false"))
    assert summary["resumed_from_step"] == 10
    want = [r["loss"] for r in steps_of(root / "a")]
    got = [r["loss"] for r in steps_of(out)]
    assert got == want
    a, b = pj.load_drafter(root / "a" / "head").arrays(), pj.load_drafter(out / "head").arrays()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=str(name))


def test_an_anchor_scores_what_the_engine_accepts_from_it(dflash_run):
    """On the target's own greedy text, a block anchored at p scores what the engine's first
    round from the prefix ids[:p] accepts (its bonus token is ids[p])."""
    import peagle_jax as pj
    from peagle_jax.engine import SpeculativeDecoder, generate_greedy
    from train.evaluate import HeldoutSet
    from train.step import features

    root, target_dir, _ = dflash_run
    head = pj.load_drafter(root / "a" / "head")
    target = pj.load_target(target_dir, dtype="float32")
    k, prompt = 3, [3, 17, 5, 42, 9, 11]
    ids = np.asarray(prompt + list(generate_greedy(target, [prompt], max_new_tokens=30, eos=())[0]), np.int32)
    example = Example(ids, np.arange(len(ids)) >= len(prompt), 0)

    def feats(e):
        tok, pos = np.zeros((1, 64), np.int32), np.full((1, 64), -1, np.int32)
        tok[0, : len(e.ids)], pos[0, : len(e.ids)] = e.ids, np.arange(len(e.ids))
        aux, y = features(target.graphdef, target.state, tok, pos, tuple(head.config.aux_layer_ids))
        return np.asarray(aux[0]), np.asarray(y[0])

    per_anchor = dict(zip(*HeldoutSet(target, [example], feats, k=k, max_len=64, block_size=B).anchor_lengths(head, 0)))
    dec = SpeculativeDecoder(target, head, k=k, mode="dflash", eos_ids=())
    seen = []
    for p in range(len(prompt) + 1, len(ids) - B, 3):
        res = dec.generate([ids[:p].tolist()], max_new_tokens=2)  # the bonus token, then one round
        assert res.stats["rounds"] == 1
        assert res.stats["acceptance_length"] == per_anchor[p], p
        seen.append(per_anchor[p])
    assert len(seen) >= 4 and max(seen) > 1, seen  # some rounds accept drafts: the match is not all 1s


@pytest.mark.parametrize("saved_loss,ce_weight,resumes", [("kl", 0.0, True), ("ce", 1.0, True), ("ce", 0.0, False)])
def test_a_run_saved_with_dflash_loss_resumes_as_its_ce_weight(tmp_path, saved_loss, ce_weight, resumes):
    """A checkpoint folder written before loop.ce_weight (loop.dflash_loss kl | ce) resumes with
    the ce_weight it trained with (0 | 1), and is refused, naming the flag, with another."""
    from train import config as C
    from train.loop import TrainError, check_resume

    cfg = parse_args(["--preset", "tiny", "--model.mode", "dflash", "--out", str(tmp_path)])
    saved = C.to_dict(cfg)
    del saved["loop"]["ce_weight"]
    saved["loop"]["dflash_loss"] = saved_loss
    (tmp_path / "config.json").write_text(json.dumps(saved))
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)  # a checkpoint
    now = parse_args(
        ["--preset", "tiny", "--model.mode", "dflash", "--out", str(tmp_path), "--loop.ce_weight", str(ce_weight)]
    )
    if resumes:
        check_resume(tmp_path, now)
    else:
        with pytest.raises(TrainError, match=r"loop.ce_weight=1.0 \(now 0.0\)"):
            check_resume(tmp_path, now)
