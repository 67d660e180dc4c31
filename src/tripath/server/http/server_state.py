"""What every route of the server reads: the engine's face, the metrics and the server's settings
(:class:`ServerState`, one per app, built by :func:`tripath.server.http.app.build_app`)."""

from __future__ import annotations

from typing import Sequence

from tripath.server.http import protocol as P
from tripath.server.http.large_texts import LargeTextGate
from tripath.server.metrics.metrics import ServerMetrics
from tripath.server.processes.tokenizer_process import TokenizerProcess
from tripath.server.transport.core_wire import tokenizer_handle
from tripath.server.transport.submissions import Engine

DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES = 64 << 10


class ServerState:
    def __init__(self, engine: Engine, metrics: ServerMetrics, model_names: Sequence[str], max_queue_depth: int,
                 request_timeout_s: float | None, chat_template: str | None = None,
                 max_structured_output_bytes: int = DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES, request_log=None,
                 response_role: str = "assistant", max_logprobs: int = P.MAX_LOGPROBS, tokenizer_info: bool = False):
        self.engine, self.metrics, self.request_log = engine, metrics, request_log
        self.model_names = list(model_names)   # each accepted as a request's model; the first names the metrics
        self.model_name = self.model_names[0]
        self.chat_template = chat_template     # Jinja text in place of the tokenizer's, or None
        self.max_queue_depth = max_queue_depth
        self.request_timeout_s = request_timeout_s
        self.max_structured_output_bytes = max_structured_output_bytes
        self.response_role = response_role     # the role of a chat completion's message
        self.max_logprobs = max_logprobs       # the most log-probabilities a request may ask for per token
        self.tokenizer_info = tokenizer_info   # serve GET /tokenizer_info
        self.outstanding = 0   # engine submissions of live HTTP requests (handler side)
        self.large_texts = LargeTextGate()
        self._tokenizer_process: TokenizerProcess | None = None

    @property
    def capacity(self) -> int:
        """Engine requests the server holds at once: the ``max_num_seqs`` the engine runs and
        ``max_queue_depth`` more waiting."""
        return self.engine.max_num_seqs + self.max_queue_depth

    def tokenizer_helper(self) -> TokenizerProcess:
        """The helper process that tokenises large texts (:mod:`~tripath.server.processes.tokenizer_process`),
        made on first use: once the engine is ready, with its tokenizer (which the model has)."""
        if self._tokenizer_process is None:
            self._tokenizer_process = TokenizerProcess(tokenizer_handle(self.engine.tokenizer))
        return self._tokenizer_process

    def close(self) -> None:
        """Stop what the routes started: the tokenizer helper process."""
        if self._tokenizer_process is not None:
            self._tokenizer_process.close()
