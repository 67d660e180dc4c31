"""The HTTP sides a core loop (:mod:`~tripath.server.transport.core_loop`) serves, as the loop sees each one
(:class:`Frontend`): where its commands arrive, where its messages go, and what the current pass of the
loop has for it. Two transports:

- **pipes** (the core in its own process): a command pipe's read end, whose frames the loop reads
  (:class:`~tripath.server.transport.core_wire.FrameReader`), and an update pipe's write end, written without
  blocking (:class:`~tripath.server.transport.core_wire.Outbox`: what the pipe cannot take yet waits, and is written as
  it drains);
- **a local channel** (the core on a thread of the HTTP process, :class:`LocalChannel`): commands queued by
  the client's thread, a wake pipe the loop polls beside the others; messages handed to the client's
  ``deliver`` on the loop's thread, as they are.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Callable

from tripath.server.transport.core_wire import READ_BYTES, FrameReader, Outbox


class LocalChannel:
    """An in-process client's link to a core loop on another thread: :meth:`put` queues a command and wakes
    the loop (a byte in a non-blocking pipe, ``wake_fd`` its read end); the loop :meth:`take` s the commands
    and hands its messages to ``deliver``."""

    def __init__(self, deliver: Callable[[object], None]):
        self.deliver = deliver
        self._commands: collections.deque = collections.deque()
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_write, False)

    def put(self, command) -> None:
        """(Any thread:) queue a command for the loop."""
        self._commands.append(command)
        with contextlib.suppress(BlockingIOError, OSError):   # full: a wake is pending anyway; closed: stopped
            os.write(self._wake_write, b"\0")

    def take(self) -> list:
        """(The loop:) the commands queued so far, in order."""
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self.wake_fd, READ_BYTES):
                pass
        commands = []
        while self._commands:
            commands.append(self._commands.popleft())
        return commands

    def close(self) -> None:
        for fd in (self.wake_fd, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)


class Frontend:
    """One HTTP side a core loop serves: ``commands``, the descriptor its commands arrive on (a pipe's read
    end, or a local channel's wake end); ``updates``, the pipe end its messages are written to (-1: none, or
    a local channel); ``local``, its :class:`LocalChannel` (None over pipes). Per pass of the loop: the ids
    added, the adds refused, the outputs and the failures for it; ``unsent``: what its pipe has not taken
    yet."""

    __slots__ = ("commands", "updates", "local", "frames", "accepted", "refused", "outputs", "failed",
                 "sent_stats", "sent_at", "unsent", "overflowed")

    def __init__(self, ends: tuple[int, int] | LocalChannel):
        if isinstance(ends, LocalChannel):
            self.local, self.commands, self.updates = ends, ends.wake_fd, -1
        else:
            self.local, (self.commands, self.updates) = None, ends
        self.frames = FrameReader()
        self.clear()
        self.sent_stats = None
        self.sent_at = float("-inf")
        self.unsent = Outbox(self.updates)
        self.overflowed = False   # its requests were ended for falling behind (unread updates)

    def read_commands(self) -> list | None:
        """The commands that have arrived (one read of a pipe, or the local queue); None once the sender is
        gone (its pipe's write end closed)."""
        if self.local is not None:
            return self.local.take()
        try:
            data = os.read(self.commands, READ_BYTES)
        except BlockingIOError:
            return []
        except OSError:
            data = b""
        if not data:
            return None
        return [command for batch in self.frames.feed(data) for command in batch]

    def has_items(self) -> bool:
        return bool(self.accepted or self.refused or self.outputs or self.failed)

    def clear(self) -> None:
        """Empty this pass's items: the ids added, the adds refused, the outputs, the failures."""
        self.accepted, self.refused, self.outputs, self.failed = [], [], [], []
