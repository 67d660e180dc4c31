"""The proposer of a speculative-decoding configuration (the engine builds it; the scheduler calls it)."""

from __future__ import annotations

from tripath.engine.config.speculative import SpeculativeConfig
from tripath.engine.speculative.ngram import NgramProposer


def make_proposer(config: SpeculativeConfig, runner=None, engine_config=None, vocab_size: int | None = None,
                  draft=None):
    """The proposer of ``config.method``; ``draft_model`` and ``mtp`` need the target's ``runner`` (one rank:
    a :class:`~tripath.engine.runner.model_runner.ModelRunner`) and its ``engine_config``; ``draft_model`` also
    ``vocab_size``, and takes the ``draft`` model when it is loaded already (else ``config.model`` is
    loaded); ``mtp`` drafts with the runner's model's MTP layer and observes its launches."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from tripath.engine.runner.model_runner import ModelRunner   # the drafters' imports: only when one is asked for

    if not isinstance(runner, ModelRunner):
        raise ValueError(f"speculative_config method {config.method!r} runs with tensor_parallel_size 1")
    if config.method == "mtp":
        from tripath.engine.drafters.mtp import MTPProposer
        return MTPProposer(runner.model, runner, engine_config)
    from tripath.engine.drafters.draft_model import DraftModelProposer

    return DraftModelProposer(config.model if draft is None else draft, engine_config, num_blocks=runner.num_blocks,
                              block_size=runner.block_size, max_model_len=runner.max_model_len,
                              vocab_size=vocab_size)
