"""What the server does with the engine itself, wherever the engine runs (the in-process thread of
:mod:`~tripath.server.engine_loop` or the core process of :mod:`~tripath.server.engine_core`): add a
request, take a step, close the engine and release its memory.

A refused add is a :class:`~tripath.server.submissions.Failure` (400 for a request the engine can never
serve, 500 for anything else). A step that raises fails exactly the requests it scheduled (``LLM.step``
aborts them, freeing their blocks, and names them in :class:`~tripath.engine.errors.StepFailed`): 503 when
the device ran out of memory (the scheduler then takes smaller steps), 500 otherwise; a failure outside a
step's run (in the scheduler) fails what was running, or else the queue. Either way the engine serves on.
"""

from __future__ import annotations

import gc
import logging
import traceback
from dataclasses import dataclass, field, replace

from tripath.engine.errors import StepFailed
from tripath.engine.request import FinishReason
from tripath.server.submissions import Failure

log = logging.getLogger("tripath.server")


def add_request(llm, request_id: str, prompt_token_ids: list[int], params, grammar=None) -> Failure | None:
    """Add one request (``grammar``: its structured output's compiled grammar, :mod:`~tripath.server.
    grammar_waits`); None when the engine took it, else why not."""
    try:
        if grammar is None:
            llm.add_request(prompt_token_ids, params, request_id=request_id)
        else:
            llm.add_request(prompt_token_ids, params, request_id=request_id, grammar=grammar)
    except (ValueError, TypeError, ImportError) as error:   # ImportError: structured output without xgrammar
        return Failure(400, str(error))
    except Exception as error:  # noqa: BLE001 - the request fails, the engine goes on
        log.error("adding a request failed:\n%s", traceback.format_exc())
        return Failure(500, f"adding the request failed: {type(error).__name__}: {error}", "server_error")
    return None


@dataclass
class StepResult:
    """One step: its outputs (``RequestOutput``), and the requests it failed with why (``failed``)."""

    outputs: list = field(default_factory=list)
    failed: list[tuple[list[str], Failure]] = field(default_factory=list)


def take_step(llm) -> StepResult:
    """``llm.step()``, its failure turned into the requests it failed (see the module doc). A request the
    step ended with an error (``FinishReason.ERROR``: a token its grammar does not allow) is failed with 400
    and its error, after the tokens the step gave it before that."""
    try:
        return _errors_as_failures(llm.step())
    except StepFailed as error:   # the step's requests were aborted: fail exactly those, serve the rest
        failure = Failure(503 if error.out_of_memory else 500, str(error), "server_error")
        result = _errors_as_failures(error.outputs)
        result.failed.append((list(error.request_ids), failure))
        return result
    except Exception as error:  # noqa: BLE001 - one failed step must not stop the server
        log.error("engine step failed:\n%s", traceback.format_exc())
        victims = [r.request_id for r in llm.scheduler.running] or [r.request_id for r in llm.scheduler.waiting]
        for request_id in victims:
            llm.abort_request(request_id)
        failure = Failure(500, f"the engine step failed: {type(error).__name__}: {error}", "server_error")
        return StepResult([], [(victims, failure)])


def prepare_grammars(llm) -> None:
    """Build the engine's structured-output compiler now, before the loop serves (scanning the tokenizer's
    vocabulary takes 0.1-0.2 s for 50K tokens, which the first structured request would otherwise cost every
    stream on the loop); nothing when the model has no tokenizer or xgrammar is missing (such requests are then
    refused with 400)."""
    try:
        llm.grammar_compiler()
    except (ValueError, TypeError, ImportError, AttributeError):
        pass


def close_engine(llm):
    """Stop ``llm``'s tensor-parallel workers (nothing for one rank); its device, for :func:`release_memory`."""
    close = getattr(llm, "close", None)
    if close is not None:
        close()
    return getattr(getattr(llm, "config", None), "device", None)


def release_memory(device) -> None:
    """Once the last reference to the engine is dropped: collect its reference cycles (the objects frozen at
    start are collectable again) and hand its GPU memory back."""
    gc.unfreeze()
    gc.collect()
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _errors_as_failures(outputs: list) -> StepResult:
    result = StepResult()
    for out in outputs:
        if out.finish_reason is not FinishReason.ERROR:
            result.outputs.append(out)
            continue
        if out.new_token_ids:
            result.outputs.append(replace(out, finished=False))
        result.failed.append(([out.request_id], Failure(400, out.outputs[0].error or "the request failed")))
    return result
