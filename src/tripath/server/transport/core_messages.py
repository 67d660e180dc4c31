"""The messages between the HTTP side and the engine core's loop (:mod:`~tripath.server.transport.core_loop`), one
dataclass each. Over the process transport they cross the pipes pickled, in the frames of
:mod:`~tripath.server.transport.core_wire` (commands as a list per frame: whatever queued up in one pass of the
event loop); over the in-process transport (:mod:`~tripath.server.transport.in_process`) they are handed over as
they are.

Commands, HTTP side → core: :class:`Add` (or :class:`AddGroup`), :class:`Abort`, :class:`Stop`.
Messages, core → HTTP side: :class:`Ready` once the engine is built (or :class:`StartFailed`), then an
:class:`Update` per pass of the loop that produced anything for that HTTP side, and :class:`Stopped` when
the core is done with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tripath.engine.core.engine_info import EngineInfo
from tripath.engine.requests.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Add:
    """Add one engine request (the core refuses an id in flight already)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class AddGroup:
    """Add the engine requests of one HTTP request (its prompts × choices) together: the core takes all of
    them, or refuses all with one reason, so no request of a refused HTTP request ever runs."""

    requests: tuple[Add, ...]


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort one request of the sender's (nothing when it has ended, or is another HTTP side's)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    """The sender is done: its requests end (503); the core stops with its last HTTP side."""


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine is built: what it is (``info``), its start-up log line (``summary``) and how to get its
    tokenizer (``tokenizer``: :func:`~tripath.server.transport.core_wire.tokenizer_handle`, None for none)."""

    info: EngineInfo
    summary: str
    tokenizer: tuple | None


@dataclass(frozen=True, slots=True)
class StartFailed:
    """The engine could not be built (``message``: why); the core exits."""

    message: str


@dataclass(frozen=True, slots=True)
class Update:
    """What one pass of the core's loop produced for one HTTP side, of its own requests: the ids it added
    (``accepted``); ``(request_id, status, message, type, reason)`` of the adds it refused (``reason``: why,
    as ``/metrics`` counts the rejection, :class:`~tripath.server.transport.submissions.Failure`); the step's outputs
    (:func:`~tripath.server.transport.core_wire.encode_output` each; over a local channel the engine's
    :class:`~tripath.engine.requests.request.RequestOutput` themselves); ``(request_ids, status, message, type)``
    of each failure that ended requests; the engine's stats (:func:`~tripath.server.transport.core_wire.encode_stats`)
    and the number of steps that failed since the core started."""

    accepted: list[str]
    refused: list[tuple]
    outputs: list[tuple]
    failed: list[tuple]
    stats: tuple
    step_failures: int


@dataclass(frozen=True, slots=True)
class Stopped:
    """The core is done with this HTTP side: it has released the engine and is about to exit, or (several
    HTTP sides) has ended this one's requests after its :class:`Stop`."""
