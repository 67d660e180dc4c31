"""Structured output: a request's tokens constrained to a JSON schema, any JSON object, a regular expression,
one of a list of strings, or an EBNF grammar — through xgrammar (``pip install xgrammar``).

Why xgrammar: filling a request's next-token mask happens on the host before every step that samples it,
and xgrammar's fill is the faster and steadier of the two libraries compared (llguidance's worst case was
far longer; docs/BENCHMARKS.md, "Measurements behind the code's choices"); its compile, the slower of the
two, happens once per schema (cached). It is also vLLM's default backend, so the grammars behave as users
of vLLM know them.

How it runs: a request with ``SamplingParams.structured_output`` gets a matcher (:class:`GrammarState`)
when it is added. Before each model step that samples it, its row of the step's bitmask ``[rows, ceil(V /
32)]`` int32 (bit ``t`` of a row: token ``t`` allowed) is filled on the host, sent with the step, and the
disallowed logits become ``-inf`` on the device before any other transform; each token the step samples is
then fed to the matcher. The grammar allows the end-of-sequence tokens exactly when the text is complete, so
the request ends there. Because the mask of a step needs the token of the step before, a step with such a
request does not overlap the previous one (the engine reads the previous step first) and does not run
several decode steps in one launch; other steps are unaffected. With speculative decoding a verify's rows
take the masks of the grammar's states after each draft (:meth:`GrammarState.fill_drafts`; the matcher
advanced and rolled back), and drafts the grammar refuses are cut before the step
(:meth:`GrammarState.valid_drafts`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
DEFAULT_CACHE_MB = 512            # the compiled grammars kept (LRU), as vLLM's VLLM_XGRAMMAR_CACHE_MB
DEFAULT_COMPILE_TIMEOUT_S = 30.0  # how long a request may wait for its grammar before it is refused
WORKER_NICENESS = 10              # the compile workers' priority below the engine's (Linux nice levels)
MAX_SCHEMA_DEPTH = 128        # nesting of a JSON schema, given as a dict or as text: deeper ones are refused
MAX_SCHEMA_VALUES = 1 << 20   # objects and arrays walked in a schema (so a dict that shares its parts ends)


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint (exactly one field set): ``json`` a JSON schema (a dict or its JSON text),
    ``json_object`` any JSON object, ``regex`` a regular expression the whole output matches, ``choice``
    one of these strings exactly, ``grammar`` an EBNF grammar (xgrammar's / GBNF dialect, ``root`` rule).

    A schema nested deeper than :data:`MAX_SCHEMA_DEPTH` levels (as a dict or as text) is refused with
    ``ValueError``: the grammar compiler's time grows faster than the depth, and the JSON walks recurse.
    :attr:`size` is the constraint's text in UTF-8 bytes, what a server bounds."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            choice = tuple(self.choice) if not isinstance(self.choice, str) else None
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError("structured_output.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_output.json is not valid JSON: {error}") from None
            except RecursionError:   # json's parser recurses: past Python's limit, the nesting is far too deep
                raise ValueError(f"structured_output.json is nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
            _check_nesting(schema)
        elif isinstance(self.json, dict):
            _check_nesting(self.json)
        elif self.json is not None:
            raise TypeError(f"structured_output.json must be a JSON schema (dict or str), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_output.{name} must be a non-empty string")
        set_fields = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(f"structured_output needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(set_fields) or 'none'}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint: its kind and text (the schema's JSON for a dict)."""
        value = getattr(self, self.kind)
        return self.kind, value if isinstance(value, str) else json.dumps(value)   # keeps property order

    @property
    def size(self) -> int:
        """The constraint's text in UTF-8 bytes (:func:`constraint_size`)."""
        return constraint_size(getattr(self, self.kind))


def constraint_size(value) -> int:
    """A constraint's text in UTF-8 bytes: a schema's JSON (compact, for a dict), a regex or grammar, choices
    together; 0 for ``json_object`` (``True``: a fixed grammar). Cheap for text, so a server can bound a
    constraint before parsing it."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, (list, tuple)):
        return sum(len(c.encode("utf-8", "surrogatepass")) for c in value)
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return len(text.encode("utf-8", "surrogatepass"))


def _check_nesting(schema) -> None:
    """``ValueError`` when ``schema`` (a dict, or parsed JSON) nests deeper than :data:`MAX_SCHEMA_DEPTH`
    levels or holds more than :data:`MAX_SCHEMA_VALUES` objects and arrays; walked without recursion."""
    pending, walked = [(schema, 1)], 0
    while pending:
        value, depth = pending.pop()
        walked += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured_output.json is nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if walked > MAX_SCHEMA_VALUES:
            raise ValueError(f"structured_output.json holds more than {MAX_SCHEMA_VALUES} objects and arrays")
        children = value.values() if isinstance(value, dict) else value
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError("structured output needs the xgrammar package: pip install xgrammar "
                          "(or pip install 'tripath[structured]')") from None
    return xgrammar


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary width (the logits' columns); safe to call from
    several threads.

    ``compile`` compiles in the caller's thread; ``submit`` on the compiler's own pool of ``workers`` threads,
    which run at a lower CPU priority than the engine (Linux: ``nice`` +:data:`WORKER_NICENESS`), so a long
    compile slows no step of the engine's; each compile uses ``threads_per_compile`` threads of xgrammar's.
    Compiled grammars are kept in a least-recently-used cache of at most ``cache_bytes`` (by xgrammar's
    ``memory_size_bytes``; a grammar larger than the whole cache is not kept); requests of one constraint
    submitted while it compiles share that compile. ``timeout_s`` is the compile-time budget a caller of
    ``submit`` enforces (a running compile cannot be interrupted: one past its budget finishes on its
    worker, and its grammar is cached)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], *,
                 cache_bytes: int = DEFAULT_CACHE_MB << 20, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 workers: int | None = None, threads_per_compile: int | None = None):
        if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
            raise ValueError("structured output needs the model's Hugging Face tokenizer; this model has none")
        if cache_bytes < 0:
            raise ValueError(f"the grammar cache size must be >= 0 bytes, got {cache_bytes}")
        if not timeout_s > 0:
            raise ValueError(f"the grammar compile timeout must be > 0 s, got {timeout_s}")
        xgr = _xgrammar()
        cores = os.cpu_count() or 2
        self.vocab_size = vocab_size
        self.cache_bytes = cache_bytes
        self.timeout_s = float(timeout_s)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        threads = threads_per_compile or max(1, min(8, cores // 2))
        # xgrammar's own cache never evicts: this class keeps the compiled grammars instead.
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cached_bytes = 0
        self._compiling: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()
        self._workers = workers or max(2, min(8, cores // 4))
        self._pool: ThreadPoolExecutor | None = None

    @property
    def cached_bytes(self) -> int:
        """The compiled grammars' bytes the cache holds now."""
        return self._cached_bytes

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of ``spec``, compiled in this thread unless cached; ``ValueError`` naming the
        field when it does not compile."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(spec)
        self._keep(key, compiled)
        return compiled

    def submit(self, spec: StructuredOutput) -> Future:
        """A future of ``spec``'s compiled grammar, compiled on the pool (done at once when cached); its
        exception is the ``ValueError`` of :meth:`compile`. Submits of one constraint while it compiles share
        one future: cancel it only when no other caller waits for it."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(self._cache[key])
                return done
            running = self._compiling.get(key)
            if running is not None and not running.cancelled():
                return running
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="tripath-grammar",
                                                initializer=_lower_priority)
            future = self._pool.submit(self._compile_and_keep, spec)
            self._compiling[key] = future
        future.add_done_callback(lambda done: self._compiled(key, done))
        return future

    def close(self) -> None:
        """Stop the pool (compiles queued and not started are cancelled; running ones finish on their own)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def state(self, spec: StructuredOutput, compiled=None) -> "GrammarState":
        """A new matcher of ``spec`` (of its ``compiled`` grammar when given, else compiled or cached now)."""
        compiled = self.compile(spec) if compiled is None else compiled
        return GrammarState(_xgrammar().GrammarMatcher(compiled), self.vocab_size)

    def _compile_and_keep(self, spec: StructuredOutput):
        compiled = self._compile(spec)
        self._keep(spec.key, compiled)
        return compiled

    def _compiled(self, key: tuple[str, str], future: Future) -> None:
        """A submitted compile is over (done, failed or cancelled): later submits of it start anew or hit the
        cache."""
        with self._lock:
            if self._compiling.get(key) is future:
                del self._compiling[key]

    def _compile(self, spec: StructuredOutput):
        try:
            if spec.kind == "json":
                return self._compiler.compile_json_schema(spec.key[1], any_whitespace=False)
            if spec.kind == "json_object":   # OpenAI's json_object: an object, not any JSON value
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if spec.kind == "choice":
                return self._compiler.compile_regex("|".join(f"({re.escape(c)})" for c in spec.choice))
            return self._compiler.compile_grammar(spec.grammar)
        except RecursionError:
            raise ValueError(f"structured_output.{spec.kind} is nested too deeply to compile") from None
        except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for bad input
            raise ValueError(f"structured_output.{spec.kind} could not be compiled: {error}") from None

    def _keep(self, key: tuple[str, str], compiled) -> None:
        """Cache ``compiled`` as the most recently used, evicting the least recently used past the budget."""
        size = int(compiled.memory_size_bytes)
        if size > self.cache_bytes:
            return
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return
            self._cache[key] = compiled
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= int(evicted.memory_size_bytes)


def _lower_priority() -> None:
    """A compile worker's initializer: this thread (and the threads it starts) below the engine's priority."""
    with contextlib.suppress(AttributeError, OSError):   # no per-thread priority outside Linux
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + WORKER_NICENESS)


class GrammarState:
    """A request's matcher: which tokens may come next, fed each token the request keeps."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of the host ``bitmask``: the allowed next tokens (all, once the matcher is done)."""
        if self.done:
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False (nothing changes) when the grammar does not allow it next."""
        return self.done or bool(self.matcher.accept_token(int(token)))

    def _advance(self, tokens: Sequence[int]) -> int:
        """Feed ``tokens`` while the grammar takes them (not past the end of the text); how many it took."""
        taken = 0
        for token in tokens:
            if self.done or not self.matcher.accept_token(int(token)):
                break
            taken += 1
        return taken

    def _back(self, taken: int) -> None:
        if taken:
            self.matcher.rollback(taken)

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many of speculative decoding's ``drafts`` (in order) the grammar allows after the request's
        tokens, up to the one that completes the text; the matcher is left as it was."""
        taken = self._advance(drafts)
        self._back(taken)
        return taken

    def fill_drafts(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int],
                    parents: Sequence[int] | None = None) -> None:
        """Rows ``row .. row + len(drafts)`` of the host ``bitmask`` for a verify: the tokens allowed after the
        request's tokens, then after each draft (a draft tree's node: after its path, ``parents[i]`` its
        parent, -1 the request's last token). A row past a draft the grammar refuses allows every token
        (the verify never reaches it). The matcher is left as it was."""
        self.fill(bitmask, row)
        for i in range(len(drafts)):
            path, node = [], i
            while node >= 0:
                path.append(drafts[node])
                node = node - 1 if parents is None else parents[node]
            path.reverse()
            taken = self._advance(path)
            if taken == len(path):
                self.fill(bitmask, row + 1 + i)
            else:
                bitmask[row + 1 + i].fill_(-1)
            self._back(taken)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask of ``rows`` rows, every token allowed (pinned where a GPU is present)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32,
                      pin_memory=torch.cuda.is_available())


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``logits[rows[i], t] = -inf`` where bit ``t`` of ``bitmask[i]`` (device, int32) is clear."""
    vocab = logits.shape[-1]
    tokens = torch.arange(vocab, device=logits.device)
    allowed = (bitmask[:, tokens // 32] >> (tokens % 32)) & 1
    picked = logits.index_select(0, rows).masked_fill(allowed == 0, float("-inf"))
    logits.index_copy_(0, rows, picked)
