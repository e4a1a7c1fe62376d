"""`train.payoff`: the fastest K, break-even acceptance and the tokens a run's curve needs."""

from __future__ import annotations

import math

import pytest

from train.payoff import curve, fastest_k, payoff


def records(n: int, tokens: int, rise: float) -> list[dict]:
    """n steps of `tokens` each whose depth-0 conditional accuracy grows by `rise` per decade."""
    out = []
    for i in range(n):
        seen = tokens * (i + 1)
        acc = max(0.0, rise * math.log10(seen) - 0.2)
        out.append({"tokens": tokens, "cond_acc": [acc, acc / 2, 0.0]})
    return out


def test_fastest_k_prefers_speed_then_the_smaller_k():
    assert fastest_k({1: {"speedup": 0.5}, 3: {"speedup": 0.7}, 7: {"speedup": 0.6}}) == 3
    assert fastest_k({3: {"speedup": 0.7}, 1: {"speedup": 0.7}}) == 1


def test_curve_windows_cover_the_run():
    toks, sim = curve(records(80, 100, 0.1), k=2, windows=8)
    assert len(toks) == 8 and 7000 < toks[-1] < 8000 and all(sim[1:] >= sim[:-1])


def test_payoff_extrapolates_the_log_linear_curve_to_break_even():
    recs = records(400, 250, 0.1)  # sim(K=1) = 1 + 0.1 log10(tokens) - 0.2
    by_k = {1: {"acceptance_length": 1.15, "speedup": 0.5}}  # break even at acceptance 2.3
    got = payoff(recs, by_k)[1]
    assert got["break_even_acceptance"] == pytest.approx(2.3)
    assert got["fit_slope"] == pytest.approx(0.1, rel=0.05)
    assert math.log10(got["tokens_needed"]) == pytest.approx((2.3 - 0.8) / 0.1, rel=0.05)  # ~1e15 tokens
    flat = payoff(records(400, 250, 0.0), by_k)[1]
    assert flat["tokens_needed"] is None  # a curve that does not rise never pays off


def test_advice_names_a_round_timed_cheaper_than_a_step(capsys):
    from train.__main__ import print_advice

    by_k = {3: {"acceptance_length": 1.2, "speedup": 2.4}}  # a round cost half a step: a disturbed clock
    print_advice({"eval": {"by_k": by_k}, "best_k": 3, "payoff": payoff(records(40, 250, 0.1), by_k)})
    out = capsys.readouterr().out
    assert "from acceptance 0.50" in out and "timings are unreliable" in out and "this one does" not in out
