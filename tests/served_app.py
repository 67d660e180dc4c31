"""An app served as ``tripath serve`` serves it, without a socket: its engine started on an event loop that
keeps running (on a thread of the test process, as uvicorn's loop runs), requests sent through ASGI on that
same loop. The engine core's pipes are watched by the loop that started it, so every request of a test goes
through that one loop."""

from __future__ import annotations

import asyncio
import threading

import httpx


class ServedApp:
    def __init__(self, app, ready_timeout_s: float = 120.0):
        self.app = app
        self.engine = app.state.server.engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="served-app-loop", daemon=True)
        self._thread.start()
        self.run(self._start())
        if not self.engine.wait_ready(ready_timeout_s):
            self.close()
            raise RuntimeError(f"the engine was not ready in {ready_timeout_s} s: {self.engine.startup_error}")

    async def _start(self) -> None:
        self.engine.start()

    def run(self, coroutine, timeout_s: float = 120.0):
        """Run ``coroutine`` on the app's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    async def request(self, path: str = "/v1/completions", body: dict | None = None) -> httpx.Response:
        """A GET of ``path``, or a POST of ``body`` (on the app's loop: await it there, or :meth:`post`)."""
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://test",
                                     timeout=60) as client:
            return await (client.get(path) if body is None else client.post(path, json=body))

    def post(self, body: dict, path: str = "/v1/completions") -> httpx.Response:
        return self.run(self.request(path, body))

    def get(self, path: str) -> httpx.Response:
        return self.run(self.request(path))

    def close(self, stop_timeout_s: float = 30.0) -> None:
        """Stop the engine (from this thread, as the lifespan does from a worker), then the loop."""
        try:
            self.engine.stop(stop_timeout_s)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
