"""Kombu consumer processes for the relay tests (``test_relay``): each consumes queues of
its own through the host's relay, in ``drain_events`` as a Celery worker's main process
consumes, and reports on a multiprocessing queue when it is ready, what it gets, and an
error that ended it. Forked from a server process that imported Kombu once, so that
hundreds start in seconds."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as stdqueue
import time
from collections.abc import Callable, Iterable
from typing import Any

#: seconds each drain_events waits (the loop goes on after a timeout)
DRAIN_SECONDS = 5.0


def consume(url: str, options: dict[str, Any], index: int, queues: list[str], reports: Any) -> None:
    from kombu import Connection, Queue

    import kombu_pgqueue  # noqa: F401 - registers the pgqueue:// transport

    try:
        with Connection(url, transport_options=options) as conn:

            def got(body: Any, message: Any) -> None:
                message.ack()
                reports.put(("got", index, message.delivery_info["routing_key"], body))

            with conn.Consumer([Queue(q) for q in queues], callbacks=[got]):
                reports.put(("ready", index, os.getpid()))
                while True:
                    try:
                        conn.drain_events(timeout=DRAIN_SECONDS)
                    except TimeoutError:
                        pass
    except BaseException as exc:
        reports.put(("error", index, repr(exc)))
        raise


class Fleet:
    """Consumer processes by index, and what they reported."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url = url
        self.options = options
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["kombu", "kombu_pgqueue", "relay_consumers"])
        self.reports = self.ctx.Queue()
        self.procs: dict[int, Any] = {}
        self.pids: dict[int, int] = {}
        self.got: dict[int, list[tuple[str, Any]]] = {}
        self.errors: list[tuple[int, str]] = []

    def start(self, indexes: Iterable[int], queues: Callable[[int], list[str]]) -> None:
        """Start a consumer for each of ``indexes`` and wait until they are all ready."""
        started = []
        for index in indexes:
            proc = self.ctx.Process(
                target=consume,
                args=(self.url, self.options, index, queues(index), self.reports),
                daemon=True,
            )
            proc.start()
            self.procs[index] = proc
            self.got[index] = []
            started.append(index)
        self.until(lambda: all(i in self.pids for i in started), 120, "consumers ready")

    def until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        """Take reports until ``done()`` (or fail after ``timeout`` seconds, or when a
        consumer reports an error)."""
        deadline = time.monotonic() + timeout
        while not done():
            assert not self.errors, f"a consumer failed: {self.errors}"
            left = deadline - time.monotonic()
            assert left > 0, f"waited {timeout}s for {what}"
            try:
                report = self.reports.get(timeout=left)
            except stdqueue.Empty:
                continue
            kind, index, *rest = report
            if kind == "ready":
                self.pids[index] = rest[0]
            elif kind == "got":
                self.got[index].append((rest[0], rest[1]))
            else:
                self.errors.append((index, rest[0]))
        assert not self.errors, f"a consumer failed: {self.errors}"

    def kill(self, index: int) -> None:
        proc = self.procs.pop(index)
        proc.kill()
        proc.join(10)
        self.pids.pop(index, None)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()
        for proc in self.procs.values():
            proc.join(10)
        self.procs.clear()
