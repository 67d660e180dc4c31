"""Pearson's chi-square statistic for the sampling tests."""

import torch


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """The statistic of ``observed`` counts against ``n · probs`` over the support of ``probs``; a count outside
    the support fails the test at once."""
    n = observed.sum()
    support = probs > 0
    assert observed[~support].sum() == 0, "a token outside the distribution's support was drawn"
    expected = probs[support] * n
    return float(((observed[support] - expected) ** 2 / expected).sum())
