"""Engine cores that fail on cue, for the server's failure tests: top-level functions, so the engine core
process (spawned: ``make_engine`` is pickled to it) can build them as well as the in-process engine thread.

A step whose batch holds a prompt starting with :data:`POISON` raises ``RuntimeError("injected fault")``,
with :data:`OOM_POISON` a device out-of-memory error; adding the prompt :data:`ADD_POISON` raises in
``add_request`` (and ``add_requests``, for a request of several prompts or choices); ``slow_s`` sleeps that
long in every step."""

import time

import torch

POISON = [13, 13, 13]
OOM_POISON = [17, 17, 17]
ADD_POISON = [13, 13]


def faulty_llm(slow_s: float = 0.0, num_kv_blocks: int = 16):
    from tripath.engine.core.engine_core import EngineCore

    torch.set_num_threads(1)
    core = EngineCore("tiny-llama", backend="torch", num_kv_blocks=num_kv_blocks, detokenize=False)
    launch = core.runner.launch

    def faulty(scheduled, previous=None, num_steps=1):
        starts = [item.request.prompt_token_ids[:3] for item in scheduled]
        if POISON in starts:
            raise RuntimeError("injected fault")
        if OOM_POISON in starts:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        if slow_s:
            time.sleep(slow_s)
        return launch(scheduled, previous, num_steps)

    core.runner.launch = faulty
    add = core.add_request

    def faulty_add(prompt, params=None, request_id=None):
        if list(prompt) == ADD_POISON:
            raise RuntimeError("injected add fault")
        return add(prompt, params, request_id)

    core.add_request = faulty_add
    add_many = core.add_requests

    def faulty_add_many(requests):
        if any(list(prompt) == ADD_POISON for prompt, *_ in requests):
            raise RuntimeError("injected add fault")
        return add_many(requests)

    core.add_requests = faulty_add_many
    return core
