"""The engine core's loop (:class:`CoreLoop`): it owns one built :class:`~tripath.engine.core.engine_core.EngineCore`, and
only schedules and steps, for every HTTP side of ``tripath serve``, whichever the transport: the core process
(:mod:`~tripath.server.transport.core_process`, pipes to one HTTP process or, with ``--api-server-count``, several:
:mod:`~tripath.server.processes.api_servers`) or a thread of the HTTP process (:mod:`~tripath.server.transport.in_process`, a
local channel). The HTTP sides tokenise, validate, detokenise and frame the streams.

The loop tells every HTTP side the engine is :class:`~tripath.server.transport.core_messages.Ready` (its
:class:`~tripath.engine.core.engine_info.EngineInfo`), then loops: take every command that has arrived from any
of them (:mod:`~tripath.server.transport.core_messages`: adds, aborts, stop) — waiting for one only while nothing
runs —, take a step (:mod:`~tripath.server.transport.engine_steps`), and send each HTTP side ONE
:class:`~tripath.server.transport.core_messages.Update` with what that pass produced for its requests: the adds it
took or refused, every output of the step (new tokens, finish, new log-probabilities, prompt
log-probabilities once), the requests a failed step failed, and ``EngineCore.stats()``. An HTTP side with
nothing in a pass gets the stats alone at most every :data:`STATS_REFRESH_S`, and at once when the engine
goes idle. The engine does not decode finished outputs here (``EngineCore(detokenize=False)`` in the core
process): the HTTP sides detokenise. With several HTTP processes each bounds its own requests and the loop
bounds the engine's waiting queue for all (``max_waiting``, ``CoreSpec.max_waiting``). The engine requests of
one HTTP request (its prompts × choices, an :class:`~tripath.server.transport.core_messages.AddGroup`) are taken
together or refused together: none of a refused HTTP request ever runs.

No request and no HTTP side holds the loop up. A request with a structured output waits for its grammar
off the loop (:mod:`~tripath.server.transport.grammar_waits`: compiled on the engine's compiler threads, added once
compiled, refused past ``--grammar-compile-timeout``), the loop waking when a compile is done. Updates are
written to a pipe without blocking: what an HTTP process's pipe cannot take yet waits in that process's own
buffer and is written as the pipe drains (the loop watches it), so an HTTP process whose event loop stalls
pauses no other's streams; once :data:`MAX_UNSENT_BYTES` wait for it, its requests end (503) and it reads
why after the rest.

While requests arrive the loop decodes one step at a time: an add that finds a group of multi-step decode
steps launched waits for it (and, with overlapped scheduling, for the group after it), and on a server
whose streams end and restart together the adds of one round reach the core spread over much longer than a
step (the round's prefills stagger the streams' ends). Once no request has arrived for
:data:`ARRIVAL_WINDOW_S` the engine's ``decode_steps`` apply again (``EngineCore.step(decode_steps=1)``
meanwhile; offline, ``LLM.generate`` adds its requests at step boundaries and keeps them). Measured against
no window, the window's gain is within the noise of a run (docs/BENCHMARKS.md).

Each HTTP side drains at its stop, then sends :class:`~tripath.server.transport.core_messages.Stop`, which ends what it
still has in the engine (503) and, while others serve on, answers
:class:`~tripath.server.transport.core_messages.Stopped` at once. An HTTP process that is gone (its end of the command
pipe closes) has its requests aborted. The loop stops, releasing the engine, at the last HTTP side's
``Stop`` or exit, then says ``Stopped`` to whoever is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
import traceback
from typing import Callable, Sequence

from tripath.engine.core.engine_core import EngineCore
from tripath.engine.core.engine_info import EngineInfo
from tripath.server.transport.core_frontends import Frontend, LocalChannel
from tripath.server.transport.core_messages import Abort, Add, AddGroup, Ready, Stop, Stopped, Update
from tripath.server.transport.core_wire import READ_BYTES, encode_output, encode_stats, tokenizer_handle
from tripath.server.transport.engine_steps import add_requests, close_engine, release_memory, take_step
from tripath.server.transport.grammar_waits import GrammarWaits
from tripath.server.transport.submissions import Failure

log = logging.getLogger("tripath.server")

ARRIVAL_WINDOW_S = 0.01   # decode one step at a time until no request has arrived for this long (module doc)
STATS_REFRESH_S = 0.05    # how old the engine's stats may get at an HTTP process that has nothing else to read
MAX_UNSENT_BYTES = 64 << 20   # updates an HTTP process may leave unread before its requests are ended
FINAL_FLUSH_S = 5.0       # at stop, how long the core waits for the HTTP processes to read their last updates


class CoreLoop:
    """The loop over one built engine core (see the module doc). ``frontends``: per HTTP side, the
    ``(commands, updates)`` file descriptors of its pipe ends (the update ends are made non-blocking; -1: not
    used) or a :class:`~tripath.server.transport.core_frontends.LocalChannel`; ``max_waiting``: with several, the most
    requests the engine may hold waiting (an add beyond it is refused with 503, see :meth:`_overloaded`), None for
    no bound here;
    ``describe(info)``: the start-up log line sent with :class:`Ready`."""

    def __init__(self, core: EngineCore, frontends: Sequence[tuple[int, int] | LocalChannel],
                 max_waiting: int | None = None, describe: Callable[[EngineInfo], str] | None = None):
        self.core = core
        self._describe = describe
        self._frontends = [Frontend(ends) for ends in frontends]
        self._open = set(range(len(self._frontends)))
        self._poller = select.poll()
        self._by_fd: dict[int, int] = {}          # a command pipe's descriptor -> its frontend
        self._by_update_fd: dict[int, int] = {}   # an update pipe watched for room -> its frontend
        for index, frontend in enumerate(self._frontends):
            if frontend.commands >= 0:
                self._poller.register(frontend.commands, select.POLLIN)
                self._by_fd[frontend.commands] = index
            if frontend.updates >= 0:
                os.set_blocking(frontend.updates, False)
        self._wake_read, self._wake_write = os.pipe()   # a grammar compile is done
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._poller.register(self._wake_read, select.POLLIN)
        self._grammars = GrammarWaits(lambda: self.core.grammar_compiler(), self._wake)
        self._max_waiting = max_waiting
        self._live: dict[str, list] = {}   # request id -> [its frontend, its prompt's log-probabilities were sent]
        self._step_failures = 0            # since start
        self._stopping = False
        self._last_arrival = float("-inf")

    def run(self) -> None:
        """Tell every HTTP side the engine is :class:`Ready`, then serve until stopped and release the
        engine."""
        info, tokenizer = self.core.info(), self.core.tokenizer
        summary = ""
        if self._describe is not None:
            try:
                summary = self._describe(info)
            except Exception:  # noqa: BLE001 - a log line; the engine serves without it
                log.error("describing the engine failed:\n%s", traceback.format_exc())
        shipped = tokenizer_handle(tokenizer)   # a directory to load, or the object pickled
        for index, frontend in enumerate(self._frontends):   # one that is gone already is detached here
            handle = shipped if frontend.local is None or tokenizer is None else ("object", tokenizer)
            self._send(index, Ready(info, summary, handle))
        try:
            self._send_updates()   # the engine's stats, before any request
            while not self._stopping:
                try:
                    self._receive(block=not self.core.has_unfinished_requests())
                    self._add_compiled()
                    if not self._stopping and self.core.has_unfinished_requests():
                        self._step()
                except Exception as error:  # noqa: BLE001 - never leave requests hanging on a dead loop
                    log.error("the engine loop failed:\n%s", traceback.format_exc())
                    self._fail_all(f"the engine failed: {type(error).__name__}: {error}")
                self._send_updates()
            self._fail_all("the server is shutting down", 503)
            self._send_updates(final=True)
        finally:
            self._release()
        for index in list(self._open):
            self._send(index, Stopped())
        self._flush_before_exit()

    # ---- commands -------------------------------------------------------------------------------------------
    def _receive(self, block: bool) -> None:
        """Handle every command that has arrived (waiting for the first when ``block``, or until a grammar's
        compile is done or due); write what waits for room in an update pipe that has some."""
        timeout = self._block_ms() if block else 0
        while self._open and not self._stopping:
            events = self._poller.poll(timeout)
            if not events:
                return
            timeout = 0
            for fd, event in events:
                if fd == self._wake_read:
                    with contextlib.suppress(BlockingIOError):
                        os.read(fd, READ_BYTES)
                    continue
                if fd in self._by_update_fd:
                    self._flush(self._by_update_fd[fd], event)
                    continue
                index = self._by_fd.get(fd)
                if index is None:
                    continue
                commands = self._frontends[index].read_commands()
                if commands is None:   # that HTTP process is gone: nobody to answer
                    self._detach(index)
                    continue
                for command in commands:
                    self._handle(index, command)

    def _block_ms(self) -> int | None:
        """How long an idle engine waits for a command: until the next grammar is due, else for ever."""
        due = self._grammars.seconds_to_deadline()
        return None if due is None else int(due * 1000) + 1

    def _wake(self) -> None:
        """(A compiler thread:) a grammar's compile is done; the loop takes it at its next pass."""
        with contextlib.suppress(BlockingIOError, OSError):   # full: a wake is pending anyway; closed: stopping
            os.write(self._wake_write, b"\0")

    def _handle(self, index: int, command: Add | AddGroup | Abort | Stop) -> None:
        if isinstance(command, (Add, AddGroup)):
            self._add(index, command.requests if isinstance(command, AddGroup) else (command,))
        elif isinstance(command, Abort):
            request_id = command.request_id
            entry = self._live.get(request_id)
            if entry is not None and entry[0] == index:
                del self._live[request_id]
                self.core.abort(request_id)
            elif request_id in self._grammars and self._grammars.owner(request_id) == index:
                self._grammars.cancel(request_id)
        elif isinstance(command, Stop):
            if len(self._open) > 1:   # the others serve on: this one's requests end, it hears no more
                self._end_requests_of(index, "the server is shutting down", 503)
                self._send_update(index, time.monotonic())
                self._send(index, Stopped())
                self._forget(index)
            else:
                self._stopping = True
        else:
            log.warning("the engine core ignores an unknown command: %r", command)

    def _add(self, index: int, adds: Sequence[Add]) -> None:
        """Add one HTTP request's engine requests together (at once, or once their grammars have compiled),
        or refuse them all with one reason."""
        ids = [add.request_id for add in adds]
        taken = next((i for i in ids if i in self._live or i in self._grammars), None)
        if taken is None and len(set(ids)) < len(ids):
            taken = next(i for i in ids if ids.count(i) > 1)
        failure = self._overloaded(len(adds)) if taken is None else \
            Failure(400, f"request id {taken!r} is in flight already", reason="duplicate_request_id")
        if failure is None and any(add.params.structured_output is not None for add in adds):
            failure = self._grammars.start(adds, index)
            if failure is None:
                return   # added once its grammars have compiled (_add_compiled)
        if failure is None:
            failure = add_requests(self.core, [(a.request_id, a.prompt_token_ids, a.params, None) for a in adds])
        self._added(index, ids, failure)

    def _added(self, index: int, request_ids: list[str], failure: Failure | None) -> None:
        frontend = self._frontends[index]
        if failure is None:
            for request_id in request_ids:
                self._live[request_id] = [index, False]
            frontend.accepted.extend(request_ids)
            self._last_arrival = time.monotonic()
        else:
            frontend.refused.extend((request_id, failure.status, failure.message, failure.type, failure.reason)
                                    for request_id in request_ids)

    def _add_compiled(self) -> None:
        """Add the requests whose grammars have compiled; refuse those whose compile failed or is overdue."""
        for wait, grammars, failure in self._grammars.settled():
            if wait.owner not in self._open or not wait.requests:
                continue
            if failure is None:
                failure = add_requests(self.core, [(a.request_id, a.prompt_token_ids, a.params, grammar)
                                                   for a, grammar in zip(wait.requests, grammars)])
            self._added(wait.owner, wait.request_ids, failure)

    def _overloaded(self, count: int) -> Failure | None:
        """Why ``count`` more engine requests (one HTTP request's) may not wait now, or None: the bound of
        ``max_waiting``, which one HTTP request of more engine requests than it passes only into an empty
        queue (the HTTP side refuses one that could never run)."""
        if self._max_waiting is None:
            return None
        waiting = self.core.num_waiting + len(self._grammars)
        if waiting == 0 or waiting + count <= self._max_waiting:
            return None
        return Failure(503, f"the server is overloaded: {waiting} engine requests wait for a place in the batch "
                            f"(--max-queue-depth {self._max_waiting}); retry later", "server_error", "queue_full")

    # ---- steps ----------------------------------------------------------------------------------------------
    def _step(self) -> None:
        arriving = time.monotonic() - self._last_arrival < ARRIVAL_WINDOW_S
        result = take_step(self.core, 1 if arriving else None)
        live, frontends = self._live, self._frontends
        for out in result.outputs:
            entry = live.get(out.request_id)
            if entry is None:
                continue   # aborted since the step was launched
            first_prompt_logprobs = not entry[1] and out.prompt_logprobs is not None
            frontend = frontends[entry[0]]   # in process the outputs are handed over as they are
            frontend.outputs.append(out if frontend.local is not None else encode_output(out, first_prompt_logprobs))
            if out.finished:
                del live[out.request_id]
            elif first_prompt_logprobs:
                entry[1] = True
        if any(failure.status >= 500 for _, failure in result.failed):
            self._step_failures += 1
        for request_ids, failure in result.failed:
            by_frontend: dict[int, list[str]] = {}
            for request_id in request_ids:
                entry = live.pop(request_id, None)
                if entry is not None:
                    by_frontend.setdefault(entry[0], []).append(request_id)
            for index, ids in by_frontend.items():
                frontends[index].failed.append((ids, failure.status, failure.message, failure.type))

    def _end_requests_of(self, index: int | None, message: str, status: int) -> None:
        """Abort the requests of one frontend (``index``), or of all (None), failing them with ``message``
        (those waiting for their grammars too)."""
        by_frontend: dict[int, list[str]] = {}
        for request_id, entry in list(self._live.items()):
            if index is None or entry[0] == index:
                del self._live[request_id]
                self.core.abort(request_id)
                by_frontend.setdefault(entry[0], []).append(request_id)
        for wait in self._grammars.cancel_all(owner=index):
            by_frontend.setdefault(wait.owner, []).extend(wait.request_ids)
        for owner, ids in by_frontend.items():
            self._frontends[owner].failed.append((ids, status, message, "server_error"))

    def _fail_all(self, message: str, status: int = 500) -> None:
        self._end_requests_of(None, message, status)

    # ---- updates --------------------------------------------------------------------------------------------
    def _send_updates(self, final: bool = False) -> None:
        """Each frontend's update of this pass: to one with items; with the engine's stats alone to one whose
        stats are :data:`STATS_REFRESH_S` old, or at once when the engine goes idle (or ``final``) — never to
        one whose pipe has not taken the last update yet."""
        stats = None
        now = time.monotonic()
        idle = final or self.core is None or not self.core.has_unfinished_requests()
        for index in list(self._open):
            frontend = self._frontends[index]
            recent = not idle and now - frontend.sent_at < STATS_REFRESH_S
            if not frontend.has_items() and (len(frontend.unsent) > 0 or recent):
                continue
            stats = encode_stats(self.core.stats()) if stats is None else stats
            if frontend.has_items() or stats != frontend.sent_stats:
                self._send_update(index, now, stats)

    def _send_update(self, index: int, now: float, stats: tuple | None = None) -> None:
        frontend = self._frontends[index]
        stats = encode_stats(self.core.stats()) if stats is None else stats
        sent = self._send(index, Update(frontend.accepted, frontend.refused, frontend.outputs, frontend.failed,
                                        stats, self._step_failures))
        frontend.clear()
        if sent:
            frontend.sent_stats, frontend.sent_at = stats, now
            if len(frontend.unsent) > MAX_UNSENT_BYTES and not frontend.overflowed:
                self._overflow(index)

    def _send(self, index: int, message) -> bool:
        """Hand a message to one frontend: to a local channel's client at once; to a pipe, queued and written
        as far as the pipe takes it now, never waiting for it (the rest is written as the pipe drains). False
        if its process is gone (it is detached)."""
        frontend = self._frontends[index]
        if frontend.local is not None:
            frontend.local.deliver(message)
            return True
        if frontend.updates < 0:
            return True
        frontend.unsent.put(message)
        return self._flush(index)

    def _flush(self, index: int, event: int = 0) -> bool:
        """Write what waits for one frontend's update pipe, as much as it takes; watch the pipe for room while
        bytes wait. False when its reader is gone (the frontend is detached)."""
        frontend = self._frontends[index]
        if event & (select.POLLERR | select.POLLHUP):
            self._lost(index)
            return False
        try:
            waiting = frontend.unsent.write()
        except OSError:
            self._lost(index)
            return False
        watched = frontend.updates in self._by_update_fd
        if waiting and not watched:
            self._poller.register(frontend.updates, select.POLLOUT)
            self._by_update_fd[frontend.updates] = index
        elif not waiting and watched:
            self._unwatch_updates(frontend)
            frontend.overflowed = False
        return True

    def _overflow(self, index: int) -> None:
        """A frontend that reads nothing (its event loop stalled) while :data:`MAX_UNSENT_BYTES` of updates wait:
        its requests end (aborted in the engine; it reads why in the update after those that wait), so a
        stalled HTTP process costs the engine no more work and the core no more memory; it serves new
        requests once it reads again."""
        self._frontends[index].overflowed = True
        log.warning("HTTP process %d has not read %d MiB of updates: ending its requests", index,
                    MAX_UNSENT_BYTES >> 20)
        self._end_requests_of(index, "the server's HTTP process fell too far behind the engine (it did not read "
                                     f"{MAX_UNSENT_BYTES >> 20} MiB of updates); retry", 503)

    def _unwatch_updates(self, frontend: Frontend) -> None:
        if self._by_update_fd.pop(frontend.updates, None) is not None:
            self._poller.unregister(frontend.updates)

    def _lost(self, index: int) -> None:
        frontend = self._frontends[index]
        frontend.unsent.clear()
        self._unwatch_updates(frontend)
        self._detach(index)

    def _flush_before_exit(self) -> None:
        """At stop: give the HTTP processes :data:`FINAL_FLUSH_S` to take what waits for them."""
        for fd in self._by_fd:
            self._poller.unregister(fd)
        self._by_fd.clear()
        self._poller.unregister(self._wake_read)
        deadline = time.monotonic() + FINAL_FLUSH_S
        while self._by_update_fd and time.monotonic() < deadline:
            for fd, event in self._poller.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                self._flush(self._by_update_fd[fd], event)

    def _detach(self, index: int) -> None:
        """A frontend's process is gone: its requests are aborted (nobody reads them), the rest serve on; with
        none left the core stops."""
        if index not in self._open:
            return
        self._forget(index)
        for request_id, entry in list(self._live.items()):
            if entry[0] == index:
                del self._live[request_id]
                self.core.abort(request_id)
        self._grammars.cancel_all(owner=index)
        if not self._open:
            self._stopping = True

    def _forget(self, index: int) -> None:
        """Hear no more commands of one frontend (what waits for its update pipe is still written)."""
        self._open.discard(index)
        frontend = self._frontends[index]
        if self._by_fd.pop(frontend.commands, None) is not None:
            self._poller.unregister(frontend.commands)
        frontend.clear()

    def _release(self) -> None:
        self._grammars.cancel_all()
        device = close_engine(self.core)
        self.core = None
        release_memory(device)
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)
        log.info("engine core stopped")
