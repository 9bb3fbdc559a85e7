"""A client-side deadline for the broker's statements: a server that does not answer.

PostgreSQL's ``statement_timeout`` ends a slow statement, but only a server that runs
can enforce it: a hung server (its processes stopped), a host that went away without
closing the socket, or a commit waiting for a synchronous standby that is gone (the
server does not time that wait out) leaves the client blocked in a read for good.
TCP keepalives do not help against a stopped process, whose kernel still answers.

So each pooled statement is armed with a deadline, and one thread per process shuts
down the socket of a statement that outlives it. The blocked read then fails at once
("server closed the connection"), the pool drops that connection, and the caller
raises a connection error, which Kombu retries by its policy. A statement that did
commit before the server stopped answering may be retried: publishes carry their
dedup key (see ``dedup_task_ids``), and nothing acknowledged to a caller is lost.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg


class _Watch:
    __slots__ = ("conn", "deadline", "fired")

    def __init__(self, conn: psycopg.Connection, deadline: float) -> None:
        self.conn = conn
        self.deadline = deadline
        self.fired = False


class Watchdog:
    """Cuts the connection of a statement that outlives its deadline (one per process)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: set[_Watch] = set()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        #: when the thread looks next (inf: only when woken)
        self._wakes_at = math.inf

    @contextmanager
    def armed(self, conn: psycopg.Connection, seconds: float) -> Iterator[_Watch]:
        """Run the block with ``conn`` cut after ``seconds``; ``.fired`` says if it was."""
        watch = _Watch(conn, time.monotonic() + seconds)
        with self._cond:
            self._ensure_thread()
            self._armed.add(watch)
            # deadlines come in order (one timeout, later calls): the thread, which looks
            # at the soonest one it knew, is woken only when it knew none (once per
            # timeout's length), not on every statement
            if watch.deadline < self._wakes_at:
                self._wakes_at = watch.deadline
                self._cond.notify()
        try:
            yield watch
        finally:
            with self._cond:
                self._armed.discard(watch)

    def _ensure_thread(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's thread is not here
            self._pid, self._thread, self._armed = os.getpid(), None, set()
            self._wakes_at = math.inf
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pgqueue-deadline", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [w for w in self._armed if w.deadline <= now]
                for watch in due:
                    self._armed.discard(watch)
                    watch.fired = True
                if not due:
                    soonest = min((w.deadline for w in self._armed), default=math.inf)
                    self._wakes_at = soonest
                    self._cond.wait(None if soonest == math.inf else soonest - now)
                    continue
            for watch in due:
                _cut(watch.conn)


def _cut(conn: psycopg.Connection) -> None:
    """Shut the socket down under the thread blocked on it (it sees end-of-file)."""
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:  # closed meanwhile: nothing blocks on it
        return
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


#: the process's watchdog
WATCHDOG = Watchdog()
