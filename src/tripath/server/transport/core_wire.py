"""How messages cross the pipes between the HTTP process and the engine core process, and what an update's
items look like.

Transport: two one-way pipes (commands to the core, updates from it; ``multiprocessing`` pipes, whose
descriptors the spawned core inherits), each message one frame: its length (8 bytes, big-endian) and a
``pickle`` of the message (:func:`frame`, :class:`FrameReader`): a dataclass of
:mod:`~tripath.server.transport.core_messages` — commands as a list per frame (the writer sends what has queued up in
one go) —, whose items are plain tuples and lists (:func:`encode_output`, :func:`encode_stats`). The core
reads and writes its ends blocking (:func:`send`, :meth:`FrameReader.receive`) or through an
:class:`Outbox`; the HTTP process reads and writes its ends from its event loop, non-blocking
(:mod:`~tripath.server.transport.engine_client`), so no thread of it waits on a pipe and no message waits for a thread
to get the interpreter lock. A step's update (256 outputs of 8 tokens: 12 KiB) is pickled, sent and read
in far less time than a step takes, and a pipe streams many times the messages a server needs (at most one
per step); ``python -m tripath.bench.core_transport`` measures it (docs/BENCHMARKS.md, "Measurements behind
the code's choices", with ZeroMQ and msgspec's msgpack beside it). Neither of those is a dependency the
server has, and neither tells the HTTP process that the core died: a pipe's reader gets EOF the moment its
writer's process is gone, whatever killed it.
"""
from __future__ import annotations

import fcntl
import os
import pickle
import struct
from dataclasses import fields

from tripath.engine.requests.request import FinishReason, Logprob, PositionLogprobs
from tripath.engine.scheduling.stats import EngineStats

PIPE_BYTES = 1 << 20   # Linux's default /proc/sys/fs/pipe-max-size: a step's update never waits for the reader
_STATS_FIELDS = tuple(f.name for f in fields(EngineStats))
_FINISH = {reason.value: reason for reason in FinishReason}


_LENGTH = struct.Struct("!Q")
READ_BYTES = 1 << 18   # the most one read takes from a pipe


def frame(message) -> bytes:
    """One message as it crosses a pipe: its pickle's length, then the pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


def send(fd: int, message) -> None:
    """Write one message to a blocking pipe end (``BrokenPipeError`` once its reader is gone)."""
    write_all(fd, frame(message))


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to a blocking descriptor (a pipe may take a large write in parts)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Outbox:
    """Whole frames for a non-blocking pipe end, written as the pipe takes them: :meth:`put` queues a message
    (or a frame), :meth:`write` writes what the pipe takes now and says whether bytes still wait — while they
    do, the owner watches the end for room and writes again. ``OSError`` (``BrokenPipeError``) from
    :meth:`write` once the reader is gone."""

    def __init__(self, fd: int):
        self.fd = fd
        self._unsent = bytearray()

    def __len__(self) -> int:
        return len(self._unsent)

    def put(self, message) -> None:
        self._unsent += frame(message)

    def put_frame(self, data: bytes) -> None:
        self._unsent += data

    def write(self) -> bool:
        try:
            while self._unsent:
                del self._unsent[:os.write(self.fd, self._unsent)]
        except BlockingIOError:
            pass
        return bool(self._unsent)

    def clear(self) -> None:
        self._unsent.clear()


class FrameReader:
    """The messages of a pipe end's byte stream. :meth:`feed` takes bytes as they arrive (a non-blocking
    reader's); :meth:`receive` reads a blocking end until at least one whole message is in."""

    def __init__(self):
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list:
        """Add the bytes read; the messages they complete, in order."""
        buffer = self._buffer
        buffer += data
        messages, start = [], 0
        while len(buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, start)
            end = start + _LENGTH.size + length
            if len(buffer) < end:
                break
            messages.append(pickle.loads(bytes(buffer[start + _LENGTH.size:end])))
            start = end
        del buffer[:start]
        return messages

    def receive(self, fd: int) -> list:
        """The next messages of a blocking end (waits for the first); ``EOFError`` once its writer is gone."""
        while True:
            data = os.read(fd, READ_BYTES)
            if not data:
                raise EOFError("the pipe's writer has closed it")
            messages = self.feed(data)
            if messages:
                return messages


def widen(conn) -> None:
    """Grow a pipe's buffer to :data:`PIPE_BYTES` where the system allows (Linux), so a writer seldom waits."""
    try:
        fcntl.fcntl(conn.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:   # not a pipe, not Linux, or above the system's limit: the default buffer does
        pass


class StepOutput:
    """One request's output of a step, as the HTTP process reads it (the fields of
    :class:`~tripath.engine.RequestOutput` the handlers and the metrics use; ``queue_time`` and
    ``prefill_time`` only on the output that brings the request's first tokens, else None)."""

    __slots__ = ("request_id", "new_token_ids", "finished", "finish_reason", "new_logprobs", "prompt_logprobs",
                 "queue_time", "prefill_time")

    def __init__(self, request_id: str, new_token_ids: list[int], finished: bool,
                 finish_reason: FinishReason | None, new_logprobs: list[PositionLogprobs] | None = None,
                 prompt_logprobs: list[PositionLogprobs | None] | None = None, queue_time: float | None = None,
                 prefill_time: float | None = None):
        self.request_id, self.new_token_ids, self.finished = request_id, new_token_ids, finished
        self.finish_reason, self.new_logprobs, self.prompt_logprobs = finish_reason, new_logprobs, prompt_logprobs
        self.queue_time, self.prefill_time = queue_time, prefill_time


def encode_logprobs(positions) -> list[tuple | None] | None:
    """Log-probabilities of positions as plain tuples: ``(token, logprob, rank, token, logprob, rank, ...)``
    per position (None stays None: the first prompt token has none)."""
    if positions is None:
        return None
    return [None if entry is None else
            tuple(x for token, lp in entry.items() for x in (token, lp.logprob, lp.rank)) for entry in positions]


def decode_logprobs(positions) -> list[PositionLogprobs | None] | None:
    if positions is None:
        return None
    return [None if flat is None else {flat[i]: Logprob(flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)}
            for flat in positions]


def encode_output(out, with_prompt_logprobs: bool) -> tuple:
    """A :class:`~tripath.engine.RequestOutput` as a tuple; its prompt's log-probabilities only when
    ``with_prompt_logprobs`` (the first output that has them: they do not change afterwards); the engine's
    ``(queue_time, prefill_time)`` only when it brings the request's first tokens (None otherwise)."""
    reason, new = out.finish_reason, out.new_token_ids
    first = bool(new) and len(out.outputs[0].token_ids) == len(new) and out.queue_time is not None
    return (out.request_id, new, out.finished, None if reason is None else reason.value,
            encode_logprobs(out.new_logprobs), encode_logprobs(out.prompt_logprobs) if with_prompt_logprobs else None,
            (out.queue_time, out.prefill_time) if first else None)


def decode_output(item: tuple) -> StepOutput:
    request_id, tokens, finished, reason, logprobs, prompt_logprobs, times = item
    queue_time, prefill_time = times if times is not None else (None, None)
    return StepOutput(request_id, tokens, finished, None if reason is None else _FINISH[reason],
                      decode_logprobs(logprobs), decode_logprobs(prompt_logprobs), queue_time, prefill_time)


def encode_stats(stats: EngineStats) -> tuple:
    return tuple(getattr(stats, name) for name in _STATS_FIELDS)


def decode_stats(values: tuple) -> EngineStats:
    return EngineStats(*values)


def tokenizer_handle(tokenizer) -> tuple | None:
    """How the HTTP process gets the engine's tokenizer without loading the weights: ``("path", directory)``
    to load with :func:`tripath.models.load_tokenizer` (a Hugging Face tokenizer loaded from a directory),
    else ``("object", tokenizer)`` pickled whole; None for none."""
    if tokenizer is None:
        return None
    path = getattr(tokenizer, "name_or_path", None)
    if isinstance(path, str) and path and os.path.isdir(path):
        return ("path", path)
    return ("object", tokenizer)


def load_tokenizer_handle(handle: tuple | None):
    if handle is None:
        return None
    kind, value = handle
    if kind == "object":
        return value
    from tripath.models import load_tokenizer

    return load_tokenizer(value)
