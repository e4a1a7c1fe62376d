"""The held-out simulated acceptance (`train.evaluate.HeldoutSet`): its per-anchor statistic,
its standard error, and that an anchor's value is what the engine's first round accepts from
that position on the target's own greedy text."""

from __future__ import annotations

import numpy as np
import pytest

import peagle_jax as pj
from peagle_jax.engine import SpeculativeDecoder, generate_greedy
from train.data import Example
from train.evaluate import HeldoutSet
from train.metrics import anchor_acceptance, clustered_mean
from train.step import features


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


def test_an_anchor_scores_what_the_engine_accepts_from_it(tiny):
    k, prompt_len, new = 4, 6, 24
    prompt = [3, 17, 5, 42, 9, 11]
    ids = np.asarray(generate_greedy(tiny, [prompt], max_new_tokens=new, eos=())[0], np.int32)
    ids = np.concatenate([np.asarray(prompt, np.int32), ids])
    example = Example(ids, np.arange(len(ids)) >= prompt_len, 0)
    drafter = overfit_head(tiny, example, k)  # a head that drafts some of this text right

    def feats(e):
        length = 64
        tok = np.zeros((1, length), np.int32)
        pos = np.full((1, length), -1, np.int32)
        tok[0, : len(e.ids)], pos[0, : len(e.ids)] = e.ids, np.arange(len(e.ids))
        aux, y = features(tiny.graphdef, tiny.state, tok, pos, tuple(tiny.aux_layer_ids))
        return np.asarray(aux[0]), np.asarray(y[0])

    held = HeldoutSet(tiny, [example], feats, k=k, max_len=64)
    score = held.acceptance(drafter)
    assert 1.0 <= score["acceptance"] <= k + 1 and score["sequences"] == 1 and score["anchors"] > 0
    # the engine from the prefix ids[:p]: its bonus token is ids[p] (greedy), its first draft row
    # is anchor p - 1; the first round's acceptance length is that anchor's value
    per_anchor = dict(zip(*held.anchor_lengths(drafter, 0)))
    dec = SpeculativeDecoder(tiny, drafter, k=k, mode="parallel", eos_ids=())
    seen = []
    for p in range(prompt_len + 1, len(ids) - k - 2, 2):
        if p - 1 not in per_anchor:
            continue
        res = dec.generate([ids[:p].tolist()], max_new_tokens=2)  # the bonus token, then one round
        assert res.stats["rounds"] == 1
        assert res.stats["acceptance_length"] == per_anchor[p - 1], p
        seen.append(per_anchor[p - 1])
    assert len(seen) >= 4 and max(seen) > 1, seen  # some rounds accept drafts: the match is not all 1s


def overfit_head(target, example, k: int):
    from train.config import parse_args
    from train.trainer import Trainer

    flags = ["--preset", "tiny", "--model.k_train", str(k), "--optim.lr", "3e-3", "--data.max_len", "64"]
    trainer = Trainer(parse_args(flags), target, 80, token_counts=np.ones(target.config.vocab_size, np.int64))
    trainer.fit([example])
    return trainer.head()
