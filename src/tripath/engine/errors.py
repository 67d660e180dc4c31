"""Exceptions the engine raises to its callers (importable without loading the engine)."""

from __future__ import annotations

import torch


class StepFailed(RuntimeError):
    """A step raised; the requests it scheduled (``request_ids``) were aborted, their blocks freed, and the
    engine serves on. ``outputs``: what the step before it (overlapped scheduling) produced, read before the
    failure was raised: deliver them as usual. ``cause``: the exception's type name; ``out_of_memory``:
    whether it was a device out-of-memory error, after which the scheduler takes fewer tokens a step
    (:meth:`Scheduler.shrink_token_budget`)."""

    def __init__(self, message: str, request_ids: list[str], cause: BaseException,
                 outputs: list | None = None):
        super().__init__(message)
        self.request_ids = request_ids
        self.cause = type(cause).__name__
        self.out_of_memory = isinstance(cause, torch.OutOfMemoryError)
        self.outputs = outputs or []
