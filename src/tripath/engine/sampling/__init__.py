"""How a step's tokens are drawn: a launch's sampling (``step_sampling.py``): ``logits_transforms.py``
(penalties, ``logit_bias``, ``min_tokens``, grammar masks from :mod:`tripath.engine.requests.structured_output`),
``sampler.py`` (temperature, min-p, top-k, top-p), ``logprobs.py``; ``fused_sampling.py`` (which steps draw
their tokens straight from the LM head); ``choices.py`` (``n`` / ``best_of``); and the model's
``generation_defaults.py`` (the defaults of unset sampling fields).
"""
