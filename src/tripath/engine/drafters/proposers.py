"""The proposer of a speculative-decoding configuration (the engine builds it; the scheduler calls it)."""

from __future__ import annotations

from tripath.engine.config.speculative import SpeculativeConfig
from tripath.engine.speculative.ngram import NgramProposer


def make_proposer(config: SpeculativeConfig, runner=None, engine_config=None, vocab_size: int | None = None,
                  draft=None):
    """The proposer of ``config.method``; ``draft_model`` and ``mtp`` need the target's ``runner`` (a
    :class:`~tripath.engine.runner.model_runner.ModelRunner`, or under tensor parallelism a
    :class:`~tripath.engine.runner.parallel_executor.ParallelExecutor`) and its ``engine_config``.
    ``draft_model`` also needs ``vocab_size``, and takes the ``draft`` model when it is loaded already (else
    ``config.model`` is loaded); the draft runs unsharded on rank 0's device. ``mtp`` drafts with the runner's
    model's MTP layer and observes its launches; under tensor parallelism it runs on rank 0's runner and
    shares every MTP run with the workers."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from tripath.engine.runner.model_runner import ModelRunner   # the drafters' imports: only when one is asked for

    from tripath.engine.runner.parallel_executor import ParallelExecutor

    if not isinstance(runner, (ModelRunner, ParallelExecutor)):
        raise TypeError(f"speculative_config method {config.method!r} needs the target's ModelRunner or "
                        f"ParallelExecutor, got {type(runner).__name__}")
    if config.method == "mtp":
        from tripath.engine.drafters.mtp import MTPProposer
        from tripath.engine.runner.mtp_layer import share_over

        if isinstance(runner, ParallelExecutor):
            return MTPProposer(runner.model, runner.runner, engine_config, share_over(runner.control))
        return MTPProposer(runner.model, runner, engine_config)
    from tripath.engine.drafters.draft_model import DraftModelProposer

    return DraftModelProposer(config.model if draft is None else draft, engine_config, num_blocks=runner.num_blocks,
                              block_size=runner.block_size, max_model_len=runner.max_model_len,
                              vocab_size=vocab_size)
