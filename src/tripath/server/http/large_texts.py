"""Large texts are tokenised one at a time.

A Hugging Face fast tokenizer holds hundreds of bytes per character of the text it encodes while it works
(docs/BENCHMARKS.md, "Measurements behind the code's choices"): a prompt of the default
``--max-request-bytes`` (16 MiB) costs gigabytes, and a few of them at once would take the HTTP process past
its memory. So requests whose texts to
tokenise (prompts, chat messages, ``/tokenize``) hold more than :data:`LARGE_TEXT_CHARS` characters together
wait their turn on the event loop (where waiting costs nothing) and are tokenised one after another; smaller
ones never wait. The tokenising itself runs in a worker thread either way.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

LARGE_TEXT_CHARS = 1 << 20


class LargeTextGate:
    """Admits one large text's tokenising at a time (see the module doc); use on the server's event loop."""

    def __init__(self, large_chars: int = LARGE_TEXT_CHARS):
        self.large_chars = large_chars
        self._one = asyncio.Semaphore(1)   # bound to the loop that first waits on it

    @contextlib.asynccontextmanager
    async def admit(self, chars: int) -> AsyncIterator[None]:
        """Hold the gate while texts of ``chars`` characters together are tokenised (at once when small)."""
        if chars < self.large_chars:
            yield
            return
        async with self._one:
            yield
