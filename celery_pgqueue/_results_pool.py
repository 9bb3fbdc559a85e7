"""Celery's result backend on few sessions: the engines of Celery's SQLAlchemy backend
take their connections from one small pool per process, closed when idle.

Celery's database backend makes an engine with a pool of SQLAlchemy's in each forked
pool child (five sessions at most, kept for the child's life) and, in the main process
of a worker or a web process, an engine with no pool at all (a new session for every
result read or written). Behind :func:`celery_pgqueue.configure` both get their
connections from a :class:`psycopg_pool.ConnectionPool` of this process's instead:
as many as are in use at once (a session of Celery's backend may wait for another: a
bound could deadlock it), none kept longer than ``pool_max_idle`` seconds unused (the
transport option, 30), as the broker's own pool (docs/operations.md, "Connections").
SQLAlchemy, given ``creator`` and no pool of its own, "closes" each connection it is
done with, which returns it to this pool (``close_returns``). ``configure()`` again
(another database: a test's) replaces the process's pool, and closes the last one.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

#: what SQLAlchemy's psycopg dialect adds to each connection it is given (a notice
#: handler), taken off again as the connection comes back: a pooled connection is
#: given to SQLAlchemy many times
_SQLALCHEMY_MODULE = "sqlalchemy."


def _reset(conn: psycopg.Connection) -> None:
    """A connection back from SQLAlchemy: as the pool made it, with no handler of
    SQLAlchemy's left on it."""
    for handler in list(conn._notice_handlers):  # noqa: SLF001 - psycopg has no public list
        if getattr(handler, "__module__", "").startswith(_SQLALCHEMY_MODULE):
            conn.remove_notice_handler(handler)


class ResultSessions:
    """SQLAlchemy's ``creator`` for Celery's result backend: a connection from this
    process's results pool (one per process, made at first use; a forked child makes
    its own)."""

    def __init__(self, conninfo: str, *, max_size: int, max_idle: float, timeout: float) -> None:
        self.conninfo = conninfo
        self.max_size = max_size
        self.max_idle = max_idle
        self.timeout = timeout
        self._lock = threading.Lock()
        self._pool: ConnectionPool | None = None
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"<celery_pgqueue ResultSessions max_size={self.max_size} max_idle={self.max_idle}>"

    @property
    def pool(self) -> ConnectionPool:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                # a parent's pool is not the child's to use, nor to close
                self._pool = ConnectionPool(
                    self.conninfo,
                    min_size=0,
                    max_size=self.max_size,
                    max_idle=self.max_idle,
                    timeout=self.timeout,
                    close_returns=True,
                    reset=_reset,
                    # nothing prepared on the server: the results' statements are few
                    # a task, and a transaction pooler (PgBouncer before 1.21) would
                    # hand one client's prepared statement to another
                    kwargs={"prepare_threshold": None},
                    open=True,
                    name=f"pgqueue-results-{os.getpid()}",
                )
                self._pid = os.getpid()
            return self._pool

    def __call__(self) -> Any:
        return self.pool.getconn()

    def close(self) -> None:
        """Close this process's pool (in the background: closing waits for sessions
        that are in use)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            threading.Thread(target=pool.close, kwargs={"timeout": 5}, daemon=True).start()


#: the most sessions a process's results pool opens at once: none is kept idle, so this
#: bounds only what is in use at once (Celery's own engine without a pool had no bound)
RESULTS_MAX_SESSIONS = 64

#: engine options that choose SQLAlchemy's pool, or size one: an app that sets any keeps
#: its own (Celery's defaults, pool_pre_ping and pool_recycle, go with any pool)
_OWN_POOL = frozenset(
    {"creator", "poolclass", "pool", "pool_size", "max_overflow", "pool_timeout", "pool_use_lifo"}
)


def engine_options(
    conninfo: str, found: dict[str, Any] | None, transport_options: dict[str, Any]
) -> dict[str, Any]:
    """Celery's ``database_engine_options`` for the results of ``conninfo``: the app's
    own (``found``) with connections from a :class:`ResultSessions`, unless the app
    chose or sized a pool of its own (:data:`_OWN_POOL`)."""
    options = dict(found or {})
    ours = options.get("creator")
    if isinstance(ours, ResultSessions):
        # configure() again (a test's own schema, another database): this process's
        # results pool follows it, and the last one's sessions are closed
        if ours.conninfo == conninfo:
            return options
        ours.close()
        del options["creator"]
        options.pop("poolclass", None)
    if _OWN_POOL.intersection(options):
        return options
    from sqlalchemy.pool import NullPool

    options["creator"] = ResultSessions(
        conninfo,
        # as many as are in use at once: Celery's backend may open a session while it
        # holds another (a chord's part), and a bound below that would wait for ever
        max_size=RESULTS_MAX_SESSIONS,
        max_idle=float(transport_options.get("pool_max_idle") or 30.0),
        timeout=float(transport_options.get("pool_timeout") or 30.0),
    )
    options["poolclass"] = NullPool
    return options
