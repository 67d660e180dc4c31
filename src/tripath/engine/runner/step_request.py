"""The part of a request a :class:`~tripath.engine.runner.model_runner.ModelRunner` reads, for steps whose
requests are not the engine's own: a tensor-parallel worker's (rebuilt from rank 0's step messages,
:mod:`tripath.engine.runner.worker`) and the rows a drafter runs on its own cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tripath.engine.requests.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class StepRequest:
    """The part of a :class:`~tripath.engine.requests.request.Request` a ModelRunner reads, rebuilt from a step
    message."""

    num_tokens: int
    block_ids: list[int]
    start: int
    new_token_ids: list[int]
    sampling_params: SamplingParams = GREEDY
    generator: torch.Generator | None = None
    sampling_seed: int | None = None   # the draw's noise key, on steps drawn without logits
    grammar: None = None   # workers sample nothing (rank 0's samples are the engine's); drafts sample greedily

    def token_ids(self, start: int, stop: int) -> list[int]:
        return self.new_token_ids[start - self.start:stop - self.start]

    def token_array(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.token_ids(start, stop), dtype=np.int64)
