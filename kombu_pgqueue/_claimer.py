"""Claims off the event loop's thread, for consumers that run in Celery's event loop.

A claim is a round trip to PostgreSQL. In a prefork worker the main process runs
the event loop: it claims, hands tasks to the pool, reads their results and acks,
all in one thread, and while a claim waits on the network it does none of the rest
(py-spy of a draining prefork worker: about a fifth of that thread's time). Here a
helper thread runs the claim and building of payloads; the event loop learns of the
result through a pipe registered as a reader, and delivers it in its own thread, so
Kombu's and Celery's state is only ever touched there.
"""

from __future__ import annotations

import collections
import logging
import os
import queue as stdqueue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: (channel, queue, limit, payloads or None, error or None)
Result = tuple[Any, str, int, "list[dict[str, Any]] | None", "BaseException | None"]


class Claimer:
    """One helper thread; jobs are (channel, queue, limit)."""

    def __init__(self) -> None:
        self._jobs: stdqueue.SimpleQueue[tuple[Any, str, int] | None] = stdqueue.SimpleQueue()
        self._results: collections.deque[Result] = collections.deque()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._thread = threading.Thread(target=self._run, name="pgqueue-claimer", daemon=True)
        self._thread.start()
        self.closed = False

    def fileno(self) -> int:
        return self._read_fd

    def submit(self, channel: Any, queue: str, limit: int) -> None:
        self._jobs.put((channel, queue, limit))

    def results(self) -> list[Result]:
        """Every result that arrived; empties the pipe (call when it is readable)."""
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            channel, queue, limit = job
            try:
                result: Result = (channel, queue, limit, channel.fetch(queue, limit), None)
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop's thread
                result = (channel, queue, limit, None, exc)
            self._results.append(result)
            try:
                os.write(self._write_fd, b"x")
            except BlockingIOError:
                pass  # the pipe is full of wakeups already
            except OSError:
                return  # closed

    def close(self, undelivered: Callable[[list[Result]], None]) -> None:
        """Stop the thread; hand what it claimed and nobody took to ``undelivered``."""
        if self.closed:
            return
        self.closed = True
        self._jobs.put(None)
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            logger.warning("pgqueue: the claim thread did not stop within 10 s")
        left = list(self._results)
        self._results.clear()
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        if left:
            undelivered(left)
