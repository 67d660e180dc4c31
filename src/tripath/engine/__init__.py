"""The serving engine: requests, scheduler, block manager (prefix caching), model runner, sampler, the engine
core and the LLM facade.

``LLM(model, ...).generate(prompts, SamplingParams(...))`` for offline batches; an
:class:`~tripath.engine.core.engine_core.EngineCore` (``add_request`` / ``step`` / ``abort``, ``info()``) for
servers. The engine owns no attention math: it plans each step and hands the backend one metadata.

Its subpackages, each importing only the ones before it: :mod:`~tripath.engine.requests`,
:mod:`~tripath.engine.config`, :mod:`~tripath.engine.sampling`, :mod:`~tripath.engine.speculative`,
:mod:`~tripath.engine.scheduling`, :mod:`~tripath.engine.runner`, :mod:`~tripath.engine.drafters`,
:mod:`~tripath.engine.core`; this package's own modules (``llm.py``, ``llm_guards.py``, ``chat.py``,
``errors.py``) and the names below are over them all: no subpackage imports from them.
"""

from tripath.engine.config import EngineConfig
from tripath.engine.core.engine_core import EngineCore, StepFailure, StepResult
from tripath.engine.core.engine_info import EngineInfo
from tripath.engine.errors import StepFailed
from tripath.engine.llm import LLM, RunMetrics
from tripath.engine.requests.request import (CompletionOutput, FinishReason, Logprob, Request, RequestOutput,
                                             RequestStatus)
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.scheduling.block_manager import BlockManager
from tripath.engine.scheduling.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = [
    "LLM", "RunMetrics", "EngineConfig", "SamplingParams", "Request", "RequestOutput", "CompletionOutput", "Logprob",
    "RequestStatus",
    "FinishReason", "Scheduler", "SchedulerOutput", "ScheduledRequest", "BlockManager",
    "StepFailed", "EngineCore", "EngineInfo", "StepResult", "StepFailure",
]
