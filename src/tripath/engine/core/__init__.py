"""The engine core: :class:`~tripath.engine.core.engine_core.EngineCore` (``engine_core.py``) owns a model's
executor, its scheduler and block manager (:mod:`tripath.engine.scheduling`) and its speculative proposer
(:mod:`tripath.engine.drafters`) behind a typed face (``add_request``, ``abort``, ``step -> StepResult``,
``stats``, ``info -> EngineInfo``); ``core_steps.py`` takes a step (schedule, launch, read; overlap; every
failure into one ``StepResult``); ``engine_info.py`` is what the core tells its callers about itself.
"""
