"""Adds that wait for their structured output's grammar, in the engine core's loop
(:mod:`~tripath.server.transport.core_loop`, in the core process or on a thread of the HTTP process).

A request with a structured output is not added to the engine when it arrives: its grammar compiles on the
engine's compiler threads (``GrammarCompiler.submit``) while the loop goes on stepping every other request,
and the request is added, with the compiled grammar, once the compile is done — or refused: 400 when the
constraint does not compile, or has not compiled within the compiler's ``timeout_s`` (``--grammar-compile-
timeout``). The loop learns that a compile is done through ``wake`` (called on the compiler's thread) and
takes the settled waits with :meth:`GrammarWaits.settled`, in the order they arrived.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from tripath.server.transport.submissions import Failure


@dataclass(eq=False)
class GrammarWait:
    """One request waiting for its grammar: what the engine will be given, who sent it (``owner``: the
    loop's own handle), the compile's future and when the request stops waiting."""

    request_id: str
    prompt_token_ids: list[int]
    params: object
    owner: object
    future: object
    deadline: float


class GrammarWaits:
    """The requests of one engine loop that wait for their grammars (see the module doc). ``compiler``
    returns the engine's :class:`~tripath.engine.requests.structured_output.GrammarCompiler` (built on first use)."""

    def __init__(self, compiler: Callable[[], object], wake: Callable[[], None]):
        self._compiler = compiler
        self._wake = wake
        self._waits: dict[str, GrammarWait] = {}

    def __len__(self) -> int:
        return len(self._waits)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waits

    def start(self, request_id: str, prompt_token_ids: list[int], params, owner) -> Failure | None:
        """Start compiling the grammar of ``params.structured_output``; None, or why the request is refused
        at once (no xgrammar, a model without a tokenizer)."""
        try:
            compiler = self._compiler()
            future = compiler.submit(params.structured_output)
        except (ValueError, TypeError, ImportError) as error:
            return Failure(400, str(error))
        wait = GrammarWait(request_id, prompt_token_ids, params, owner, future,
                           time.monotonic() + compiler.timeout_s)
        self._waits[request_id] = wait
        future.add_done_callback(lambda _: self._wake())
        return None

    def cancel(self, request_id: str) -> GrammarWait | None:
        """Stop waiting for one request (its compile, if not started and no other request waits for it, is
        cancelled); the wait, or None."""
        wait = self._waits.pop(request_id, None)
        if wait is not None:
            self._drop(wait.future)
        return wait

    def _drop(self, future) -> None:
        if all(other.future is not future for other in self._waits.values()):
            future.cancel()

    def owner(self, request_id: str):
        """Who sent a waiting request (the ``owner`` given to :meth:`start`)."""
        return self._waits[request_id].owner

    def cancel_all(self, owner=None) -> list[GrammarWait]:
        """Stop waiting for every request (of ``owner``, when given); the waits, in arrival order."""
        return [self.cancel(request_id) for request_id, wait in list(self._waits.items())
                if owner is None or wait.owner == owner]

    def seconds_to_deadline(self) -> float | None:
        """How long until the earliest wait times out (0 if one has), None with no waits."""
        if not self._waits:
            return None
        return max(0.0, min(w.deadline for w in self._waits.values()) - time.monotonic())

    def settled(self) -> list[tuple[GrammarWait, object, Failure | None]]:
        """The waits that are over, in arrival order, and no longer waiting: ``(wait, compiled grammar,
        None)`` to add, or ``(wait, None, failure)`` to refuse."""
        now = time.monotonic()
        out = []
        for request_id, wait in list(self._waits.items()):
            if wait.future.done():
                failure = None
                try:
                    compiled = wait.future.result()
                except (ValueError, TypeError) as error:
                    compiled, failure = None, Failure(400, str(error))
                except Exception as error:  # noqa: BLE001 - the request fails, the engine goes on
                    compiled, failure = None, Failure(500, f"compiling the structured output failed: "
                                                           f"{type(error).__name__}: {error}", "server_error")
            elif now >= wait.deadline:
                compiled, failure = None, Failure(
                    400, f"the structured output did not compile within {self._compiler().timeout_s:g} s (the "
                         "server's --grammar-compile-timeout); simplify the schema or grammar",
                    reason="grammar_timeout")
            else:
                continue
            del self._waits[request_id]
            if failure is not None:
                self._drop(wait.future)
            out.append((wait, compiled, failure))
        return out
