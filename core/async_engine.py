"""The engine loop in a background thread, with an asyncio front for the HTTP server.

The engine is not thread-safe, so only the loop thread touches it: handlers post adds and
aborts to an inbox and receive each step's outputs through their own asyncio queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

from core.engine import Engine


@dataclass
class _Add:
    kwargs: dict
    future: asyncio.Future
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread = threading.Thread(target=self._run, name="servelab-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=10)

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + self._inbox.qsize()

    async def add(self, **kwargs) -> tuple[str, asyncio.Queue]:
        """Submit a request; raises what Engine.add_request raises (RequestError, ...)."""
        item = _Add(kwargs, self.loop.create_future())
        self._inbox.put(("add", item))
        self._wake.set()
        rid = await item.future
        return rid, item.outputs

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # ---- the loop thread -----------------------------------------------------------------

    def _deliver(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    rid = self.engine.add_request(**item.kwargs)
                except Exception as e:  # the handler re-raises it as an HTTP error
                    self._deliver(_set_exception, item.future, e)
                    continue
                self._streams[rid] = item.outputs
                self._deliver(_set_result, item.future, rid)
            else:
                if item in self.engine.requests:
                    self.engine.abort(item)
                stream = self._streams.pop(item, None)
                if stream is not None:
                    self._deliver(stream.put_nowait, None)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        self._deliver(stream.put_nowait, out)
                        if out.finished:
                            self._streams.pop(out.request_id, None)
        except BaseException as e:  # surface a crashed loop through /health instead of hanging requests
            self.error = e
            for stream in self._streams.values():
                self._deliver(stream.put_nowait, None)
            raise


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

