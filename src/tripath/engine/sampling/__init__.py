"""What a request asks of the sampler and how a step's tokens are drawn: ``sampling_params.py``
(:class:`SamplingParams`) and the model's ``generation_defaults.py``; a launch's sampling
(``step_sampling.py``): ``logits_transforms.py`` (penalties, ``logit_bias``, ``min_tokens``, grammar masks
from ``structured_output.py``), ``sampler.py`` (temperature, min-p, top-k, top-p), ``logprobs.py``; and
``choices.py`` (``n`` / ``best_of``).
"""
