"""The server's parts without a server process: streamed detokenisation across multi-byte characters, stop
strings, the chat template helper and ``LLM.chat``, the online benchmark's workload, and (in process, through
ASGI, with the engine on a thread or in its own process) a failing engine step (500, 503 out of memory, the
loop goes on) and a request timeout (504)."""

import functools
import gc
import math
import statistics
import time
import weakref

import pytest
import torch

from tripath.bench.serve_online import arrival_offsets, make_workload
from tripath.cli import main
from tripath.engine import LLM, SamplingParams
from tripath.engine.chat import ChatTemplateError, chat_token_ids, normalise_messages, render_chat
from tripath.server.http.detokenize import IncrementalDetokenizer, StopMatcher

from fault_engines import ADD_POISON, OOM_POISON, POISON, faulty_llm

MULTIBYTE = "naïve café — 日本語 ✓ 🙂 done"


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    from server_models import build_tokenizer
    return build_tokenizer()


def test_streamed_text_is_whole_characters_and_equals_the_decode(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    assert any(tokenizer.decode(ids[:k]).endswith("\ufffd") for k in range(len(ids)))  # characters span tokens
    d = IncrementalDetokenizer(tokenizer)
    pieces = [d.push(t) for t in ids]
    assert "" in pieces                                   # held back inside a character
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + d.flush() == MULTIBYTE == d.text


def test_an_unfinished_character_at_the_end_is_flushed_as_the_decode_shows_it(tokenizer):
    ids = tokenizer.encode("ok 🙂")[:-1]                  # cut inside the emoji's bytes
    d = IncrementalDetokenizer(tokenizer)
    streamed = "".join(d.push(t) for t in ids)
    assert streamed == "ok "
    assert streamed + d.flush() == tokenizer.decode(ids)


def test_stop_strings_cut_before_the_first_match_across_pieces():
    m = StopMatcher(["o w", "zz"])
    out = [m.feed(p) for p in ["Hel", "lo", " wo", "rld"]]
    assert "".join(out) == "Hell" and m.stopped and out[-1] == ""
    m = StopMatcher(["bc"])
    assert m.feed("ab") == "a"          # "b" may start "bc": held back
    assert m.feed("d") == "bd"          # it did not
    assert m.feed("xb") == "x" and m.feed("", final=True) == "b"
    assert StopMatcher([]).feed("anything") == "anything"


def test_chat_helper_checks_messages_and_templates(tokenizer):
    assert normalise_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]}]) == \
        [{"role": "user", "content": "ab"}]
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        normalise_messages([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="image"):
        normalise_messages([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    with pytest.raises(ValueError, match="empty"):
        normalise_messages([])
    with pytest.raises(ChatTemplateError, match="no tokenizer"):
        render_chat(None, [{"role": "user", "content": "x"}])
    from server_models import build_tokenizer
    with pytest.raises(ChatTemplateError, match="no chat template|has none"):
        render_chat(build_tokenizer(chat_template=None), [{"role": "user", "content": "x"}])
    text = render_chat(tokenizer, [{"role": "user", "content": "Hi"}])
    assert text == "<|user|>Hi\n<|assistant|>"
    assert tokenizer.decode(chat_token_ids(tokenizer, [{"role": "user", "content": "Hi"}])) == text


def test_llm_chat_goes_through_the_template(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from server_models import save_tiny_hf_llama
    save_tiny_hf_llama(tmp_path)
    llm = LLM(str(tmp_path), backend="torch", num_kv_blocks=32)
    conversations = [[{"role": "user", "content": "Hello"}],
                     [{"role": "system", "content": "Brief."}, {"role": "user", "content": "The fox"}]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    chats = llm.chat(conversations, params, use_tqdm=False)
    prompts = [chat_token_ids(llm.tokenizer, c) for c in conversations]
    plain = llm.generate(prompts, params, use_tqdm=False)
    for chat, ref, prompt in zip(chats, plain, prompts):
        assert chat.prompt_token_ids == prompt and chat.output_token_ids == ref.output_token_ids
    one = llm.chat(conversations[0], params, use_tqdm=False)   # a single conversation
    assert len(one) == 1 and one[0].output_token_ids == chats[0].output_token_ids
    with pytest.raises(ChatTemplateError):
        LLM("tiny-llama", backend="torch", num_kv_blocks=8).chat(conversations[0], params)


def test_benchmark_workload_and_arrivals_are_seeded():
    w = make_workload(50, 20, 0.5, 8, vocab_size=100, seed=3)
    assert w == make_workload(50, 20, 0.5, 8, vocab_size=100, seed=3)
    lengths = [len(p) for p in w.prompts]
    assert min(lengths) >= 10 and max(lengths) <= 30 and len(set(lengths)) > 5
    assert all(0 <= t < 100 for p in w.prompts for t in p)
    offsets = arrival_offsets(4000, 10.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0 and statistics.fmean(gaps) == pytest.approx(0.1, rel=0.08)
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.1)         # exponential: sd == mean
    assert arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="input_len_spread"):
        make_workload(1, 4, 1.5, 1, 10, 0)


def test_bench_serve_refuses_an_unknown_workload(capsys):
    assert main(["bench", "serve", "--workload", "bogus", "--num-requests", "3"]) == 2
    assert "--workload" in capsys.readouterr().err


# ---- through ASGI: the engine on a thread of the test process, or in its own process (the default) --------
ENGINES = pytest.mark.parametrize("in_process", [True, False], ids=["engine-thread", "engine-process"])


def _app(slow_s=0.0, in_process=True, **kw):
    pytest.importorskip("fastapi")
    from tripath.server.http.app import build_app

    from served_app import ServedApp

    served = ServedApp(build_app(functools.partial(faulty_llm, slow_s), model_name="tiny",
                                 engine_in_process=in_process, **kw))
    return served, served.engine


def _idle(engine):
    """Requests running and waiting, KV blocks held, as the engine last reported them."""
    m = engine.metrics
    return m.running._value.get(), m.waiting._value.get(), m.kv_blocks_used._value.get()


def _wait_idle(engine, timeout_s: float = 60.0):
    """The engine's last report once it is idle, or after ``timeout_s`` (generous: only a leak waits that long)."""
    deadline = time.monotonic() + timeout_s
    while _idle(engine) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _idle(engine)


@ENGINES
def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(monkeypatch, in_process):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    threads = torch.get_num_threads()
    served, engine = _app(in_process=in_process)
    try:
        r = served.post({"model": "tiny", "prompt": POISON + [4], "max_tokens": 4})
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "server_error" and "injected fault" in r.json()["error"]["message"]
        r = served.post({"model": "tiny", "prompt": POISON, "max_tokens": 4, "stream": True})
        assert r.status_code == 200 and "injected fault" in r.text and r.text.rstrip().endswith("data: [DONE]")
        r = served.post({"model": "tiny", "prompt": OOM_POISON, "max_tokens": 4})
        assert r.status_code == 503 and "out of memory" in r.json()["error"]["message"]
        r = served.post({"model": "tiny", "prompt": ADD_POISON, "max_tokens": 4})
        assert r.status_code == 500 and "injected add fault" in r.json()["error"]["message"]
        good = served.post({"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 5, "ignore_eos": True})
        assert good.status_code == 200 and len(good.json()["choices"][0]["token_ids"]) == 5
        assert engine.metrics.step_failures._value.get() == 3
        assert _wait_idle(engine) == (0, 0, 0)
    finally:
        served.close()
        torch.set_num_threads(threads)
    assert not engine.alive   # released
    if in_process:
        assert engine.core is None


def _sample(text: str, name: str, **labels) -> float:
    """The value of the ``/metrics`` sample ``name`` with ``labels`` (among others), 0 when there is none."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@ENGINES
def test_a_refused_add_counts_as_one_rejection_by_reason_not_as_an_abort(monkeypatch, in_process):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    threads = torch.get_num_threads()
    served, engine = _app(slow_s=0.01, in_process=in_process)   # 200 steps: 2 s at least, on any machine
    try:
        r = served.post({"model": "tiny", "prompt": ADD_POISON, "max_tokens": 4})
        assert r.status_code == 500 and "injected add fault" in r.json()["error"]["message"]
        # two prompts: the engine refuses both together (none of them runs: nothing to withdraw or abort)
        r = served.post({"model": "tiny", "prompt": [[4, 5, 6], ADD_POISON], "max_tokens": 200, "ignore_eos": True})
        assert r.status_code == 500 and "injected add fault" in r.json()["error"]["message"]
        r = served.post({"model": "tiny", "prompt": [4, 5], "max_tokens": 300})   # more KV blocks than it has
        assert r.status_code == 400 and "needs more KV blocks" in r.json()["error"]["message"]
        assert _wait_idle(engine) == (0, 0, 0)
        text = served.get("/metrics").text
        rejected = "tripath:requests_rejected_total"
        assert _sample(text, rejected, reason="engine_error") == 2, text
        assert _sample(text, rejected, reason="invalid_request") == 1, text
        for reason in ("abort", "error", "stop", "length"):   # no request ran to an end
            assert _sample(text, "tripath:request_success_total", finished_reason=reason) == 0, (reason, text)
    finally:
        served.close()
        torch.set_num_threads(threads)


@ENGINES
def test_a_request_past_its_timeout_gets_504_and_is_aborted(monkeypatch, in_process):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    threads = torch.get_num_threads()
    # 200 steps of at least 20 ms (4 s) pass the 2 s timeout on any machine; 3 steps come well within it
    served, engine = _app(slow_s=0.02, in_process=in_process, request_timeout_s=2.0)
    try:
        r = served.post({"model": "tiny", "prompt": [4, 5], "max_tokens": 200, "ignore_eos": True})
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        assert _wait_idle(engine) == (0, 0, 0)
        quick = served.post({"model": "tiny", "prompt": [4, 5], "max_tokens": 3, "ignore_eos": True})
        assert quick.status_code == 200
    finally:
        served.close()
        torch.set_num_threads(threads)


def test_the_server_freezes_the_heap_it_starts_with_and_releases_the_engine(monkeypatch):
    """Once the engine is built the server moves every live object out of the collector's generations; at
    shutdown it moves them back, so the engine (its launch is patched: a reference cycle) is collected."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    threads = torch.get_num_threads()
    served, engine = _app()
    try:
        assert gc.get_freeze_count() > 0
        llm = weakref.ref(engine.core)
    finally:
        served.close()
        torch.set_num_threads(threads)
    assert gc.get_freeze_count() == 0
    assert llm() is None
