"""Output tokens to text as they stream: incremental detokenisation and ``stop`` strings.

:class:`IncrementalDetokenizer` turns one token at a time into the text it adds. It decodes a short window of
recent tokens twice (with and without the new one) and emits the difference, so tokenizers whose pieces
depend on their neighbours (leading-space markers, byte-level pieces) come out right; while the window ends
in an incomplete UTF-8 sequence (U+FFFD) it emits nothing and waits for the next bytes.

The window stays short, so a token costs a bounded amount of decoding however long the output is. When more
than :data:`HOLD` tokens wait (a UTF-8 character is at most 4 bytes, so only invalid bytes or tokens that
decode to nothing wait that long), the window is cut just before the last few tokens, at a token boundary
where decoding the two parts apart gives the same text as decoding them together (a clean cut: no character
spans it, and nothing after it can change the text before it); the text before the cut is emitted, invalid
bytes as U+FFFD, and one token before the cut stays as the next window's left context. Without the cut, a run
of tokens that are not valid UTF-8 re-decoded the whole run at every token (quadratic in the run's length).
The one wait no cut can end: an incomplete character followed only by tokens that decode to nothing (skipped
special tokens), since the next byte may still complete it.

For tokenizers whose decode is the lossy UTF-8 decode of the concatenated token bytes (byte-level BPE: GPT-2,
Llama 3, Qwen, SmolLM), the streamed text equals ``tokenizer.decode`` of all the tokens. Sentencepiece
byte-fallback decoding turns a whole run of byte tokens into U+FFFD when any of it is invalid, which no
streaming decoder can know in advance: there the text can differ inside such runs (it did before the cut too).

:class:`StopMatcher` holds back text that could be the start of a stop string and cuts the output before the
first stop string to complete (the stop string itself is not returned, as in the OpenAI API, unless
``include_stop``).
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"
HOLD = 4          # more tokens than this waiting (and nothing to emit): cut the window
_MAX_TAIL = 4     # the cut keeps at most this many tokens after it, fewest first


class IncrementalDetokenizer:
    """The text of a growing token sequence, piece by piece (``push`` a token, get the text it completes).

    ``text`` is everything emitted so far; after :meth:`flush` it is the whole text. Each :meth:`push` decodes
    a window of a few tokens beyond the last emitted piece (see the module notes), never the whole output."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0   # window start: tokens before it are emitted and final
        self.read_offset = 0     # tokens before it are emitted
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _emit(self, prefix_offset: int, read_offset: int, new: str) -> str:
        self.prefix_offset, self.read_offset = prefix_offset, read_offset
        self.text += new
        return new

    def push(self, token_id: int) -> str:
        """Add one token; returns the new text (``""`` while a character is incomplete)."""
        self.token_ids.append(int(token_id))
        if self.tokenizer is None:
            return ""
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        if not after.endswith(REPLACEMENT) and len(after) > len(before):
            return self._emit(self.read_offset, len(self.token_ids), after[len(before):])
        if len(self.token_ids) - self.read_offset > HOLD:
            return self._cut(before, after)
        return ""

    def _cut(self, before: str, after: str) -> str:
        """Emit the window up to a clean cut among its last tokens; ``""`` and no change if there is none."""
        ids, start = self.token_ids, self.prefix_offset
        for tail_len in range(1, _MAX_TAIL + 1):
            cut = len(ids) - tail_len
            if cut <= self.read_offset:
                break
            head, tail = self._decode(ids[start:cut]), self._decode(ids[cut:])
            if not head.startswith(before) or head + tail != after:
                continue   # a character spans the cut
            if not tail and head.endswith(REPLACEMENT):
                continue   # no byte after the cut yet says whether the character before it is complete
            context = self._decode(ids[cut - 1:cut])
            if context + tail != self._decode(ids[cut - 1:]):
                continue   # one token of left context would not decode the tail as the window does
            return self._emit(cut - 1, cut, head[len(before):])
        return ""

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back (an incomplete character decodes as
        U+FFFD)."""
        if self.tokenizer is None or self.read_offset == len(self.token_ids):
            return ""
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        new = after[len(before):] if after.startswith(before) else after
        return self._emit(len(self.token_ids), len(self.token_ids), new)


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
        self.matched: str | None = None   # the stop string that stopped the text

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
                    self.stopped, self.matched = True, stop
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
