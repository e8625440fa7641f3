"""Chi-square helpers shared by the statistical tests."""
from __future__ import annotations

import numpy as np
from scipy import stats

ALPHA = 1e-3


def chisq_counts_pvalue(counts, probs) -> float:
    """Chi-square of counts against probs (normalised); bins with expected < 5 are pooled."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    expected = np.asarray(probs, dtype=np.float64).ravel()
    expected = expected / expected.sum() * counts.sum()
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    rest_o, rest_e = counts[~big].sum(), expected[~big].sum()
    if rest_e > 0:
        if rest_e >= 5 or not exp:
            obs.append(rest_o)
            exp.append(rest_e)
        else:  # merge the small pooled bin into the smallest kept one
            j = int(np.argmin(exp))
            obs[j] += rest_o
            exp[j] += rest_e
    if len(obs) < 2:
        return 1.0
    exp = np.asarray(exp)
    exp *= np.sum(obs) / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


def chisq_pvalue(samples, probs) -> float:
    """Goodness of fit of integer samples to probs [V]. Samples in zero-probability bins fail
    outright (pooling would hide them)."""
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    counts = np.bincount(np.asarray(samples).ravel(), minlength=probs.size).astype(np.float64)
    assert counts.size == probs.size, "sample outside the support"
    assert counts[probs == 0].sum() == 0, f"samples in zero-probability bins {np.nonzero(counts * (probs == 0))[0]}"
    return chisq_counts_pvalue(counts, probs)
