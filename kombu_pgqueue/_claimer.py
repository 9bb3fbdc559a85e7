"""Claims off the event loop's thread, for consumers that run in Celery's event loop.

A claim is a round trip to PostgreSQL. In a prefork worker the main process runs
the event loop: it claims, hands tasks to the pool, reads their results and acks,
all in one thread, and while a claim waits on the network it does none of the rest
(py-spy of a draining prefork worker: about a fifth of that thread's time). Here a
helper thread runs the claim and building of payloads; the event loop learns of the
result through a pipe registered as a reader, and delivers it in its own thread, so
Kombu's and Celery's state is only ever touched there.

Nothing claimed is left leased and unseen: what the loop does not take (the claimer
closed, or a claim that finished after that) goes to ``undelivered``, which releases it.
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

#: how long close() waits for a claim in flight before it leaves the thread to finish
#: (and release what it claimed) by itself
CLOSE_WAIT_SECONDS = 2.0


class Claimer:
    """One helper thread; jobs are (channel, queue, limit)."""

    def __init__(self, undelivered: Callable[[list[Result]], None]) -> None:
        self._undelivered = undelivered
        self._jobs: stdqueue.SimpleQueue[tuple[Any, str, int] | None] = stdqueue.SimpleQueue()
        self._results: collections.deque[Result] = collections.deque()
        self._lock = threading.Lock()
        self.closed = False
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(write_fd, False)
        # the thread owns the write end and closes it when it ends, so it never writes
        # to a descriptor number that was closed and reused meanwhile
        self._thread = threading.Thread(
            target=self._run, args=(write_fd,), name="pgqueue-claimer", daemon=True
        )
        self._thread.start()

    def fileno(self) -> int:
        return self._read_fd

    def submit(self, channel: Any, queue: str, limit: int) -> None:
        self._jobs.put((channel, queue, limit))

    def results(self) -> list[Result]:
        """Every result that arrived; empties the pipe (call when it is readable)."""
        try:
            while os.read(self._read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        with self._lock:
            out = list(self._results)
            self._results.clear()
        return out

    def held(self) -> list[tuple[dict[str, Any], str]]:
        """Payloads claimed but not yet taken by the loop (their leases need renewing)."""
        with self._lock:
            return [(p, q) for _, q, _, payloads, _ in self._results for p in payloads or ()]

    def _run(self, write_fd: int) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                channel, queue, limit = job
                try:
                    result: Result = (channel, queue, limit, channel.fetch(queue, limit), None)
                except BaseException as exc:  # noqa: BLE001 - handed to the event loop's thread
                    result = (channel, queue, limit, None, exc)
                with self._lock:
                    late = self.closed
                    if not late:
                        self._results.append(result)
                if late:
                    self._undelivered([result])
                    continue
                try:
                    os.write(write_fd, b"x")
                except BlockingIOError:
                    pass  # the pipe is full of wakeups already
                except OSError:
                    pass  # the read end is closed: close() takes what is left
        finally:
            os.close(write_fd)

    def close(self) -> None:
        """Stop the thread; what it claimed and nobody took goes to ``undelivered``."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            left = list(self._results)
            self._results.clear()
        self._jobs.put(None)
        try:
            os.close(self._read_fd)
        except OSError:
            pass
        if left:
            self._undelivered(left)
        # a claim in flight finishes on its own and releases what it got
        self._thread.join(timeout=CLOSE_WAIT_SECONDS)
