"""Speculative decoding: proposers draft tokens for running requests, the model scores a request's pending
token and its drafts in one verify step, and the acceptance rule keeps the drafts the target model agrees
with (:mod:`~tripath.engine.speculative.acceptance`), so outputs follow the target model's distribution
(greedy: the same tokens as without speculation).

This package holds the parts that run no model, below the scheduler and the runner that use them: the
acceptance rule, the n-gram proposer (:mod:`~tripath.engine.speculative.ngram`, the scheduler's own) and, for
benchmarks, :mod:`~tripath.engine.speculative.oracle`. Settings:
:class:`~tripath.engine.config.speculative.SpeculativeConfig`; the proposers that run a model, and the
proposer of a config (:func:`~tripath.engine.drafters.proposers.make_proposer`): :mod:`tripath.engine.drafters`.
"""

from tripath.engine.config.speculative import SpeculativeConfig
from tripath.engine.speculative.ngram import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
