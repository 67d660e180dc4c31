"""The processes of ``tripath serve``: several API servers on one engine core (``api_servers.py``: the
supervisor, its signals and children), the listening socket bound first (``listen.py``), one exit status per
stop signal (``stop_signals.py``) and ``/metrics`` across the API servers (``metrics_peers.py``).
"""
