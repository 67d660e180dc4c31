"""The processes of ``tripath serve``: several API servers on one engine core (``api_servers.py``: the
supervisor, its signals and children), the listening socket bound first (``listen.py``), one exit status per
stop signal (``stop_signals.py``), ``/metrics`` across the API servers (``metrics_peers.py``) and an API server's
tokenizer helper process for large ``/tokenize`` requests (``tokenizer_process.py``).
"""
