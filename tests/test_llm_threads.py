"""``LLM`` called from several threads: ``generate``, ``stream`` and the step API run one call after the other,
each with its own results (two concurrent ``generate`` calls used to share request ids and lose both results).
The stand-in model on the torch backend, real threads, no sleeps."""

import contextlib
import threading

import pytest

from tripath.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = {"a": [[3, 14, 15, 9, 26], [5, 35, 8]], "b": [[2, 7, 18, 28], [44, 1], [9, 9, 9]]}
WAIT_S = 60   # generous: only a broken engine waits this long

pytestmark = pytest.mark.usefixtures("torch_paths_and_validation")


@pytest.fixture(scope="module")
def llm(tiny_lm):
    return LLM(tiny_lm, backend="torch", num_kv_blocks=64, block_size=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def expected(llm):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        return {k: tokens(llm.generate(p, GREEDY, use_tqdm=False)) for k, p in PROMPTS.items()}


def tokens(outputs):
    return [o.output_token_ids for o in outputs]


def run_threads(*targets):
    """Start every target at once (a barrier), join them; the exceptions they raised."""
    barrier, errors = threading.Barrier(len(targets)), []

    def run(target):
        try:
            barrier.wait(WAIT_S)
            target()
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    return errors


def test_generate_from_two_threads_gives_each_its_own_results(llm, expected):
    for _ in range(25):
        results = {}

        def call(key):
            return lambda: results.__setitem__(key, tokens(llm.generate(PROMPTS[key], GREEDY, use_tqdm=False)))

        assert run_threads(call("a"), call("b")) == []
        assert results == expected
        assert not llm.has_unfinished_requests()


def test_the_step_api_in_one_thread_and_generate_in_another(llm, expected):
    done, generated = {}, {}

    def step_api():
        ids = [llm.add_request(p, GREEDY, request_id=f"mine-{i}") for i, p in enumerate(PROMPTS["a"])]
        while len(done) < len(ids):
            done.update({o.request_id: o.output_token_ids for o in llm.step() if o.finished})

    def offline():
        try:
            generated["b"] = tokens(llm.generate(PROMPTS["b"], GREEDY, use_tqdm=False))
        except RuntimeError as error:   # the step API's requests were unfinished when generate() began
            assert "generate() needs an idle engine" in str(error)

    assert run_threads(step_api, offline) == []
    assert [done[f"mine-{i}"] for i in range(2)] == expected["a"]
    assert generated.get("b", expected["b"]) == expected["b"]


def test_a_stream_holds_the_engine_until_it_is_exhausted_or_closed(llm, expected):
    started, results = threading.Event(), {}

    def streaming():
        stream = llm.stream(PROMPTS["a"], GREEDY)
        outputs = [next(stream)]
        started.set()
        outputs += list(stream)
        results["a"] = {o.request_id for o in outputs}

    def offline():
        assert started.wait(WAIT_S)
        results["b"] = tokens(llm.generate(PROMPTS["b"], GREEDY, use_tqdm=False))

    assert run_threads(streaming, offline) == []
    assert results["b"] == expected["b"] and len(results["a"]) == 2   # the stream saw its own requests only
    with contextlib.closing(llm.stream(PROMPTS["a"], GREEDY)) as stream:
        next(stream)
        with pytest.raises(RuntimeError, match="generate\\(\\) needs an idle engine"):
            llm.generate(PROMPTS["b"], GREEDY, use_tqdm=False)   # the same thread: refused, not a deadlock
    assert not llm.has_unfinished_requests()   # closing the stream aborted its requests
    assert run_threads(lambda: llm.generate(PROMPTS["b"], GREEDY, use_tqdm=False)) == []   # and released it
