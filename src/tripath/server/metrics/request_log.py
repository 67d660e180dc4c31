"""The request log (``tripath serve --enable-log-requests``; off by default, as in vLLM): one INFO line, logger
``tripath.server.requests``, per engine request (one per prompt and choice) when the server submits it, in the
layout of vLLM's request logger::

    Received request srv-3-0: prompt: 'The capital of France is', params: SamplingParams(max_tokens=16, ...),
    prompt_token_ids: [791, 6864, 315, 9822, 374], num_prompt_tokens: 5, lora_request: None.

and one when it ends, whatever ended it (``abort``: the client left, a timeout, a stop string the server
matched is ``stop``)::

    Finished request srv-3-0: finish_reason: length, num_prompt_tokens: 5, num_generated_tokens: 16,
    ttft: 0.041 s, e2e: 0.213 s.

or ``Refused request srv-3-0: 503 the server is overloaded ...`` for one the engine did not take.
``max_log_len`` (``--max-log-len``) keeps that many characters of the prompt and that many of its token ids
(None: all). The prompt's text is decoded from its token ids (a chat request's is the rendered template);
models without a tokenizer show ``None``.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tripath.server.requests")


class RequestLog:
    """Writes the lines above."""

    def __init__(self, max_log_len: int | None = None):
        if max_log_len is not None and max_log_len < 0:
            raise ValueError(f"max_log_len must be None or >= 0, got {max_log_len}")
        self.max_log_len = max_log_len

    def _prompt_text(self, ids: list[int], tokenizer) -> str | None:
        if tokenizer is None:
            return None
        limit = self.max_log_len
        text = tokenizer.decode(ids if limit is None else ids[:limit], skip_special_tokens=False)
        return text if limit is None else text[:limit]

    def received(self, sub, tokenizer) -> None:
        """A :class:`~tripath.server.transport.submissions.Submission` about to be submitted (``tokenizer``: decodes its
        prompt; None: no text)."""
        if not log.isEnabledFor(logging.INFO):
            return
        ids, limit = sub.prompt_token_ids, self.max_log_len
        log.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, num_prompt_tokens: %d, "
                 "lora_request: None.", sub.request_id, self._prompt_text(ids, tokenizer), sub.params,
                 ids if limit is None else ids[:limit], len(ids))

    def finished(self, sub, reason: str, now: float) -> None:
        """``sub`` ended at ``now`` (``perf_counter``) with ``reason`` (the metrics' finish reason)."""
        if not log.isEnabledFor(logging.INFO):
            return
        times = sub.times
        generated = 0 if times is None else times.num_generated
        ttft = "none" if times is None or times.first_token is None else f"{times.first_token - sub.arrival:.3f} s"
        log.info("Finished request %s: finish_reason: %s, num_prompt_tokens: %d, num_generated_tokens: %d, "
                 "ttft: %s, e2e: %.3f s.", sub.request_id, reason, len(sub.prompt_token_ids), generated, ttft,
                 now - sub.arrival)

    def refused(self, sub, failure) -> None:
        """The engine did not take ``sub`` (a :class:`~tripath.server.transport.submissions.Failure`)."""
        log.info("Refused request %s: %d %s", sub.request_id, failure.status, failure.message)
