"""What runs a scheduled step on the model, and how it starts: the executor contract (``executor.py``); one
rank's :class:`~tripath.engine.runner.model_runner.ModelRunner` (a step's inputs in plan order, its route,
sampling, multi-step decoding; ``launched_step.py``, ``step_inputs.py``) and its CUDA graphs
(``decode_graphs.py``, ``verify_graphs.py``, ``mixed_graphs.py``); the start (``startup.py``: ``plan_memory``,
``allocate_kv_cache``, ``warm_up``, ``capture_graphs``, in order; ``warmup.py``, ``memory_plan.py``); tensor
parallelism (``parallel_executor.py`` on rank 0, ``worker.py`` on every rank).
"""
