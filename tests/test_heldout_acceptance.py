"""The held-out simulated acceptance (`train.evaluate.HeldoutSet`): its per-anchor statistic,
its standard error, that an anchor's value is what the engine's first round accepts from that
position on the target's own greedy text, and that the per-round walk is the engine's
acceptance length answering the prompt, for P-EAGLE, EAGLE-3 and DFlash heads."""

from __future__ import annotations

import numpy as np
import pytest

import peagle_jax as pj
from peagle_jax.engine import SpeculativeDecoder, generate_greedy
from train.data import Example
from train.evaluate import HeldoutSet, answer_starts, padded_features, walk_rounds
from train.metrics import anchor_acceptance, clustered_mean


def test_anchor_acceptance_counts_leading_right_depths_of_complete_chains():
    # anchors 0, 1, 2 with depths 0..2; anchor 2's depth 2 is unsupervised (dropped); k = 3
    anchor = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2])
    depth = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2])
    hit = np.array([1, 1, 0, 1, 0, 1, 1, 1, 1], bool)
    sup = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0], bool)
    anchors, lengths = anchor_acceptance(hit, sup, anchor, depth, np.zeros(9, int), k=3)
    assert anchors.tolist() == [0, 1] and lengths.tolist() == [4.0, 2.0]  # 3 right; then 1 right, a miss


def test_clustered_mean_is_the_pooled_mean_with_the_cluster_spread():
    sums, counts = np.array([10.0, 20.0, 30.0]), np.array([10, 10, 10])
    mean, se = clustered_mean(sums, counts)
    per = sums / counts
    assert mean == pytest.approx(2.0)
    assert se == pytest.approx(per.std(ddof=1) / np.sqrt(3))  # equal clusters: the SE of cluster means
    assert clustered_mean(np.zeros(2), np.zeros(2))[0] != clustered_mean(np.zeros(2), np.zeros(2))[0]  # nan


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from train.tiny import build_tiny_target

    return pj.load_target(build_tiny_target(tmp_path_factory.mktemp("heldout") / "tiny"), dtype="float32")


K, PROMPT_LEN = 4, 6


@pytest.fixture(scope="module")
def overfit(tiny):
    """(example, drafter, HeldoutSet): the target's own greedy answer to a prompt, and a head
    overfit on it, so that it drafts some of it right."""
    prompt = [3, 17, 5, 42, 9, 11]
    ids = np.asarray(generate_greedy(tiny, [prompt], max_new_tokens=24, eos=())[0], np.int32)
    ids = np.concatenate([np.asarray(prompt, np.int32), ids])
    example = Example(ids, np.arange(len(ids)) >= PROMPT_LEN, 0)
    drafter = overfit_head(tiny, example, K)

    return example, drafter, HeldoutSet(tiny, [example], padded_features(tiny, tiny.aux_layer_ids, 64), k=K, max_len=64)


def test_an_anchor_scores_what_the_engine_accepts_from_it(tiny, overfit):
    example, drafter, held = overfit
    ids = example.ids
    score = held.acceptance(drafter)
    assert 1.0 <= score["acceptance"] <= K + 1 and score["sequences"] == 1 and score["anchors"] > 0
    # the engine from the prefix ids[:p]: its bonus token is ids[p] (greedy), its first draft row
    # is anchor p - 1; the first round's acceptance length is that anchor's value
    per_anchor = dict(zip(*held.anchor_lengths(drafter, 0)))
    dec = SpeculativeDecoder(tiny, drafter, k=K, mode="parallel", eos_ids=())
    seen = []
    for p in range(PROMPT_LEN + 1, len(ids) - K - 2, 2):
        if p - 1 not in per_anchor:
            continue
        res = dec.generate([ids[:p].tolist()], max_new_tokens=2)  # the bonus token, then one round
        assert res.stats["rounds"] == 1
        assert res.stats["acceptance_length"] == per_anchor[p - 1], p
        seen.append(per_anchor[p - 1])
    assert len(seen) >= 4 and max(seen) > 1, seen  # some rounds accept drafts: the match is not all 1s


def test_the_per_round_walk_is_the_engines_acceptance_on_the_answer(tiny, overfit):
    """The engine answering the prompt runs exactly the walk's rounds (prefill's bonus token, then
    each round L tokens on), so per_round is its acceptance length; the mean over every anchor is
    another number."""
    example, drafter, held = overfit
    anchors, lengths = held.anchor_lengths(drafter, 0)
    assert answer_starts(example.mask).tolist() == [PROMPT_LEN]
    tokens, rounds = walk_rounds(anchors, lengths, [PROMPT_LEN - 1])
    assert rounds >= 3
    dec = SpeculativeDecoder(tiny, drafter, k=K, mode="parallel", eos_ids=())
    res = dec.generate([example.ids[:PROMPT_LEN].tolist()], max_new_tokens=1 + int(tokens))
    assert res.tokens[0] == example.ids[PROMPT_LEN : PROMPT_LEN + 1 + int(tokens)].tolist()
    assert res.stats["rounds"] == rounds
    assert res.stats["acceptance_length"] == pytest.approx(tokens / rounds)
    score = held.acceptance(drafter)
    assert (score["per_round"], score["rounds"]) == (pytest.approx(tokens / rounds), rounds)
    assert score["per_round"] != pytest.approx(score["acceptance"])


def test_a_dflash_walk_is_the_engines_acceptance_too(tiny, overfit):
    """DFlash anchors are the bonus token's position (COD rows: the one before): the walk from
    the answer's first token is the engine's rounds for a DFlash head as well."""
    example = overfit[0]
    drafter = overfit_head(tiny, example, K, ["--model.mode", "dflash", "--model.block_size", str(K + 1)])
    feats = padded_features(tiny, drafter.config.aux_layer_ids, 64)
    dflash = HeldoutSet(tiny, [example], feats, k=K, max_len=64, block_size=K + 1)
    score = dflash.acceptance(drafter)
    assert score["rounds"] >= 3
    tokens = score["per_round"] * score["rounds"]
    dec = SpeculativeDecoder(tiny, drafter, k=K, mode="dflash", eos_ids=())
    res = dec.generate([example.ids[:PROMPT_LEN].tolist()], max_new_tokens=1 + round(tokens))
    assert (res.stats["rounds"], res.stats["acceptance_length"]) == (score["rounds"], pytest.approx(score["per_round"]))
    assert score["per_round"] > 1.0  # the head drafts some of it right


def test_a_chain_walk_is_the_engines_acceptance_too(tiny, overfit):
    """EAGLE-3 rows run as the training-time test does; an anchor's value is what the engine's
    chain accepts from it, and the walk is the engine's rounds answering the prompt."""
    example = overfit[0]
    drafter = overfit_head(tiny, example, K, ["--model.mode", "chain"])
    feats = padded_features(tiny, drafter.config.aux_layer_ids, 64)
    chain = HeldoutSet(tiny, [example], feats, k=K, max_len=64, chain=True)
    dec = SpeculativeDecoder(tiny, drafter, k=K, mode="chain", eos_ids=())
    per_anchor = dict(zip(*chain.anchor_lengths(drafter, 0)))
    ids = example.ids
    firsts = [p for p in range(PROMPT_LEN + 1, len(ids) - K - 2, 3) if p - 1 in per_anchor]
    for p in firsts:
        res = dec.generate([ids[:p].tolist()], max_new_tokens=2)
        assert res.stats["acceptance_length"] == per_anchor[p - 1], p
    score = chain.acceptance(drafter)
    assert len(firsts) >= 3 and score["rounds"] >= 3 and score["per_round"] > 1.0
    tokens = score["per_round"] * score["rounds"]
    res = dec.generate([ids[:PROMPT_LEN].tolist()], max_new_tokens=1 + round(tokens))
    assert (res.stats["rounds"], res.stats["acceptance_length"]) == (score["rounds"], pytest.approx(score["per_round"]))
    with pytest.raises(ValueError, match="cannot score a parallel head"):
        chain.acceptance(overfit[1])


def test_walk_rounds_steps_over_what_a_round_accepts():
    anchors, lengths = np.array([4, 5, 6, 7, 8, 9]), np.array([3.0, 1.0, 1.0, 2.0, 1.0, 1.0])
    assert walk_rounds(anchors, lengths, [4]) == (6.0, 3)  # 4 (3) -> 7 (2) -> 9 (1) -> 10: none
    assert walk_rounds(anchors, lengths, [3]) == (0.0, 0)  # no complete round from 3
    assert answer_starts([0, 1, 1, 0, 0, 1, 1]).tolist() == [1, 5]


def overfit_head(target, example, k: int, extra=()):
    from train.flags import parse_args
    from train.trainer import Trainer

    flags = ["--preset", "tiny", "--model.k_train", str(k), "--optim.lr", "3e-3", "--data.max_len", "64", *extra]
    trainer = Trainer(parse_args(flags), target, 80, token_counts=np.ones(target.config.vocab_size, np.int64))
    trainer.fit([example])
    return trainer.head()
