"""What ``tripath serve`` tells its operators: the Prometheus metrics (``metrics.py``, vLLM's families;
``metric_kinds.py``, their building blocks), the options of metrics and logs (``observability.py``), the
periodic stats line (``stats_log.py``), the request log (``request_log.py``), and the start-up line and
``vllm:cache_config_info`` (``startup.py``).
"""
