"""Sequence partitioning (train/segments.py, docs/method.md section 5) is exact: on random rows with
several documents per sequence, S = 1, 2, 4, 7 segments give the flat pass's loss, gradients and
metrics (1e-5 relative, f32) in both modes and with per-depth normalisation; `python -m train
--loop.segments 4` logs the losses of `--loop.segments 1`; bad values are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from in_process import run_module

from kernels.layouts import cod_sample, pad_layout
from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.handles.drafter import Drafter
from peagle_jax.runtime.command_line import UsageError
from train import flags as F
from train.cod import chain_rows
from train.segments import resolve_segments, row_segments, segment_rows, segmented_loss
from train.spec import LossSpec
from train.step import loss_and_metrics, split_params

ROOT = Path(__file__).resolve().parents[1]
L, H, B, V, VD = 40, 32, 2, 50, 40
DOCS = np.array([0] * 15 + [1] * 12 + [2] * 10 + [-1] * 3, np.int32)  # three documents, then padding
TOL = 1e-5


def make_case(mode: str, k: int, num_layers: int, seed: int = 0):
    cfg = DrafterConfig(
        hidden_size=H,
        target_hidden_size=H,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=V,
        draft_vocab_size=VD,
        mode=mode,
        mask_token_id=0 if mode == "parallel" else None,
        k_train=k,
        fc_norm=True,
    )
    parts, params, frozen = split_params(Drafter.random(cfg, seed=seed), False, False)
    rng = np.random.default_rng(seed)
    sup = (rng.random((B, L)) < 0.8) & (DOCS >= 0)
    if mode == "parallel":
        layouts = [cod_sample(sup[b], DOCS, k, 0.7, 0.2, rng) for b in range(B)]
        n = max(len(a) for a, _ in layouts) + 5  # a few padding rows too
        rows = [pad_layout(a, d, DOCS[a], n) for a, d in layouts]
    else:
        rows = [chain_rows(DOCS, k)] * B
    anchor, depth, doc = (np.stack([r[i] for r in rows]).astype(np.int32) for i in range(3))
    batch = {
        "tokens": rng.integers(1, V, (B, L)).astype(np.int32),
        "positions": np.tile(np.arange(L, dtype=np.int32), (B, 1)),
        "sup": sup,
        "anchor": anchor,
        "depth": depth,
        "doc": doc,
    }
    aux = jnp.asarray(rng.normal(size=(B, L, 3 * H)), jnp.float32)
    y = jnp.asarray(3 * rng.normal(size=(B, L, H)), jnp.float32)  # a peaked teacher
    head_w = jnp.asarray(rng.normal(size=(VD, H)), jnp.float32)
    return parts, params, frozen, aux, y, head_w, batch


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (per tensor)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


CASES = {  # (mode, per_depth): (k, drafter layers (two: context rows must pass through every layer), ce_weight)
    ("parallel", False): (4, 2, 0.0),
    ("parallel", True): (4, 1, 1.0),  # cross-entropy on the teacher's top token
    ("chain", False): (3, 1, 0.5),  # step 1 reads the context rows' outputs (the fed-back states); KL + CE
}


@pytest.fixture(scope="module", params=list(CASES), ids=lambda c: f"{c[0]}{'-per_depth' if c[1] else ''}")
def case(request):
    mode, per_depth = request.param
    k, layers, ce_weight = CASES[request.param]
    parts, params, frozen, aux, y, head_w, batch = make_case(mode, k, layers)
    kw = dict(mode=mode, k=k, per_depth=per_depth, chain_decay=0.8, softcap=None, attention="dense")
    kw["ce_weight"] = ce_weight
    spec = LossSpec(**kw)

    def flat(p):
        return loss_and_metrics(parts, p, frozen, aux, y, head_w, batch, spec)

    (loss, metrics), grads = jax.jit(jax.value_and_grad(flat, has_aux=True))(params)
    seg = jax.jit(lambda p, b: segmented_loss(parts, p, frozen, aux, y, head_w, b, spec))

    def run(s, seg_rows=None):
        if seg_rows is None:
            seg_rows = segment_rows(batch["anchor"], batch["depth"], batch["doc"], L, s, mode, k)
        return seg(params, {**batch, "seg_rows": seg_rows})

    return dict(batch=batch, mode=mode, k=k, per_depth=per_depth, flat=(float(loss), metrics, grads), run=run)


@pytest.mark.parametrize("segments", [1, 2, 4, 7])
def test_segments_equal_the_flat_pass(case, segments):
    if case["per_depth"] and segments != 4:  # each S compiles the whole step again (~20 s)
        pytest.skip("per-depth normalisation: checked at S = 4 (only the loss weights differ)")
    loss0, m0, g0 = case["flat"]
    loss, m, grads = case["run"](segments)
    assert abs(float(loss) - loss0) <= TOL * abs(loss0), (float(loss), loss0)
    assert set(grads) == set(g0)
    worst = max((rel_err(grads[name], g0[name]), name) for name in g0)
    assert worst[0] <= TOL, worst
    np.testing.assert_array_equal(np.asarray(m["correct"]), np.asarray(m0["correct"]))
    np.testing.assert_array_equal(np.asarray(m["total"]), np.asarray(m0["total"]))
    real = case["batch"]["doc"] >= 0  # padding rows have no defined hit
    np.testing.assert_array_equal(np.asarray(m["hit"])[real], np.asarray(m0["hit"])[real])
    np.testing.assert_array_equal(np.asarray(m["sup"]), np.asarray(m0["sup"]))


def test_the_comparison_catches_wrong_partitions(case):
    """A count off by one row, or one segment's rows taken twice and another's not at all, fail
    the same 1e-5 check: the test above can fail."""
    loss0, _, _ = case["flat"]
    rows = float(np.sum(np.asarray(case["flat"][1]["total"])))
    assert abs(loss0 * rows / (rows - 1) - loss0) > TOL * abs(loss0)
    b = case["batch"]
    seg = segment_rows(b["anchor"], b["depth"], b["doc"], L, 4, case["mode"], case["k"])
    doubled = seg.copy()
    doubled[:, 1] = seg[:, 0]
    loss, _, grads = case["run"](4, doubled)
    assert abs(float(loss) - loss0) > TOL * abs(loss0)
    assert max(rel_err(grads[name], case["flat"][2][name]) for name in grads) > 10 * TOL


def test_every_real_row_is_owned_by_exactly_one_segment():
    rng = np.random.default_rng(1)
    k, n = 5, 3 * L
    for s in (1, 3, 7, L + 3):
        sup = rng.random(L) < 0.7
        a, d = cod_sample(sup, DOCS, k, 0.7, 0.2, rng)
        a, d, c = pad_layout(a, d, DOCS[a], n)
        seg = segment_rows(a[None], d[None], c[None], L, s, "parallel", k)[0]
        owned = np.sort(seg[seg < n])
        np.testing.assert_array_equal(owned, np.nonzero((np.arange(n) >= L) & (c >= 0))[0])
        for i in range(s):  # each segment holds exactly the rows the formula gives it
            mine = seg[i][seg[i] < n]
            assert (row_segments(a[mine], d[mine], L, s) == i).all()
    with pytest.raises(ValueError, match="depth-0 rows"):
        segment_rows(a[None, ::-1], d[None, ::-1], c[None, ::-1], L, 2, "parallel", k)


def test_segments_flag_values():
    assert resolve_segments("auto", 100, 30) == 4
    assert resolve_segments("auto", 10, 30) == 1
    assert resolve_segments(3, 100, 30) == 3
    assert F.parse_args(["--loop.segments", "auto", "--loop.max_rows_per_segment", "4096"]).loop.segments == "auto"
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(UsageError, match=r"loop\.segments must be an integer >= 1 or auto"):
            F.parse_args(["--loop.segments", bad])
    with pytest.raises(UsageError, match="loop.max_rows_per_segment must be >= 1"):
        F.parse_args(["--loop.max_rows_per_segment", "0"])
    with pytest.raises(ValueError, match="loop.segments"):
        resolve_segments(0, 10, 10)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from train.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


def test_cli_segments_4_logs_the_losses_of_segments_1(tmp_path, tiny_target):
    base = ["--preset", "tiny", "--model.target", str(tiny_target)]
    base += ["--loop.steps", "5", "--loop.checkpoint_every", "5", "--loop.progress", "False"]
    base += ["--eval.enabled", "False", "--data.heldout", "0"]
    runs = {s: run_module("train", [*base, "--out", tmp_path / f"s{s}", "--loop.segments", s]) for s in (1, 4)}
    for res in runs.values():
        assert res.returncode == 0, res.stderr[-2000:]
    recs = {
        s: [json.loads(x) for x in (tmp_path / f"s{s}" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
        for s in runs
    }
    assert [r["step"] for r in recs[4]] == [1, 2, 3, 4, 5]
    for a, b in zip(recs[4], recs[1]):
        assert abs(a["loss"] - b["loss"]) <= TOL * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (a, b)
        assert a["acc"] == b["acc"]
    bad = run_module("train", [*base, "--out", tmp_path / "bad", "--loop.segments", "0"])
    assert bad.returncode != 0
    assert "loop.segments must be an integer >= 1 or auto" in bad.stderr


def test_the_flat_step_with_the_blockwise_kernels_equals_the_dense_mask():
    """The trainer's flat path beyond 512 rows (attention "kernels": layer 0 attends the mask slot
    once per position, `kernels.slot_attention`) gives the dense mask's loss and gradients on the
    same multi-document rows (what the partitioning tests above compare against)."""
    parts, params, frozen, aux, y, head_w, batch = make_case("parallel", 4, 2, seed=3)
    kw = dict(mode="parallel", k=4, per_depth=False, chain_decay=0.8, softcap=None)

    def flat(p, attention):
        return loss_and_metrics(parts, p, frozen, aux, y, head_w, batch, LossSpec(attention=attention, **kw))[0]

    step = jax.jit(jax.value_and_grad(flat), static_argnums=1)
    (loss0, g0), (loss, grads) = step(params, "dense"), step(params, "kernels")
    assert abs(float(loss) - float(loss0)) <= TOL * abs(float(loss0))
    worst = max((rel_err(grads[name], g0[name]), name) for name in g0)
    assert worst[0] <= TOL, worst
