"""The engine core: :class:`~tripath.engine.core.engine_core.EngineCore` (``engine_core.py``) owns a model's
executor, its scheduler and block manager behind a typed face (``add_request``, ``abort``, ``step ->
StepResult``, ``stats``, ``info -> EngineInfo``); ``core_steps.py`` takes a step (schedule, launch, read;
overlap; every failure into one ``StepResult``); ``request.py`` is a request's token state and outputs;
``scheduler.py`` batches them under a token budget over ``block_manager.py``'s paged KV blocks (prefix
caching); ``step_pacing.py`` keeps a CPU step to a step time; ``engine_info.py`` and ``stats.py`` are what
the core tells its callers.
"""
