"""Adds that wait for their structured output's grammar, in the engine core's loop
(:mod:`~tripath.server.transport.core_loop`, in the core process or on a thread of the HTTP process).

A request with a structured output is not added to the engine when it arrives: its grammar compiles on the
engine's compiler threads (``GrammarCompiler.submit``) while the loop goes on stepping every other request,
and the request is added, with the compiled grammar, once the compile is done — or refused: 400 when the
constraint does not compile, or has not compiled within the compiler's ``timeout_s`` (``--grammar-compile-
timeout``). The engine requests of one HTTP request (an :class:`~tripath.server.transport.core_messages.AddGroup`)
wait as one: they are added together once every grammar of theirs has compiled, or all refused. The loop
learns that a compile is done through ``wake`` (called on the compiler's thread) and takes the settled waits
with :meth:`GrammarWaits.settled`, in the order they arrived.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

from tripath.server.transport.submissions import Failure


@dataclass(eq=False)
class GrammarWait:
    """The engine requests of one HTTP request waiting for their grammars: ``requests`` (the
    :class:`~tripath.server.transport.core_messages.Add` of each) and ``futures`` (each one's compile; a done
    future of None for one without a structured output), who sent them (``owner``: the loop's own handle) and
    when they stop waiting."""

    requests: list
    futures: list
    owner: object
    deadline: float

    @property
    def request_ids(self) -> list[str]:
        return [add.request_id for add in self.requests]


def _no_grammar() -> Future:
    done: Future = Future()
    done.set_result(None)
    return done


class GrammarWaits:
    """The requests of one engine loop that wait for their grammars (see the module doc). ``compiler``
    returns the engine's :class:`~tripath.engine.requests.structured_output.GrammarCompiler` (built on first use)."""

    def __init__(self, compiler: Callable[[], object], wake: Callable[[], None]):
        self._compiler = compiler
        self._wake = wake
        self._waits: dict[str, GrammarWait] = {}   # by request id: the requests of one group share their wait

    def __len__(self) -> int:
        """The engine requests waiting."""
        return len(self._waits)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waits

    def start(self, adds: Sequence, owner) -> Failure | None:
        """Start compiling the grammars of ``adds`` (one HTTP request's :class:`~tripath.server.transport.
        core_messages.Add`, at least one with a structured output); None, or why they are refused at once (no
        xgrammar, a model without a tokenizer)."""
        futures: list = []
        try:
            compiler = self._compiler()
            for add in adds:
                spec = add.params.structured_output
                futures.append(_no_grammar() if spec is None else compiler.submit(spec))
        except (ValueError, TypeError, ImportError) as error:
            self._drop(futures)
            return Failure(400, str(error))
        wait = GrammarWait(list(adds), futures, owner, time.monotonic() + compiler.timeout_s)
        for add in adds:
            self._waits[add.request_id] = wait
        for future in futures:
            future.add_done_callback(lambda _: self._wake())
        return None

    def cancel(self, request_id: str) -> GrammarWait | None:
        """Stop waiting for one request (its compile, if not started and no other request waits for it, is
        cancelled); its group's wait, or None."""
        wait = self._waits.pop(request_id, None)
        if wait is None:
            return None
        i = wait.request_ids.index(request_id)
        del wait.requests[i]
        self._drop([wait.futures.pop(i)])
        return wait

    def _drop(self, futures: list) -> None:
        """Cancel the compiles of ``futures`` that no request waits for any more."""
        waited = {id(f) for wait in set(self._waits.values()) for f in wait.futures}
        for future in futures:
            if id(future) not in waited:
                future.cancel()

    def owner(self, request_id: str):
        """Who sent a waiting request (the ``owner`` given to :meth:`start`)."""
        return self._waits[request_id].owner

    def cancel_all(self, owner=None) -> list[GrammarWait]:
        """Stop waiting for every request (of ``owner``, when given); their waits, whole, in arrival order."""
        out = [wait for wait in self._unique() if owner is None or wait.owner == owner]
        for wait in out:
            self._remove(wait)
            self._drop(wait.futures)
        return out

    def _unique(self) -> list[GrammarWait]:
        return list(dict.fromkeys(self._waits.values()))

    def _remove(self, wait: GrammarWait) -> None:
        for request_id in wait.request_ids:
            self._waits.pop(request_id, None)

    def seconds_to_deadline(self) -> float | None:
        """How long until the earliest wait times out (0 if one has), None with no waits."""
        if not self._waits:
            return None
        return max(0.0, min(w.deadline for w in self._waits.values()) - time.monotonic())

    def settled(self) -> list[tuple[GrammarWait, list | None, Failure | None]]:
        """The waits that are over (every compile done, one failed, or past the deadline), in arrival order, and
        no longer waiting: ``(wait, compiled grammars, None)`` to add (a grammar per request, None for one
        without), or ``(wait, None, failure)`` to refuse."""
        now = time.monotonic()
        out = []
        for wait in self._unique():
            done = [future for future in wait.futures if future.done()]
            failure = next(filter(None, map(_failure_of, done)), None)
            if failure is None and len(done) < len(wait.futures):
                if now < wait.deadline:
                    continue
                failure = Failure(
                    400, f"the structured output did not compile within {self._compiler().timeout_s:g} s (the "
                         "server's --grammar-compile-timeout); simplify the schema or grammar",
                    reason="grammar_timeout")
            self._remove(wait)
            if failure is not None:
                self._drop(wait.futures)
                out.append((wait, None, failure))
            else:
                out.append((wait, [future.result() for future in wait.futures], None))
        return out


def _failure_of(future: Future) -> Failure | None:
    """Why a done compile failed (a cancelled one: its request was withdrawn meanwhile), else None."""
    if future.cancelled():
        return Failure(400, "the structured output's compile was cancelled")
    error = future.exception()
    if error is None:
        return None
    if isinstance(error, (ValueError, TypeError)):
        return Failure(400, str(error))
    return Failure(500, f"compiling the structured output failed: {type(error).__name__}: {error}", "server_error")
