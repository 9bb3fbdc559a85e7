"""The LISTEN connection: one dedicated autocommit session per consuming transport.

Publishers send ``pg_notify(<schema>.notify, payload)`` in the statement that makes
rows visible. Payloads are ``r:<token>`` (messages are ready in the queue of that
token, see :func:`queue_token`) or ``d:<epoch>`` (a delayed message falls due then).
Any role that may connect can LISTEN on the channel, or NOTIFY on it: payloads name no
queue, and a wakeup that was not a publisher's only costs a claim that finds nothing.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import psycopg

from . import _pool
from ._options import Options


def queue_token(queue: str) -> str:
    """The opaque id of ``queue`` in notifications: as the statements compute it,
    ``left(md5(convert_to(queue, 'UTF8')), 16)``."""
    return hashlib.md5(queue.encode("utf-8"), usedforsecurity=False).hexdigest()[:16]


@dataclass(slots=True)
class Wakeups:
    """What a batch of notifications said: tokens of queues with news, a due time."""

    queues: set[str] = field(default_factory=set)
    due: float | None = None

    def add(self, payload: str) -> None:
        kind, _, rest = payload.partition(":")
        if kind == "r":
            self.queues.add(rest)
        elif kind == "d":
            try:
                when = float(rest)
            except ValueError:
                return
            self.due = when if self.due is None else min(self.due, when)

    def __bool__(self) -> bool:
        return bool(self.queues) or self.due is not None


class Listener:
    def __init__(self, conninfo: str, options: Options) -> None:
        self.conninfo = conninfo
        self.options = options
        self.conn: psycopg.Connection | None = None
        self._pid = os.getpid()

    def open(self) -> None:
        if self.conn is not None and not self.conn.closed and self._pid == os.getpid():
            return
        self.conn = _pool.listening(self.conninfo, self.options)
        self._pid = os.getpid()

    def fileno(self) -> int:
        assert self.conn is not None
        return self.conn.fileno()

    def wait(self, timeout: float | None) -> Wakeups:
        """Block up to ``timeout`` seconds for notifications; return all that came."""
        assert self.conn is not None
        found = Wakeups()
        for notify in self.conn.notifies(timeout=timeout, stop_after=1):
            found.add(notify.payload)
        if found:
            for notify in self.conn.notifies(timeout=0):
                found.add(notify.payload)
        return found

    def drain(self) -> Wakeups:
        """Read what has arrived without blocking."""
        return self.wait(0)

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None and not conn.closed:
            try:
                conn.close()
            except psycopg.Error:
                pass
