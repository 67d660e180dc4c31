"""A request's vocabulary, under every other part of the engine: what it asks (``sampling_params.py``:
:class:`~tripath.engine.requests.sampling_params.SamplingParams` and the checks of its token ids;
``structured_output.py``: a constraint on its output, compiled and matched through xgrammar) and what the
engine keeps of it and returns (``request.py``: :class:`~tripath.engine.requests.request.Request`'s token
state and timings, ``RequestOutput``, ``FinishReason``, logprobs).
"""
