"""The engine loop in a background thread, with an asyncio front for the HTTP server.

The engine is not thread-safe, so only the loop thread touches it: handlers post adds and
aborts to an inbox and receive each step's outputs on an asyncio queue of their choosing, each
output tagged, so the sub-requests of one HTTP request (a list of prompts) share one queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Any

from core.engine.engine import Engine


@dataclass
class _Add:
    kwargs: dict
    future: asyncio.Future
    sink: asyncio.Queue
    tag: Any


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.Queue, Any]] = {}
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

    def kv_stats(self):
        return self.engine.allocator.stats()

    async def add(self, sink: asyncio.Queue | None = None, tag: Any = None, **kwargs) -> tuple[str, asyncio.Queue]:
        """Submit a request; its outputs arrive on `sink` (a new queue if None) as (tag, output),
        and (tag, None) if the engine stops. Raises what Engine.add_request raises."""
        item = _Add(kwargs, self.loop.create_future(), sink if sink is not None else asyncio.Queue(), tag)
        self._inbox.put(("add", item))
        self._wake.set()
        rid = await item.future
        return rid, item.sink

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
                self._streams[rid] = (item.sink, item.tag)
                self._deliver(_set_result, item.future, rid)
            else:
                if item in self.engine.requests:
                    self.engine.abort(item)
                stream = self._streams.pop(item, None)
                if stream is not None:
                    self._deliver(stream[0].put_nowait, (stream[1], None))

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
                        self._deliver(stream[0].put_nowait, (stream[1], out))
                        if out.finished:
                            self._streams.pop(out.request_id, None)
        except BaseException as e:  # surface a crashed loop through /health instead of hanging requests
            self.error = e
            for sink, tag in self._streams.values():
                self._deliver(sink.put_nowait, (tag, None))
            raise


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
