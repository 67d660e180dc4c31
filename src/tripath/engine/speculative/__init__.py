"""Speculative decoding: proposers draft tokens for running requests, the model scores a request's pending
token and its drafts in one verify step, and the acceptance rule keeps the drafts the target model agrees
with (:mod:`~tripath.engine.speculative.acceptance`), so outputs follow the target model's distribution
(greedy: the same tokens as without speculation).

Settings: :class:`~tripath.engine.speculative.config.SpeculativeConfig`; the proposer of a config:
:func:`~tripath.engine.speculative.proposers.make_proposer`; proposers:
:mod:`~tripath.engine.speculative.ngram`, :mod:`~tripath.engine.speculative.draft_model` and, for benchmarks,
:mod:`~tripath.engine.speculative.oracle`.
"""

from tripath.engine.speculative.config import SpeculativeConfig
from tripath.engine.speculative.ngram import NgramProposer


__all__ = ["NgramProposer", "SpeculativeConfig"]
