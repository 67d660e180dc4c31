"""``tripath bench core-transport``: the pipe between the HTTP process and the engine core
(:mod:`tripath.server.transport.core_wire`), on one step's update of ``--outputs`` requests of ``--tokens`` new tokens
each (``--logprobs K``: with the top K log-probabilities of each token).

Reported: the update's size; the core's cost to encode it (the outputs to tuples, pickled) and the HTTP
process's to decode it (unpickled, to ``StepOutput``), medians; a round trip through a spawned echo process
(p50 / p99); the updates a second the pipe streams one way; and the server's work per step on the engine's
own thread (CPU time, a stand-in engine whose step returns the outputs at once): the core loop
(:class:`~tripath.server.transport.core_loop.CoreLoop`) in the core process (encode, send) against the same loop on a
thread of the HTTP process (:class:`~tripath.server.transport.in_process.InProcessClient`: encode, decode, metrics per
token, the hand-over to the event loop).

    tripath bench core-transport --outputs 256 --tokens 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Sequence


def _outputs(num_outputs: int, num_tokens: int, logprobs: int | None) -> list:
    from tripath.engine.requests.request import CompletionOutput, Logprob, RequestOutput

    outs = []
    for i in range(num_outputs):
        tokens = list(range(1000 + i, 1000 + i + num_tokens))
        entries = None if logprobs is None else [
            {t: Logprob(-0.5, 1), **{j: Logprob(-1.0 - j / 100, j + 2) for j in range(logprobs)}} for t in tokens]
        outs.append(RequestOutput(f"srv-{i}-0", None, [1], [CompletionOutput(0, None, tokens)], False, tokens,
                                  entries))
    return outs


def _median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _read_exactly(fd: int, size: int) -> bytes:
    import os

    parts, left = [], size
    while left:
        part = os.read(fd, left)
        if not part:
            raise EOFError
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _echo(commands, updates, size: int, count: int, mode: str) -> None:
    """Read ``count`` frames of ``size`` bytes, writing each back (``echo``) or not (``drain``); then one byte."""
    from tripath.server.transport.core_wire import write_all

    for _ in range(count):
        data = _read_exactly(commands.fileno(), size)
        if mode == "echo":
            write_all(updates.fileno(), data)
    write_all(updates.fileno(), b"!")


def _through_pipe(data: bytes, count: int, mode: str) -> tuple[float, list[float]]:
    """A spawned child echoes (``echo``) or drains (``drain``) ``count`` frames ``data`` (the bytes of one
    message as :func:`tripath.server.transport.core_wire.frame` writes it): the wall time and each round trip."""
    from tripath.server.transport.core_wire import widen, write_all

    context = multiprocessing.get_context("spawn")
    child_in, commands = context.Pipe(duplex=False)
    updates, child_out = context.Pipe(duplex=False)
    widen(commands)
    widen(updates)
    process = context.Process(target=_echo, args=(child_in, child_out, len(data), count, mode))
    process.start()
    child_in.close()
    child_out.close()
    trips = []
    start = time.perf_counter()
    for _ in range(count):
        sent = time.perf_counter()
        write_all(commands.fileno(), data)
        if mode == "echo":
            _read_exactly(updates.fileno(), len(data))
            trips.append(time.perf_counter() - sent)
    _read_exactly(updates.fileno(), 1)
    elapsed = time.perf_counter() - start
    process.join()
    return elapsed, trips


class _StandInEngine:
    """An engine whose every step returns the same outputs at once."""

    def __init__(self, outputs: list):
        self.outputs, self.num_steps = outputs, 0

    def step(self, decode_steps: int | None = None):
        from tripath.engine.core.engine_core import StepResult

        self.num_steps += 1
        return StepResult(self.outputs)

    def has_unfinished_requests(self) -> bool:
        return True

    def abort(self, request_id: str) -> bool:
        return True

    def stats(self):
        from tripath.engine.scheduling.stats import EngineStats

        return EngineStats(len(self.outputs), 0, 1, 2, 0, 0, 0, self.num_steps)


def _drain(updates) -> None:
    import os

    while os.read(updates.fileno(), 1 << 20):
        pass


def _core_step_cpu_s(outs: list, steps: int) -> float:
    """CPU seconds per step of the engine core's loop (a spawned child reads its updates)."""
    from tripath.server.transport.core_loop import CoreLoop
    from tripath.server.transport.core_wire import widen

    context = multiprocessing.get_context("spawn")
    commands, _ = context.Pipe(duplex=False)
    reader, updates = context.Pipe(duplex=False)
    widen(updates)
    process = context.Process(target=_drain, args=(reader,))
    process.start()
    reader.close()
    core = CoreLoop(_StandInEngine(outs), [(commands.fileno(), updates.fileno())])
    core._live.update((o.request_id, [0, True]) for o in outs)
    start = time.thread_time()
    for _ in range(steps):
        core._step()
        core._send_update(0, 0.0)
    elapsed = time.thread_time() - start
    updates.close()
    process.join()
    return elapsed / steps


def _thread_step_cpu_s(outs: list, steps: int) -> float:
    """CPU seconds per step of the in-process engine thread's server work (an event loop on another thread
    takes the handed-over items)."""
    import asyncio
    import threading

    from tripath.engine.requests.sampling_params import SamplingParams
    from tripath.server.metrics.metrics import ServerMetrics
    from tripath.server.transport.core_loop import CoreLoop
    from tripath.server.transport.in_process import InProcessClient
    from tripath.server.transport.submissions import Submission

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    client = InProcessClient(None, ServerMetrics("bench"))
    core = CoreLoop(_StandInEngine(outs), [client._channel])
    core._live.update((o.request_id, [0, True]) for o in outs)
    subs = [Submission(o.request_id, 0, [1], SamplingParams(max_tokens=1 << 40), loop, asyncio.Queue()) for o in outs]
    for sub in subs:
        client._book.register(sub)
        client._book.accept(sub.request_id)

    def take_all() -> None:
        for sub in subs:
            while not sub.events.empty():
                sub.events.get_nowait()

    start = time.thread_time()
    for index in range(steps):
        core._step()
        core._send_update(0, 0.0)   # delivered: decoded, the metrics, handed to the event loop
        if index % 16 == 0:
            loop.call_soon_threadsafe(take_all)
    elapsed = time.thread_time() - start
    loop.call_soon_threadsafe(loop.stop)
    client._channel.close()
    return elapsed / steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tripath bench core-transport", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", type=int, default=256, help="requests with output in the step")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per request (multi-step decoding: 8)")
    parser.add_argument("--logprobs", type=int, default=None, help="top log-probabilities per token")
    parser.add_argument("--messages", type=int, default=2000, help="messages through the pipe")
    args = parser.parse_args(argv)
    import pickle

    from tripath.server.transport.core_messages import Update
    from tripath.server.transport.core_wire import decode_output, encode_output, frame

    outs = _outputs(args.outputs, args.tokens, args.logprobs)
    repeat = max(5, min(200, args.messages // 10))

    def encode() -> bytes:
        return pickle.dumps(Update([], [], [encode_output(o, False) for o in outs], [], (0,) * 8, 0),
                            protocol=pickle.HIGHEST_PROTOCOL)

    payload = encode()
    encode_us = _median_us(encode, repeat)
    decode_us = _median_us(lambda: [decode_output(item) for item in pickle.loads(payload).outputs], repeat)
    framed = frame(pickle.loads(payload))
    _, trips = _through_pipe(framed, args.messages, "echo")
    elapsed, _ = _through_pipe(framed, args.messages, "drain")
    trips.sort()
    print(f"update of {args.outputs} outputs x {args.tokens} tokens"
          + (f", top {args.logprobs} log-probabilities" if args.logprobs is not None else "")
          + f": {len(payload) / 1024:.1f} KiB; encode {encode_us:.0f} us (core), decode {decode_us:.0f} us (HTTP "
          f"process); pipe round trip p50 {statistics.median(trips) * 1e6:.0f} us, p99 "
          f"{trips[int(0.99 * (len(trips) - 1))] * 1e6:.0f} us; one way {args.messages / elapsed:.0f} updates/s")
    steps = max(10, args.messages // 2)
    print(f"server work per step on the engine's thread (CPU): core process {_core_step_cpu_s(outs, steps) * 1e6:.0f} "
          f"us, in-process core loop {_thread_step_cpu_s(outs, steps) * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
