"""The core loop's typed messages (``tripath.server.transport.core_messages``) through the pipes' framing, and the one
core loop serving both transports: in process, the same ``CoreLoop`` steps the engine (its arrival window
included) through a local channel."""

import functools
import os

import pytest
import torch

from tripath.engine.core.engine_info import EngineInfo
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.scheduling.stats import EngineStats
from tripath.server.transport.core_messages import Abort, Add, Ready, StartFailed, Stop, Stopped, Update
from tripath.server.transport.core_wire import FrameReader, encode_stats, frame, send

INFO = EngineInfo(model="/models/tiny", vocab_size=320, dtype="float32", device="cpu", tensor_parallel_size=1,
                  max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512, decode_steps=8, backend="torch",
                  backend_choice="asked for", num_kv_blocks=64, block_size=16, kv_cache_dtype="auto",
                  generation_defaults={"temperature": 0.7})


def test_every_message_crosses_the_pipe_framing_whole_and_in_order():
    commands = [Add("srv-1-0", [1, 2, 3], SamplingParams(max_tokens=4, seed=3)), Abort("srv-0-0"), Stop()]
    stats = encode_stats(EngineStats(1, 0, 2, 63, 10, 4, 0, 7))
    messages = [Ready(INFO, "model tiny | backend torch", ("path", "/models/tiny")), StartFailed("no GPU"),
                Update(["srv-1-0"], [("srv-2-0", 400, "bad", "invalid_request_error", "invalid_request")],
                       [("srv-1-0", [5], False, None, None, None, (0.1, 0.2))], [(["srv-3-0"], 500, "boom",
                                                                                   "server_error")], stats, 1),
                Stopped()]
    read_end, write_end = os.pipe()
    try:
        send(write_end, commands)   # a list per frame, as the HTTP side sends them
        for message in messages:
            send(write_end, message)
        os.close(write_end)
        reader, got = FrameReader(), []
        while True:
            try:
                got += reader.receive(read_end)
            except EOFError:
                break
    finally:
        os.close(read_end)
    assert got == [commands, *messages]
    ready = got[1]
    assert ready.info == INFO and ready.info.generation_defaults == {"temperature": 0.7}
    assert isinstance(got[3], Update) and got[3].step_failures == 1 and got[4] == Stopped()
    with pytest.raises(AttributeError):
        ready.summary = "changed"   # frozen
    split = frame([Abort("a")])
    reader = FrameReader()
    assert reader.feed(split[:5]) == [] and reader.feed(split[5:]) == [[Abort("a")]]


def test_in_process_the_same_core_loop_steps_the_engine_with_its_arrival_window(monkeypatch):
    pytest.importorskip("fastapi")
    from fault_engines import faulty_llm
    from served_app import ServedApp
    from tripath.engine.core.engine_core import EngineCore
    from tripath.server.http.app import build_app
    from tripath.server.transport.core_loop import CoreLoop

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    threads = torch.get_num_threads()
    served = ServedApp(build_app(functools.partial(faulty_llm, 0.0, 64), model_name="tiny", engine_in_process=True))
    engine = served.engine
    try:
        assert isinstance(engine._loop, CoreLoop) and isinstance(engine.core, EngineCore)
        assert engine.max_model_len == engine.core.info().max_model_len and engine.vocab_size > 0
        core, asked = engine.core, []
        step = core.step

        def spy(decode_steps=None):
            asked.append(decode_steps)
            return step(decode_steps)

        core.step = spy
        r = served.post({"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
        assert asked and asked[0] == 1   # the step right after an add decodes one token at a time
    finally:
        served.close()
        torch.set_num_threads(threads)
    assert engine.core is None and not engine.alive
