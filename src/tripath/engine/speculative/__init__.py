"""Speculative decoding: proposers draft tokens for running requests, the model scores a request's pending
token and its drafts in one verify step, and the acceptance rule keeps the drafts the target model agrees
with (:mod:`~tripath.engine.speculative.acceptance`), so outputs follow the target model's distribution
(greedy: the same tokens as without speculation).

Settings: :class:`~tripath.engine.speculative.config.SpeculativeConfig`; proposers:
:mod:`~tripath.engine.speculative.ngram`.
"""

from tripath.engine.speculative.config import SpeculativeConfig
from tripath.engine.speculative.ngram import NgramProposer


def make_proposer(config: SpeculativeConfig) -> NgramProposer:
    """The proposer of ``config.method``."""
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


__all__ = ["NgramProposer", "SpeculativeConfig", "make_proposer"]
