"""The handlers' side of an engine core, whichever transport carries its messages (its own process,
:class:`~tripath.server.transport.engine_client.EngineClient`; a thread of the HTTP process,
:class:`~tripath.server.transport.in_process.InProcessClient`): the submissions in flight
(:class:`~tripath.server.transport.submissions.SubmissionBook`), the engine's facts once it is
:class:`~tripath.server.transport.core_messages.Ready`, and each :class:`~tripath.server.transport.core_messages.Update` of
the core's loop turned into the handlers' items and the metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Callable, Sequence

from tripath.server.transport.core_messages import Add, AddGroup, Ready, Update
from tripath.server.transport.core_wire import decode_output, decode_stats
from tripath.server.metrics.metrics import ServerMetrics
from tripath.server.metrics.startup import cache_config
from tripath.server.transport.submissions import Failure, Submission, SubmissionBook

log = logging.getLogger("tripath.server")


class EngineFront(ABC):
    """What both clients share (see the module doc). The facts (``tokenizer`` ... ``generation_defaults``) are
    set once ready; ``startup_error``: the engine could not be built."""

    def __init__(self, metrics: ServerMetrics, on_fatal: Callable[[BaseException], None] | None = None):
        self.metrics = metrics
        self.request_id_prefix = "srv"   # engine request ids: prefix-n-choice
        self._on_fatal = on_fatal
        self._book = SubmissionBook(metrics)
        self._ready = threading.Event()
        self._settled = threading.Event()   # ready, or never going to be
        self._stopping = False
        self.tokenizer = None               # read-only to the handlers once ready
        self.vocab_size = 0
        self.max_model_len = 0
        self.max_num_seqs = 0
        self.generation_defaults: dict = {}
        self.startup_error: BaseException | None = None
        self._step_failures_seen = 0        # the core counts them since its start

    def submit(self, subs: Sequence[Submission]) -> None:
        """Send the engine requests of one HTTP request to the core, which takes them together or refuses them
        all (:class:`AddGroup`); each handler hears :data:`~tripath.server.transport.submissions.ACCEPTED` or
        its failure. Refused here at once when the engine is stopping or gone."""
        for sub in subs:
            self._book.register(sub)
        refusal = self._refusal()   # checked after registering: see SubmissionBook
        if refusal is not None:
            for sub in subs:
                self._book.refuse(sub.request_id, refusal)
            self._book.flush()
            return
        adds = tuple(Add(sub.request_id, sub.prompt_token_ids, sub.params) for sub in subs)
        self._send_command(adds[0] if len(adds) == 1 else AddGroup(adds))

    @abstractmethod
    def _refusal(self) -> Failure | None:
        """Why no request can be submitted now (stopping, the engine gone), or None."""

    @abstractmethod
    def _send_command(self, command) -> None:
        """Hand a command to the core's loop (over its pipe, or its local channel)."""

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._settled.wait(timeout)
        return self.ready

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._stopping

    def _take_facts(self, ready: Ready, tokenizer, speaks: bool = True) -> None:
        """The engine is built: its facts (``tokenizer``: this side's own), the metrics' engine info; ready.
        ``speaks``: log the start-up line at INFO (else DEBUG)."""
        info = ready.info
        self.tokenizer = tokenizer
        self.vocab_size, self.max_model_len, self.max_num_seqs = info.vocab_size, info.max_model_len, \
            info.max_num_seqs
        self.generation_defaults = dict(info.generation_defaults)
        self.metrics.engine_ready(info.max_model_len, cache_config(info))
        self._ready.set()
        self._settled.set()
        log.log(logging.INFO if speaks else logging.DEBUG, "engine ready: %s", ready.summary)

    def _outputs_of(self, update: Update) -> list:
        """An update's outputs as the handlers read them (:class:`~tripath.server.transport.core_wire.StepOutput`)."""
        return [decode_output(item) for item in update.outputs]

    def _take_update(self, update: Update) -> None:
        """Hand an update's items to the handlers (and the metrics), then to their event loops."""
        book = self._book
        for request_id in update.accepted:
            book.accept(request_id)
        for request_id, status, message, kind, reason in update.refused:
            book.refuse(request_id, Failure(status, message, kind, reason))
        num_new = book.outputs(self._outputs_of(update), time.perf_counter())
        if update.step_failures > self._step_failures_seen:
            self.metrics.step_failures.inc(update.step_failures - self._step_failures_seen)
            self._step_failures_seen = update.step_failures
        for request_ids, status, message, kind in update.failed:
            book.fail(request_ids, Failure(status, message, kind))
        book.publish(decode_stats(update.stats), num_new)
        book.flush()
