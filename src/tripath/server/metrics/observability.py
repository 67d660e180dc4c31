"""What ``tripath serve`` tells its operators besides the API: the options of its metrics and logs
(:class:`Observability`) and its HTTP access log.

The access log is uvicorn's (logger ``uvicorn.access``, one INFO line per response). Requests to the paths
monitors poll — ``/health`` and ``/ping`` (a client waiting for the start polls every fraction of a second,
503 after 503) and ``/metrics`` (every scrape) — are logged at DEBUG instead (:func:`quiet_access_log`;
``--disable-access-log-for-endpoints`` names other paths, ``""`` none), so ``--log-level info`` shows the
API's traffic and ``--log-level debug`` everything; ``--disable-uvicorn-access-log`` turns the access log
off. vLLM starts listening only once its engine is built, so it has no start-up polls to hide; its
``--disable-access-log-for-endpoints`` drops the lines of the paths it names (none by default).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from tripath.server.metrics.metric_kinds import METRIC_NAMES

QUIET_PATHS = ("/health", "/ping", "/metrics")
DEFAULT_STATS_INTERVAL_S = 10.0


@dataclass(frozen=True)
class Observability:
    """``metric_names``: how ``/metrics`` names vLLM's families (:data:`~tripath.server.metrics.metric_kinds.
    METRIC_NAMES`); ``log_stats_interval_s``: seconds between the engine stats lines
    (:mod:`~tripath.server.metrics.stats_log`), None for none; ``log_requests``: the request log
    (:mod:`~tripath.server.metrics.request_log`), whose lines keep ``max_log_len`` characters / token ids of a
    prompt (None: all)."""

    metric_names: str = "both"
    log_stats_interval_s: float | None = DEFAULT_STATS_INTERVAL_S
    log_requests: bool = False
    max_log_len: int | None = None

    def __post_init__(self):
        if self.metric_names not in METRIC_NAMES:
            raise ValueError(f"metric_names must be one of {', '.join(METRIC_NAMES)}, got {self.metric_names!r}")
        interval = self.log_stats_interval_s
        if interval is not None and not (isinstance(interval, (int, float)) and math.isfinite(interval)
                                         and interval > 0):
            raise ValueError(f"log_stats_interval_s must be a finite number of seconds > 0, or None, got {interval!r}")
        if self.max_log_len is not None and (not isinstance(self.max_log_len, int) or self.max_log_len < 0):
            raise ValueError(f"max_log_len must be an int >= 0 or None, got {self.max_log_len!r}")


class QuietAccessLog(logging.Filter):
    """On uvicorn's access logger: the lines of requests to ``paths`` (exact paths, query strings ignored) are
    DEBUG records, kept only when the logger's level lets DEBUG through."""

    def __init__(self, paths):
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3 or not isinstance(args[2], str):
            return True   # not uvicorn's access line: (client, method, path with query, version, status)
        if urlsplit(args[2]).path not in self.paths:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_access_log(paths=QUIET_PATHS) -> QuietAccessLog | None:
    """Install :class:`QuietAccessLog` for ``paths`` on ``uvicorn.access`` (replacing one installed before;
    after uvicorn has configured its loggers, which keeps a logger's filters); None when ``paths`` is empty."""
    logger = logging.getLogger("uvicorn.access")
    for old in [f for f in logger.filters if isinstance(f, QuietAccessLog)]:
        logger.removeFilter(old)
    if not paths:
        return None
    quiet = QuietAccessLog(paths)
    logger.addFilter(quiet)
    return quiet


def endpoint_paths(text: str) -> tuple[str, ...]:
    """``--disable-access-log-for-endpoints``: comma-separated paths (``""``: none); raises ``ValueError``
    naming the option for a path that does not start with ``/``."""
    paths = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in paths if not p.startswith("/")]
    if bad:
        raise ValueError(f"--disable-access-log-for-endpoints takes paths that start with '/', got {bad[0]!r}")
    return paths
