"""The proposer of a speculative-decoding configuration (the engine builds it; the scheduler calls it)."""

from __future__ import annotations

from tripath.engine.speculative.config import SpeculativeConfig
from tripath.engine.speculative.ngram import NgramProposer


def make_proposer(config: SpeculativeConfig, runner=None, engine_config=None, vocab_size: int | None = None,
                  draft=None):
    """The proposer of ``config.method``; ``draft_model`` needs the target's ``runner`` (one rank: a
    :class:`~tripath.engine.model_runner.ModelRunner`), its ``engine_config`` and ``vocab_size``, and takes
    the ``draft`` model when it is loaded already (else ``config.model`` is loaded)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from tripath.engine.model_runner import ModelRunner   # the draft model's imports: only when it is asked for
    from tripath.engine.speculative.draft_model import DraftModelProposer

    if not isinstance(runner, ModelRunner):
        raise ValueError("speculative_config method 'draft_model' runs with tensor_parallel_size 1")
    return DraftModelProposer(config.model if draft is None else draft, engine_config, num_blocks=runner.num_blocks,
                              block_size=runner.block_size, max_model_len=runner.max_model_len,
                              vocab_size=vocab_size)
