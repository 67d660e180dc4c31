"""Between the HTTP side and the engine core: what the handlers and an engine exchange (``submissions.py``),
the typed messages (``core_messages.py``) and their pipes (``core_wire.py``); the one loop around the
:class:`~tripath.engine.core.engine_core.EngineCore` (``core_loop.py``, with ``engine_steps.py``,
``grammar_waits.py``, ``core_frontends.py``), run in the core process (``core_process.py``; its client in the
HTTP process, ``engine_client.py``) or on a thread of the HTTP process (``in_process.py``); the handlers'
side both clients share (``engine_front.py``).
"""
