"""``/metrics`` across the API servers of one engine (``tripath serve --api-server-count N``,
:mod:`~tripath.server.processes.api_servers`): whichever of them a scrape reaches answers for all of them.

Each API server observes its own requests (:class:`~tripath.server.metrics.metrics.ServerMetrics`) and answers its
peers on a Unix socket named after a folder they share (``<folder>/<index>.sock``) with a pickle of its
registry's metric families (vLLM's under their ``vllm:`` names only). On Linux the "folder" is a name in the
abstract socket namespace (it starts with a NUL byte, :func:`is_abstract`): nothing on the filesystem, and each
socket is gone with its process, however it ends (a whole process group killed at once included); a peer's
socket is read only when its owner is this server's user (``SO_PEERCRED``: the name is visible to every local
user, the pickle must come from a peer). Elsewhere it is a real folder of the temp folder (mode 0700), whose
last API server to close removes it.

A scrape asks every peer, then merges: the families of the engine itself (its requests running / waiting, KV
cache, prefix cache, preemptions, steps and tokens per step, cache configuration: :data:`ENGINE_FAMILIES`,
which every API server reads from the same engine core) are the scraped server's own; every other sample is
the sum over the API servers (request counts, token counts, every histogram bucket, the requests in the
server, the generation rate), except a ``_created`` time, which is the earliest. The merged families are then
named as the scraped server names them (:func:`~tripath.server.metrics.metric_kinds.render`). A peer that does not
answer within :data:`PEER_TIMEOUT_S` is left out (logged): it is stopping, or gone, and the server with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import socket
import struct
from typing import Callable, Iterable

from prometheus_client.metrics_core import Metric

from tripath.server.metrics.metric_kinds import render as render_families

log = logging.getLogger("tripath.server")

PEER_TIMEOUT_S = 2.0
ENGINE_FAMILIES = frozenset([*(f"vllm:{name}" for name in (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions", "iteration_tokens_total", "cache_config_info")), *(
    f"tripath:{name}" for name in ("kv_cache_blocks_total", "kv_cache_blocks_used", "engine_steps",
                                   "engine_step_failures"))])


def is_abstract(folder: str) -> bool:
    """Whether ``folder`` names sockets in Linux's abstract namespace rather than a folder on disk."""
    return folder.startswith("\0")


def merge_families(own: list[Metric], peers: Iterable[list[Metric]]) -> list[Metric]:
    """The families of one API server (``own``) merged with its peers' (see the module doc), in ``own``'s
    order (a family only a peer has comes after)."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple, list]] = {}   # family -> (sample name, labels) -> [name, labels, value]
    for index, families in enumerate([own, *peers]):
        for family in families:
            if index > 0 and family.name in ENGINE_FAMILIES:
                continue
            if family.name not in merged:
                merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            samples = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                entry = samples.get(key)
                if entry is None:
                    samples[key] = [sample.name, sample.labels, sample.value]
                elif sample.name.endswith("_created"):
                    entry[2] = min(entry[2], sample.value)
                else:
                    entry[2] += sample.value
    for name, family in merged.items():
        for sample_name, labels, value in values[name].values():
            family.add_sample(sample_name, labels, value)
    return list(merged.values())


class MetricsPeers:
    """API server ``index`` of ``count`` sharing ``folder``: answers its peers with ``registry``'s families
    (``refresh()`` first: the gauges set at scrape time) and renders the merged ``/metrics``, vLLM's families
    named as ``names`` says (:data:`~tripath.server.metrics.metric_kinds.METRIC_NAMES`). :meth:`start` and
    :meth:`close` run on the serving event loop."""

    def __init__(self, folder: str, index: int, count: int, registry, refresh: Callable[[], None] | None = None,
                 names: str = "both"):
        self.folder, self.index, self.count = folder, index, count
        self._registry, self._refresh, self.names = registry, refresh, names
        self._server: asyncio.AbstractServer | None = None

    def path(self, index: int) -> str:
        return os.path.join(self.folder, f"{index}.sock")

    async def start(self) -> None:
        if not is_abstract(self.folder):
            os.makedirs(self.folder, exist_ok=True)   # a peer that stopped early may have removed it
        self._server = await asyncio.start_unix_server(self._answer, path=self.path(self.index))

    async def close(self) -> None:
        """Stop answering. A socket on disk is removed, and its folder once empty: the last API server to close
        removes it, so nothing is left when the supervisor could not (killed); an abstract one has nothing to
        remove."""
        if self._server is not None:
            self._server.close()
            self._server = None
            if is_abstract(self.folder):
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(self.index))
            with contextlib.suppress(OSError):   # not empty yet (a peer still serves), or gone already
                os.rmdir(self.folder)

    def _own(self) -> list[Metric]:
        if self._refresh is not None:
            self._refresh()
        return list(self._registry.collect())

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(pickle.dumps(self._own(), protocol=pickle.HIGHEST_PROTOCOL))
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _ask(self, index: int) -> list[Metric] | None:
        try:
            return pickle.loads(await asyncio.wait_for(self._read(index), PEER_TIMEOUT_S))
        except (OSError, asyncio.TimeoutError, EOFError, pickle.UnpicklingError) as error:
            log.warning("API server %d's metrics are left out of this scrape: %s", index,
                        type(error).__name__ if not str(error) else error)
            return None

    async def _read(self, index: int) -> bytes:
        # connected here, not by the event loop: uvloop connects to a path as a C string, which an abstract
        # name (a leading NUL) cuts to nothing (EINVAL)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, self.path(index))
            if is_abstract(self.folder):
                _check_owner(sock, index)
        except BaseException:
            sock.close()
            raise
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        try:
            return await reader.read()
        finally:
            writer.close()

    async def families(self) -> list[Metric]:
        """Every API server's families merged (the module doc), under their registry names."""
        own = self._own()
        answers = await asyncio.gather(*(self._ask(i) for i in range(self.count) if i != self.index))
        return merge_families(own, [a for a in answers if a is not None])

    async def render(self) -> bytes:
        return render_families(await self.families(), self.names)


def _check_owner(sock, index: int) -> None:
    """Raise ``PermissionError`` unless the process at the other end of ``sock`` runs as this one's user."""
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
    if uid != os.getuid():
        raise PermissionError(f"the socket of API server {index} belongs to user {uid}, not to this server's")
