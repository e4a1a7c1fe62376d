"""Cached target features give the same training as the online teacher; regeneration by the
target is cached on disk and reused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from train.flags import parse_args
from train.loop import run


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from train.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


def _args(out, target, *extra):
    return parse_args(
        [
            "--preset",
            "tiny",
            "--out",
            str(out),
            "--model.target",
            str(target),
            "--loop.steps",
            "6",
            "--loop.eval_every",
            "0",
            "--eval.enabled",
            "False",
            "--loop.progress",
            "False",
            *extra,
        ]
    )


def _loss(out):
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]


def test_cached_features_match_online(tmp_path, tiny_target):
    import peagle_jax as pj

    run(_args(tmp_path / "online", tiny_target))
    cache = tmp_path / "feats"
    run(_args(tmp_path / "cached", tiny_target, "--data.cache_features", str(cache)))
    files = sorted(cache.glob("*.npz"))
    assert 0 < len(files) <= 12  # 6 steps x 2 sequences, each written once
    np.testing.assert_allclose(_loss(tmp_path / "cached"), _loss(tmp_path / "online"), rtol=1e-5)
    a = pj.load_drafter(tmp_path / "online" / "head").arrays()
    b = pj.load_drafter(tmp_path / "cached" / "head").arrays()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=str(k))


def test_cache_made_for_other_settings_is_refused(tmp_path, tiny_target):
    from train.features import FeatureCacheError

    cache = tmp_path / "feats"
    cache.mkdir()
    (cache / "meta.json").write_text(json.dumps({"target": "/elsewhere"}))
    with pytest.raises(FeatureCacheError, match="made for target"):
        run(_args(tmp_path / "x", tiny_target, "--data.cache_features", str(cache)))


def test_regenerated_answers_are_cached_and_resumable(tmp_path, tiny_target):
    import peagle_jax as pj
    from train.data import synthetic_conversations
    from train.regenerate import regenerate

    target = pj.load_target(tiny_target, dtype="float32")
    records = [(f"row {i}", {"messages": c}) for i, c in enumerate(synthetic_conversations(8, seed=3))]
    cache = tmp_path / "regenerated.jsonl"
    got = regenerate(records, target, cache, 4)
    lines = cache.read_text().splitlines()
    assert len(got) == len(lines) == 8
    assert all(m[-1]["role"] == "assistant" and m[0]["role"] == "user" for m in got.values())
    cache.write_text("\n".join(lines[:5]) + "\n" + lines[5][:7])  # interrupted mid-line
    again = regenerate(records, target, cache, 4)
    assert again == got  # greedy: the same answers, the first 5 read back
    assert sorted(json.loads(ln)["i"] for ln in cache.read_text().splitlines()) == list(range(8))  # each once
