"""The HTTP side of ``tripath serve``: the FastAPI app and its routes (``app.py``, ``utility_routes.py``,
``openai_responses.py``; ``tokenizing.py``: the work of ``/tokenize`` and ``/detokenize``); request bodies and
the checks every route makes (``protocol.py``, ``request_body.py``, ``engine_requests.py``,
``sampling_defaults.py``, ``chat_prepare.py``, ``auth.py``, ``large_texts.py``; ``connections.py`` below the
app); a generation on the handler side and its answers (``generation.py``, ``detokenize.py``, ``responses.py``,
``responses_output.py``, ``sse.py``, ``logprob_format.py``); tools and their parsers (``tools/``); what every
route reads (``server_state.py``).
"""
