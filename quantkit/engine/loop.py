"""The engine on its own thread, for asyncio callers (the server).

Coroutines `submit` a request and read its events from an asyncio queue: ("text", str) as text
becomes safe to show, then one ("done", engine.Finished) or ("error", message). `abort` ends a
request (a client that went away). The thread applies submissions and aborts between steps, steps
while there is work and sleeps on an event otherwise. More than `max_waiting` requests not yet
admitted make `submit` raise `Busy` at once (the server answers 503), so a burst queues a bounded
number of requests instead of growing without limit. `drain` stops taking requests, lets the
running ones finish for up to a timeout, then aborts what is left and stops the thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Optional, Sequence as Seq

from quantkit.engine.engine import Engine, Finished
from quantkit.runtime.sampling import SamplingParams

log = logging.getLogger(__name__)


def _put_all(items: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


class Busy(Exception):
    """Too many requests are waiting; try again later."""


class Draining(Exception):
    """The engine is shutting down and takes no new requests."""


class EngineLoop:
    def __init__(self, engine: Engine, max_waiting: int = 64):
        self.engine, self.max_waiting = engine, max_waiting
        self._lock = threading.Lock()
        self._adds: list[tuple] = []
        self._aborts: list[str] = []
        self._wake = threading.Event()
        self._outbox: list[tuple] = []  # (asyncio loop, queue, event) made by this step, delivered at its end
        self._stop = threading.Event()
        self.draining = False
        self.failed: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="quantkit-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def waiting(self) -> int:
        return len(self._adds) + len(self.engine.scheduler.waiting)

    def submit(self, request_id: str, prompt: Seq[int], params: SamplingParams,
               loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        """Queue a request; its events arrive on the returned queue (on `loop`)."""
        events: asyncio.Queue = asyncio.Queue()
        post = lambda event: self._outbox.append((loop, events, event))  # noqa: E731  (delivered after the step)
        with self._lock:
            if self.draining or self._stop.is_set():
                raise Draining("the server is shutting down")
            if self.waiting >= self.max_waiting:
                raise Busy(f"{self.waiting} requests are already waiting (--max-waiting {self.max_waiting}); "
                           "retry later")
            self._adds.append((request_id, list(prompt), params, post))
        self._wake.set()
        return events

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def _apply(self) -> None:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        for rid, prompt, params, post in adds:
            try:
                self.engine.add(prompt, params, rid, on_text=lambda text, post=post: post(("text", text)),
                                on_finish=lambda f, post=post: post(("done", f)))
            except ValueError as exc:  # checked by the server before; a race with nothing else
                post(("error", str(exc)))
        for rid in aborts:
            self.engine.abort(rid)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._apply()
            self._deliver()
            if not self.engine.has_work:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception as exc:  # a failed step fails its requests, not the server
                log.exception("engine step failed")
                self.failed = f"{type(exc).__name__}: {exc}"
                self._fail_all(self.failed)
            self._deliver()
        self._apply()
        for rid in list(self.engine.sequences):
            self.engine.abort(rid)
        self._deliver()

    def _deliver(self) -> None:
        """Hand the step's events to their event loops, one wake-up per loop per step (a wake-up per token
        per request took a core from the step's threads on a 2-core machine)."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        by_loop: dict = {}
        for loop, queue, event in batch:
            by_loop.setdefault(loop, []).append((queue, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: its requests' clients are gone
                pass

    def _fail_all(self, message: str) -> None:
        for rid in list(self.engine.sequences):
            self.engine.abort(rid, error=message)

    def drain(self, timeout: float) -> bool:
        """Stop taking requests, give the running ones `timeout` seconds, abort the rest, stop the thread.
        True when every request finished by itself."""
        with self._lock:
            self.draining = True
        deadline = time.monotonic() + timeout
        while (self.engine.has_work or self._adds) and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        clean = not self.engine.has_work
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        return clean
