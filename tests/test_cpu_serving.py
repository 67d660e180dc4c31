"""Serving on the CPU under load: the engine paces its steps (the token budget fitted to about 0.5 s a step,
long prompts chunked) and attends through PyTorch's fused attention (``sdpa``), so a long prompt prefills as
fast as transformers does and a disconnected client's work is dropped at the next step — a fresh request is
answered while orphaned work would still be running."""

import threading
import time

import httpx
import pytest

from server_process import ServerProcess
from tripath.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("pure_torch_one_thread")


def test_the_cpu_engine_paces_its_steps_and_its_tokens_do_not_change():
    default = LLM("tiny-llama", num_kv_blocks=64)
    assert default.config.step_pacing_s == 0.5 and default.backend_name == "sdpa"
    prompt = [(7 * i) % 250 + 1 for i in range(300)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    unpaced = LLM("tiny-llama", num_kv_blocks=64, step_time_target_s=0)
    want = unpaced.generate([prompt], params, use_tqdm=False)[0].output_token_ids
    paced = LLM("tiny-llama", num_kv_blocks=64, step_time_target_s=1e-9)   # every step over its target
    assert paced.scheduler.token_budget == 256   # before any step: the start budget
    paced.generate([[t + 1 for t in prompt[:200]]], params, use_tqdm=False)   # 200 tokens: shrunk to the grain
    assert paced.scheduler.token_budget == 64
    steps = paced.num_steps
    got = paced.generate([prompt], params, use_tqdm=False)[0].output_token_ids
    assert got == want and paced.num_steps - steps >= 300 // 64 + 5
    with pytest.raises(ValueError, match="step_time_target_s"):
        LLM("tiny-llama", num_kv_blocks=64, step_time_target_s=-1)


def _post(url: str, body: dict, timeout: float):
    try:
        return httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    except httpx.TimeoutException:
        return None


def test_a_fresh_request_is_answered_while_disconnected_clients_work_would_still_run(smollm2, tmp_path):
    """SmolLM2 with the server's defaults on the CPU: six clients send 1,500-token prompts and leave after 3 s;
    a fresh two-token request sent as they leave is answered in less than twice the time one such prompt
    takes alone (the orphans' prefills, 9,000 tokens, would take six times that), and the engine is idle
    soon after."""
    server = ServerProcess([smollm2, "--served-model-name", "m"], tmp_path / "server.log")
    try:
        prompt = [(i * 7919) % 40000 + 100 for i in range(1500)]
        started = time.monotonic()
        alone = _post(server.url, {"model": "m", "prompt": prompt, "max_tokens": 1}, timeout=300)
        single_s = time.monotonic() - started
        assert alone is not None and alone.status_code == 200
        leaving = [threading.Thread(target=_post, args=(server.url, {
            "model": "m", "prompt": [t + k for t in prompt], "max_tokens": 200, "ignore_eos": True}, 3.0))
            for k in range(1, 7)]
        for client in leaving:
            client.start()
        time.sleep(2.9)
        started = time.monotonic()
        fresh = _post(server.url, {"model": "m", "prompt": "Hi", "max_tokens": 2}, timeout=300)
        fresh_s = time.monotonic() - started
        for client in leaving:
            client.join()
        assert fresh is not None and fresh.status_code == 200
        assert fresh_s < 2 * single_s, (fresh_s, single_s)
        deadline = time.monotonic() + 2 * single_s + 5
        while True:
            metrics = server.metrics()
            busy = sum(v for k, v in metrics.items()
                       if k.startswith(("tripath:num_requests_running", "tripath:num_requests_waiting")))
            if busy == 0:
                break
            assert time.monotonic() < deadline, "the orphans' work still runs"
            time.sleep(0.2)
    finally:
        server.close()


def test_the_cpu_prefill_benchmark_compares_the_backends_with_transformers(tiny_hf_dir, capsys):
    from tripath.cli import main

    assert main(["bench", "cpu-prefill", tiny_hf_dir, "--prompt-len", "64", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:24].strip(): line.split() for line in lines[2:]}
    assert set(rows) == {"transformers (sdpa)", "tripath sdpa", "tripath torch"}
    assert len({row[-1] for row in rows.values()}) == 1   # the same first token from all three
