"""What :class:`~tripath.engine.llm.LLM` holds on entry: one thread at a time.

An engine is one scheduler over one KV cache: ``generate``, ``chat`` and ``stream`` take every output the
steps produce, and the step API (``add_request``, ``step``, ``abort_request``) changes the same queues. So
those calls hold :class:`EngineLock` (:func:`serialised`): called from several threads they run one after
the other, each whole; the thread holding the lock re-enters freely (``generate`` calls ``step``).
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class EngineLock:
    """A lock with an owner: the thread holding it may take it again (a no-op), others wait for it.

    Unlike :class:`threading.RLock` it may be released by another thread than the one that took it, so a
    generator that holds it (``LLM.stream``) can be closed, or collected, from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.owner: int | None = None   # the thread ident holding it

    def held_here(self) -> bool:
        return self.owner == threading.get_ident()

    def take(self) -> bool:
        """Take the lock, waiting while another thread holds it; False when this thread already holds it
        (then :meth:`release` must not be called for this take)."""
        if self.held_here():
            return False
        self._lock.acquire()
        self.owner = threading.get_ident()
        return True

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    def adopt(self) -> None:
        """The holder resumes in this thread (a generator iterated from another thread than the one that began
        it): later re-entries from here are no-ops."""
        self.owner = threading.get_ident()


def serialised(method: F) -> F:
    """``method`` holds the instance's ``_engine_lock`` (an :class:`EngineLock`) while it runs."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        lock: EngineLock = self._engine_lock
        taken = lock.take()
        try:
            return method(self, *args, **kwargs)
        finally:
            if taken:
                lock.release()

    return run  # type: ignore[return-value]
