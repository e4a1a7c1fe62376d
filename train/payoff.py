"""What a finished run says about serving its head: the fastest draft depth it measured, the
acceptance a head needs on this target and machine to beat plain decoding, and how many
training tokens this run's own learning curve says that takes.

At one K a speculative round costs the same whatever it accepts, so speedup is proportional
to acceptance length: the head breaks even at acceptance `acceptance / speedup` of that K.
The run's curve is its simulated acceptance at K (1 + the conditional accuracies of depths
below K, `train.metrics`) over windows of steps against the tokens seen; a straight line in
log10(tokens) through it, extrapolated, says where it would reach break-even: an
extrapolation from a short run, reported as one.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["fastest_k", "payoff", "curve"]

WINDOWS = 8  # points of the curve (the first is dropped from the fit: the warmup's)
MAX_LOG10_TOKENS = 300  # beyond it 10**x overflows a float (OverflowError): such a curve "does not rise enough"


def fastest_k(by_k: dict) -> int:
    """The measured K with the highest speedup (the smaller K on a tie)."""
    return min(by_k, key=lambda k: (-by_k[k]["speedup"], int(k)))


def curve(records: list[dict], k: int, windows: int = WINDOWS) -> tuple[np.ndarray, np.ndarray]:
    """(tokens seen in each window: the geometric mean over its steps, mean simulated acceptance
    at K in it): the points a line in log10(tokens) is fitted through."""
    recs = [r for r in records if "cond_acc" in r and "tokens" in r]
    if not recs:
        return np.zeros(0), np.zeros(0)
    tokens = np.cumsum([r["tokens"] for r in recs])
    sim = np.asarray([1.0 + float(np.sum(r["cond_acc"][:k])) for r in recs])
    edges = np.linspace(0, len(recs), min(windows, len(recs)) + 1).astype(int)
    return (
        np.asarray([10 ** np.log10(tokens[lo:hi]).mean() for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]),
        np.asarray([sim[lo:hi].mean() for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]),
    )


def payoff(records: list[dict], by_k: dict) -> dict:
    """Per measured K: break-even acceptance, this run's simulated acceptance at its end, and
    the tokens the fitted curve needs to reach break-even (None: the curve does not rise)."""
    out = {}
    for k, ev in sorted(by_k.items(), key=lambda kv: int(kv[0])):
        need = ev["acceptance_length"] / ev["speedup"] if ev["speedup"] > 0 else math.inf
        toks, sim = curve(records, int(k))
        seen = int(sum(r.get("tokens", 0) for r in records if "cond_acc" in r))
        entry = {"break_even_acceptance": need, "tokens_seen": seen, "tokens_needed": None}
        if len(toks) >= 3:
            b, a = np.polyfit(np.log10(toks[1:]), sim[1:], 1)
            entry.update(fit_intercept=float(a), fit_slope=float(b), simulated_now=float(sim[-1]))
            exponent = (need - a) / b if b > 0 and math.isfinite(need) else math.inf
            if exponent <= MAX_LOG10_TOKENS:
                entry["tokens_needed"] = float(10**exponent)
        out[int(k)] = entry
    return out
