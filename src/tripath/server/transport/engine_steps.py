"""What the core loop (:mod:`~tripath.server.transport.core_loop`) does with the engine core itself, wherever it runs
(the core process or a thread of the HTTP process): add a request, take a step, close the engine and
release its memory. The engine is an
:class:`~tripath.engine.core.engine_core.EngineCore`, used through its typed methods only.

A refused add is a :class:`~tripath.server.transport.submissions.Failure` (400 for a request the engine can never
serve, 500 for anything else). A step reports its failure in its :class:`~tripath.engine.core.engine_core.StepResult`
with the requests it aborted (the engine serves on): they fail with 503 when the device ran out of memory
(the scheduler then takes smaller steps), 500 otherwise. A request the step ended with an error
(``FinishReason.ERROR``: a token its grammar does not allow) fails with 400.
"""

from __future__ import annotations

import gc
import logging
import traceback
from dataclasses import dataclass, field, replace

from tripath.engine.core.engine_core import EngineCore
from tripath.engine.requests.request import FinishReason
from tripath.server.transport.submissions import Failure

log = logging.getLogger("tripath.server")


def add_requests(core: EngineCore, requests: list[tuple]) -> Failure | None:
    """Add requests together or none of them: ``requests`` as ``(request_id, prompt_token_ids, params,
    grammar)`` (``grammar``: the structured output's compiled grammar, :mod:`~tripath.server.transport.
    grammar_waits`, or None); None when the engine took them, else why not."""
    try:
        if len(requests) == 1:
            request_id, prompt_token_ids, params, grammar = requests[0]
            if grammar is None:
                core.add_request(prompt_token_ids, params, request_id=request_id)
            else:
                core.add_request(prompt_token_ids, params, request_id=request_id, grammar=grammar)
        else:
            core.add_requests([(ids, params, request_id, grammar) for request_id, ids, params, grammar in requests])
    except (ValueError, TypeError, ImportError) as error:   # ImportError: structured output without xgrammar
        return Failure(400, str(error))
    except Exception as error:  # noqa: BLE001 - the request fails, the engine goes on
        log.error("adding a request failed:\n%s", traceback.format_exc())
        return Failure(500, f"adding the request failed: {type(error).__name__}: {error}", "server_error")
    return None


@dataclass
class StepOutcome:
    """One step as the server answers it: its outputs (``RequestOutput``), and the requests it failed with
    why (``failed``)."""

    outputs: list = field(default_factory=list)
    failed: list[tuple[list[str], Failure]] = field(default_factory=list)


def take_step(core: EngineCore, decode_steps: int | None = None) -> StepOutcome:
    """``core.step(decode_steps)``, its failure and the requests it ended with an error as the server's
    failures (see the module doc): those requests' tokens before the error are still delivered."""
    result = core.step(decode_steps)
    answer = StepOutcome()
    for out in result.outputs:
        if out.finish_reason is not FinishReason.ERROR:
            answer.outputs.append(out)
            continue
        if out.new_token_ids:
            answer.outputs.append(replace(out, finished=False))
        answer.failed.append(([out.request_id], Failure(400, out.outputs[0].error or "the request failed")))
    failure = result.failure
    if failure is not None:
        answer.failed.append((list(failure.request_ids),
                              Failure(503 if failure.out_of_memory else 500, failure.message, "server_error")))
    return answer


def prepare_grammars(core: EngineCore) -> None:
    """Build the engine's structured-output compiler now, before the loop serves (scanning the tokenizer's
    vocabulary takes 0.1-0.2 s for 50K tokens, which the first structured request would otherwise cost every
    stream on the loop); nothing when the model has no tokenizer or xgrammar is missing (such requests are then
    refused with 400)."""
    try:
        core.grammar_compiler()
    except (ValueError, TypeError, ImportError, AttributeError):
        pass


def close_engine(core: EngineCore) -> str:
    """Stop the engine's tensor-parallel workers (nothing for one rank); its device, for :func:`release_memory`."""
    device = core.info().device
    core.close()
    return device


def release_memory(device: str | None) -> None:
    """Once the last reference to the engine is dropped: collect its reference cycles (the objects frozen at
    start are collectable again) and hand its GPU memory back (``device``: the engine's, ``cuda:0``)."""
    gc.unfreeze()
    gc.collect()
    if device is not None and device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
