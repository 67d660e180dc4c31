"""Speculative decoding's proposers that run a model, above the runner they drive: a smaller draft model
(``draft_model.py``, a :class:`~tripath.engine.runner.model_runner.ModelRunner` of its own) and the target's
multi-token-prediction layer (``mtp.py``, which observes the target runner's launches); ``proposers.py``:
:func:`~tripath.engine.drafters.proposers.make_proposer`, the proposer of a
:class:`~tripath.engine.config.speculative.SpeculativeConfig` (the n-gram one included).
"""
