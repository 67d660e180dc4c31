"""Output tokens to text as they stream: incremental detokenisation and ``stop`` strings.

:class:`IncrementalDetokenizer` turns one token at a time into the text it adds. It decodes a short window of
recent tokens twice (with and without the new one) and emits the difference, so tokenizers whose pieces
depend on their neighbours (leading-space markers, byte-level pieces) come out right; while the window ends
in an incomplete UTF-8 sequence (U+FFFD) it emits nothing and waits for the next bytes. :class:`StopMatcher`
holds back text that could be the start of a stop string and cuts the output before the first stop string to
complete (the stop string itself is not returned, as in the OpenAI API, unless ``include_stop``).
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of a growing token sequence, piece by piece (``push`` a token, get the text it completes)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0   # window start: tokens before it are emitted and final
        self.read_offset = 0     # tokens before it are emitted
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; returns the new text (``""`` while a character is incomplete)."""
        self.token_ids.append(int(token_id))
        if self.tokenizer is None:
            return ""
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        if after.endswith(REPLACEMENT) or len(after) <= len(before):
            return ""
        new = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back (an incomplete character decodes as
        U+FFFD)."""
        if self.tokenizer is None or self.read_offset == len(self.token_ids):
            return ""
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        new = after[len(before):] if after.startswith(before) else after
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += new
        return new


class StopMatcher:
    """Cuts streamed text at the first of ``stops`` to appear; ``feed`` returns the text safe to emit now.

    Each stop string keeps a Knuth-Morris-Pratt state (how much of it the text now ends with), so a piece of
    text costs time linear in its length times the number of stop strings, however long the output and the
    strings are; the held-back tail is the longest of those partial matches.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self.pending = ""
        self.stopped = False

    def feed(self, text: str, final: bool = False) -> str:
        """Add text; returns what may be emitted. After a stop string (``stopped``) nothing more comes out.
        ``final``: no more text will come, release the held-back tail."""
        if self.stopped:
            return ""
        if not self.stops:
            out, self.pending = self.pending + text, ""
            return out
        base = len(self.pending)
        self.pending += text
        stops, fail, state = self.stops, self._fail, self._state
        for offset, char in enumerate(text):
            for j, stop in enumerate(stops):
                k = state[j]
                while k and stop[k] != char:
                    k = fail[j][k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):   # a whole stop string ends here: cut before it (or after it)
                    self.stopped = True
                    out = self.pending[:base + offset + 1 - (0 if self.include_stop else k)]
                    self.pending = ""
                    return out
                state[j] = k
        keep = 0 if final else max(state)
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out


def _failure(pattern: str) -> list[int]:
    """KMP failure function: ``f[i]`` = length of the longest proper prefix of ``pattern[:i + 1]`` that is
    also its suffix."""
    f = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = f[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        f[i] = k
    return f
