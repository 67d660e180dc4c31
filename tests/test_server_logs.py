"""What ``tripath serve`` logs, read from the log of real server processes on loopback: no access log line per
``/health`` poll (nor ``/ping`` or ``/metrics``) at ``--log-level info``, the API's lines kept; vLLM's periodic
engine stats line while there is work and not after it, from one process of several API servers; the request
log of ``--enable-log-requests`` with ``--max-log-len``; the flags that turn them off or retarget them, and
usage errors that name the flag."""

import logging
import re
import time

import httpx
import pytest

from server_process import ServerProcess

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from server_models import save_tiny_hf_llama  # noqa: E402  (needs transformers)

pytestmark = pytest.mark.usefixtures("pure_torch_one_thread")

INTERVAL = 0.2
PRESET = ["--model", "tiny-llama", "--backend", "torch", "--num-kv-blocks", "64", "--max-model-len", "512"]
STATS = re.compile(r"(\S+ \S+) (INFO|DEBUG) tripath\.server: Engine 000: Avg prompt throughput: ([\d.]+) tokens/s, "
                   r"Avg generation throughput: ([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, "
                   r"(?:Preemptions: \d+, )?GPU KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%$", re.M)


def log_once(server, text: str, count: int = 1):
    """Wait until the server's log holds ``text`` (``count`` times); the log."""
    def holds():
        log = server.log_path.read_text()
        return log if log.count(text) >= count else None
    return wait_for(holds, repr(text))


def wait_for(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A text model's server at --log-level info with a short stats interval and the request log on."""
    path = tmp_path_factory.mktemp("hf")
    save_tiny_hf_llama(path)
    proc = ServerProcess(["--model", str(path), "--served-model-name", "m", "--backend", "torch", "--num-kv-blocks",
                          "64", "--max-model-len", "256", "--log-stats-interval", str(INTERVAL),
                          "--enable-log-requests", "--max-log-len", "4"],
                         tmp_path_factory.mktemp("log") / "server.log", log_level="info")
    yield proc
    proc.close()


def test_health_polls_stay_out_of_the_access_log_at_info(server):
    """The start-up's polls (503) and these (200) of /health, /ping and /metrics leave no line; the API's do."""
    with httpx.Client(base_url=server.url, timeout=30) as h:
        for _ in range(5):
            assert h.get("/health").status_code == h.get("/ping").status_code == h.get("/metrics").status_code == 200
        assert h.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 2}).status_code == 200
        assert h.get("/v1/models").status_code == 200
    log = log_once(server, '"GET /v1/models HTTP/1.1" 200')
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert not re.search(r'"(GET|POST) /(health|ping|metrics)', log)


def test_the_quiet_paths_are_debug_lines_shown_at_debug():
    """At --log-level debug the quiet paths' lines are there, as DEBUG records; query strings do not matter."""
    from tripath.server.metrics.observability import QuietAccessLog

    records = []
    logger = logging.getLogger("tripath.test.access")
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    logger.addFilter(QuietAccessLog(["/health", "/metrics"]))
    try:
        for level in (logging.DEBUG, logging.INFO):
            logger.setLevel(level)
            for path in ("/health", "/metrics?x=1", "/v1/completions"):
                logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", path, "1.1", 200)
    finally:
        logger.removeHandler(handler)
    assert [(r.args[2], r.levelname) for r in records] == [("/health", "DEBUG"), ("/metrics?x=1", "DEBUG"),
                                                           ("/v1/completions", "INFO"), ("/v1/completions", "INFO")]


def test_the_stats_line_comes_while_there_is_work_and_stops_after(server):
    start = len(server.log_path.read_text())   # lines of earlier tests' work come before
    with httpx.Client(base_url=server.url, timeout=60) as h:
        r = h.post("/v1/completions", json={"model": "m", "prompt": "The quick brown fox", "max_tokens": 40,
                                            "ignore_eos": True})
        assert r.status_code == 200
    busy = wait_for(lambda: [m for m in STATS.finditer(server.log_path.read_text(), start) if float(m[4]) > 0],
                    "a stats line with generated tokens")
    assert busy[0][2] == "INFO"
    # once idle: one line of zeros (the interval after the work), then nothing at INFO
    idle = wait_for(lambda: [m for m in STATS.finditer(server.log_path.read_text())
                             if m[3] == m[4] == "0.0" and m[5] == m[6] == "0" and m.start() > busy[-1].start()],
                    "an idle stats line")
    time.sleep(6 * INTERVAL)
    assert [m for m in STATS.finditer(server.log_path.read_text()) if m.start() > idle[0].start()] == []


def test_the_request_log_says_what_arrived_and_how_it_ended(server):
    with httpx.Client(base_url=server.url, timeout=60) as h:
        ids = h.post("/tokenize", json={"prompt": "Hello world, hello server!"}).json()["tokens"]
        r = h.post("/v1/completions", json={"model": "m", "prompt": "Hello world, hello server!", "max_tokens": 3,
                                            "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200
        body = {"model": "m", "prompt": "Streaming tokens", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with h.stream("POST", "/v1/completions", json=body) as stream:
            next(line for line in stream.iter_lines() if line.startswith("data:"))   # then leave
    log = log_once(server, "finish_reason: abort")
    received = re.findall(r"Received request (srv-\d+-0): prompt: 'Hell', params: (SamplingParams\(max_tokens=3, "
                          r"temperature=0.*?\)), prompt_token_ids: (\[.*?\]), num_prompt_tokens: (\d+), "
                          r"lora_request: None\.", log)
    assert len(received) == 1   # --max-log-len 4: four characters, four token ids
    request_id, params, logged_ids, count = received[0]
    assert logged_ids == str(ids[:4]) and int(count) == len(ids)
    assert re.search(rf"Finished request {request_id}: finish_reason: length, num_prompt_tokens: {len(ids)}, "
                     r"num_generated_tokens: 3, ttft: [\d.]+ s, e2e: [\d.]+ s\.", log)
    assert re.search(r"Received request srv-\d+-0: prompt: 'Stre'", log)
    assert re.search(r"Finished request srv-\d+-0: finish_reason: abort, num_prompt_tokens: \d+, "
                     r"num_generated_tokens: \d+, ttft: [\d.]+ s", log)


def test_several_api_servers_log_the_stats_once(tmp_path):
    """With two API servers only API server 0 logs the line, from the merged metrics (both servers' tokens)."""
    server = ServerProcess([*PRESET, "--api-server-count", "2", "--log-stats-interval", str(INTERVAL)],
                           tmp_path / "server.log", log_level="info")
    try:
        for _ in range(4):   # new connections: the kernel spreads them over both API servers
            r = httpx.post(server.url + "/v1/completions", json={"model": "tiny-llama", "prompt": [5, 6, 7],
                                                                 "max_tokens": 16, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200
        wait_for(lambda: [m for m in STATS.finditer(server.log_path.read_text()) if float(m[4]) > 0],
                 "a stats line with generated tokens")
    finally:
        server.close()
    assert server.log_path.read_text().count("engine stats every 0.2 s") == 1


def test_flags_turn_the_stats_off_and_retarget_the_quiet_paths(tmp_path):
    server = ServerProcess([*PRESET, "--disable-log-stats", "--disable-access-log-for-endpoints", "/v1/models"],
                           tmp_path / "server.log", log_level="info")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as h:
            assert h.get("/v1/models").status_code == h.get("/health").status_code == 200
            assert h.post("/v1/completions", json={"model": "tiny-llama", "prompt": [1, 2], "max_tokens": 2}
                          ).status_code == 200
        log = log_once(server, "POST /v1/completions")
    finally:
        server.close()
    assert '"GET /health HTTP/1.1" 200' in log and "GET /v1/models" not in log
    assert "Engine 000:" not in log and "engine stats every" not in log and "Received request" not in log


@pytest.mark.parametrize("argv, message", [
    (["--enable-log-requests", "--disable-log-requests"], "--enable-log-requests and --disable-log-requests "
                                                          "contradict each other"),
    (["--log-stats-interval", "0"], "--log-stats-interval must be > 0 seconds, got 0.0"),
    (["--log-stats-interval", "nan"], "--log-stats-interval must be > 0 seconds, got nan"),
    (["--max-log-len", "-1"], "--max-log-len must be >= 0, got -1"),
    (["--disable-access-log-for-endpoints", "/health,metrics"], "--disable-access-log-for-endpoints takes paths "
                                                                "that start with '/', got 'metrics'"),
    (["--metric-names", "tgi"], "argument --metric-names: invalid choice: 'tgi'"),
])
def test_usage_errors_name_the_flag(capsys, argv, message):
    from tripath.cli import main

    assert main(["serve", "tiny-llama", *argv, "--port", "0"]) == 2
    assert message in capsys.readouterr().err


def test_the_stats_line_reads_the_metrics_as_vllm_writes_it():
    """Throughputs over the interval, preemptions when there were some, the hit rate of the interval's lookups
    (all of them when it had none), INFO while busy and for one interval after, DEBUG when idle."""
    from tripath.engine.scheduling.stats import EngineStats
    from tripath.server.metrics.metrics import ChoiceTimes, ServerMetrics
    from tripath.server.metrics.stats_log import StatsLine

    metrics, line = ServerMetrics("m"), StatsLine()
    assert line.update(metrics.families(), 100.0) is None   # the start
    times = ChoiceTimes(arrival=0.0, num_prompt_tokens=30, max_tokens=50)
    metrics.observe_tokens(times, 1, 1.0)
    metrics.observe_engine(EngineStats(2, 1, 8, 32, 40, 10, 3, 5), num_new_tokens=20)
    level, text = line.update(metrics.families(), 102.0)
    assert (level, text) == (logging.INFO, "Engine 000: Avg prompt throughput: 15.0 tokens/s, Avg generation "
                             "throughput: 10.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, Preemptions: 3, GPU KV "
                             "cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    metrics.observe_engine(EngineStats(0, 0, 0, 32, 40, 10, 3, 6))
    assert line.update(metrics.families(), 104.0) == (
        logging.INFO, "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
                      "Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, Prefix cache hit rate: 25.0%")
    assert line.update(metrics.families(), 106.0)[0] == logging.DEBUG
