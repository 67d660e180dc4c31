"""The serving engine: requests, scheduler, block manager (prefix caching), model runner, sampler, the engine
core and the LLM facade.

``LLM(model, ...).generate(prompts, SamplingParams(...))`` for offline batches; an
:class:`~tripath.engine.core.engine_core.EngineCore` (``add_request`` / ``step`` / ``abort``, ``info()``) for servers.
The engine owns no attention math: it plans each step and hands the backend one metadata.
"""

from tripath.engine.core.block_manager import BlockManager
from tripath.engine.config import EngineConfig
from tripath.engine.core.engine_core import EngineCore, StepFailure, StepResult
from tripath.engine.core.engine_info import EngineInfo
from tripath.engine.errors import StepFailed
from tripath.engine.llm import LLM, RunMetrics
from tripath.engine.core.request import CompletionOutput, FinishReason, Logprob, Request, RequestOutput, RequestStatus
from tripath.engine.sampling.sampling_params import SamplingParams
from tripath.engine.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = [
    "LLM", "RunMetrics", "EngineConfig", "SamplingParams", "Request", "RequestOutput", "CompletionOutput", "Logprob",
    "RequestStatus",
    "FinishReason", "Scheduler", "SchedulerOutput", "ScheduledRequest", "BlockManager",
    "StepFailed", "EngineCore", "EngineInfo", "StepResult", "StepFailure",
]
