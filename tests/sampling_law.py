"""The lossless-sampling check the engine tests share: joint counts of the first sampled tokens
and a chi-square test of two such counts (speculative against plain sampling)."""

from __future__ import annotations

import numpy as np


def sample_counts(dec, prompt, n_rows, seeds, new):
    """Joint counts of the first `new` sampled tokens over n_rows x len(seeds) draws."""
    counts = {}
    for seed in seeds:
        res = dec.generate([prompt] * n_rows, max_new_tokens=new, temperature=1.0, top_p=0.9, seed=seed)
        for row in res.tokens:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts


def chi2_pvalue(a: dict, b: dict) -> float:
    """p-value that counts `a` and `b` come from one law (outcomes seen < 10 times pooled)."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    big = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 10]  # pool the sparse tail
    table = [[a.get(k, 0) for k in big], [b.get(k, 0) for k in big]]
    table[0].append(sum(v for k, v in a.items() if k not in big))
    table[1].append(sum(v for k, v in b.items() if k not in big))
    return chi2_contingency(np.asarray(table)).pvalue
