"""The core loop's grammar waits (``tripath.server.transport.grammar_waits``) with a stand-in compiler whose
compiles the test finishes by hand: one HTTP request's engine requests wait as one and settle together; a
failed, overdue or withdrawn compile; compiles shared between requests are cancelled only when nobody waits."""

import time
from concurrent.futures import Future

from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.requests.structured_output import StructuredOutput
from tripath.server.transport.core_messages import Add
from tripath.server.transport.grammar_waits import GrammarWaits


class _Compiler:
    """``submit`` returns one future per constraint, shared by every request of it (as GrammarCompiler's)."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.futures: dict[str, Future] = {}

    def submit(self, spec):
        return self.futures.setdefault(spec.regex, Future())


def _add(request_id: str, regex: str | None) -> Add:
    spec = None if regex is None else StructuredOutput(regex=regex)
    return Add(request_id, [1, 2], SamplingParams(max_tokens=2, structured_output=spec))


def test_a_groups_requests_settle_together_once_every_grammar_has_compiled():
    compiler, wakes = _Compiler(), []
    waits = GrammarWaits(lambda: compiler, lambda: wakes.append(1))
    assert waits.start([_add("a-0", "x+"), _add("a-1", "y+"), _add("a-2", None)], owner=0) is None
    assert len(waits) == 3 and "a-1" in waits and waits.owner("a-2") == 0
    woken = len(wakes)
    compiler.futures["x+"].set_result("X")
    assert waits.settled() == [] and len(wakes) == woken + 1   # the loop is woken at each compile's end
    compiler.futures["y+"].set_result("Y")
    ((wait, grammars, failure),) = waits.settled()
    assert wait.request_ids == ["a-0", "a-1", "a-2"] and grammars == ["X", "Y", None] and failure is None
    assert len(waits) == 0 and waits.seconds_to_deadline() is None


def test_one_failed_compile_refuses_the_whole_group_and_frees_the_other_compiles():
    compiler = _Compiler()
    waits = GrammarWaits(lambda: compiler, lambda: None)
    waits.start([_add("a-0", "x+"), _add("a-1", "y+")], owner=0)
    waits.start([_add("b-0", "y+")], owner=1)   # shares the y+ compile
    compiler.futures["x+"].set_exception(ValueError("structured_output.regex could not be compiled: bad"))
    ((wait, grammars, failure),) = waits.settled()
    assert wait.request_ids == ["a-0", "a-1"] and grammars is None
    assert (failure.status, failure.message) == (400, "structured_output.regex could not be compiled: bad")
    assert not compiler.futures["y+"].cancelled()   # b-0 still waits for it
    assert len(waits) == 1 and "b-0" in waits


def test_an_overdue_group_is_refused_and_its_compiles_cancelled():
    compiler = _Compiler(timeout_s=0.01)
    waits = GrammarWaits(lambda: compiler, lambda: None)
    waits.start([_add("a-0", "x+"), _add("a-1", "x+")], owner=0)
    time.sleep(0.02)
    assert waits.seconds_to_deadline() == 0.0
    ((wait, _, failure),) = waits.settled()
    assert failure.reason == "grammar_timeout" and "0.01 s" in failure.message and wait.request_ids == ["a-0", "a-1"]
    assert compiler.futures["x+"].cancelled()


def test_withdrawing_requests_cancels_only_the_compiles_nobody_waits_for():
    compiler = _Compiler()
    waits = GrammarWaits(lambda: compiler, lambda: None)
    waits.start([_add("a-0", "x+"), _add("a-1", "x+"), _add("a-2", "z+")], owner=0)
    waits.start([_add("b-0", "y+")], owner=1)
    waits.cancel("a-2")
    assert compiler.futures["z+"].cancelled() and len(waits) == 3
    waits.cancel("a-0")
    assert not compiler.futures["x+"].cancelled()   # a-1 waits for it
    compiler.futures["x+"].set_result("X")
    ((wait, grammars, failure),) = waits.settled()
    assert wait.request_ids == ["a-1"] and grammars == ["X"] and failure is None
    (gone,) = waits.cancel_all(owner=1)
    assert gone.request_ids == ["b-0"] and compiler.futures["y+"].cancelled() and len(waits) == 0
    assert waits.cancel("b-0") is None
