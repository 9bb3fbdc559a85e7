"""Where an atomic consumer's work is done: what an atomic task's ``self.db`` is.

Each source (a :class:`kombu_pgqueue.atomic.TransactionSource`) opens one transaction
per attempt: on a psycopg connection of the worker's (:class:`Psycopg`), a SQLAlchemy
``Session`` or ``Connection`` (:class:`SQLAlchemy`), or Django's connection
(:class:`Django`). :class:`kombu_pgqueue.atomic.Fence` acks a delivery inside it.
Exported by :mod:`kombu_pgqueue.atomic`.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Protocol

import psycopg
from psycopg import generators

logger = logging.getLogger(__name__)


class Broker(Protocol):
    """What a source needs of the broker (a :class:`~kombu_pgqueue.atomic.Fence`)."""

    #: the broker's libpq connection string
    conninfo: str


# -- psycopg ---------------------------------------------------------------------------------


class Psycopg:
    """``self.db`` is a psycopg 3 connection of the worker's, one per thread and process,
    opened from the broker's connection string (or ``conninfo``), kept between tasks."""

    def __init__(self, conninfo: str | None = None, **connect_kwargs: Any) -> None:
        self.conninfo = conninfo
        self.connect_kwargs = connect_kwargs
        self.checks = conninfo is not None
        self._local = threading.local()

    def begin(self, fence: Broker) -> PsycopgTransaction:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken or self._local.pid != os.getpid():
            # a pool child never touches its parent's connection (after fork): a new one
            conn = psycopg.connect(self.conninfo or fence.conninfo, **self.connect_kwargs)
            self._local.conn, self._local.pid = conn, os.getpid()
        return PsycopgTransaction(conn)


class PsycopgTransaction:
    """A transaction of :class:`Psycopg`: its connection, kept by the thread."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.handle = conn

    def commit(self) -> None:
        self.handle.commit()

    def rollback(self) -> None:
        if not self.handle.closed:
            self.handle.rollback()

    def close(self) -> None:
        conn = self.handle
        if conn.broken:
            conn.close()  # the next transaction connects afresh
        elif conn.pgconn.transaction_status == _ACTIVE:
            # a statement interrupted on the client (a signal: a soft time limit) still
            # runs on the server: stop it there if it can be stopped, and connect afresh
            try:
                conn.cancel_safe(timeout=2.0)
            except Exception as exc:  # the statement ends (or not) with the connection
                logger.debug("pgqueue: could not cancel an interrupted statement: %r", exc)
            conn.close()
        elif not conn.closed and conn.pgconn.transaction_status != _IDLE:
            conn.rollback()

    def run_and_commit(self, statement: bytes, refused: str) -> bool:
        """Run ``statement`` (no parameters) and COMMIT as one simple query, in the
        transaction (opened first if the work ran no statement); False, rolled back,
        when ``statement`` failed with SQLSTATE ``refused``; any other failure, or a
        transaction that did not commit, raises psycopg's error.

        Sent with libpq's own call and waited for as psycopg waits (so a signal, Ctrl-C
        or a soft time limit, still interrupts it, and a gevent worker's other greenlets
        run meanwhile), without a cursor: a cursor's machinery would cost an atomic
        task's ack more client CPU than its round trip. The transaction's state is
        libpq's, which the connection reads: it sees the commit, or the aborted
        transaction.
        """
        conn = self.handle
        opened = conn.pgconn.transaction_status == _IDLE
        query = b"%s%s; COMMIT" % (b"BEGIN; " if opened else b"", statement)
        with conn.lock:
            conn.pgconn.send_query(query)
            results = conn.wait(generators.execute(conn.pgconn))
        # a failed statement ends the query: its failure is the last result
        last = results[-1] if results else None
        if last is not None and last.status == _FATAL_ERROR:
            error = psycopg.errors.error_from_result(last, encoding=conn.info.encoding)
            if conn.broken:
                raise psycopg.OperationalError(str(error) or "connection lost") from error
            statement_failed = len(results) == (2 if opened else 1)  # not the COMMIT
            if statement_failed and error.sqlstate == refused:
                conn.rollback()
                return False
            raise error
        if last is None or last.command_status != b"COMMIT":
            ended = last.command_status if last is not None else None
            raise psycopg.errors.TransactionRollback(
                f"the transaction ended with {ended!r}, not COMMIT: nothing was committed"
            )
        return True


_IDLE = psycopg.pq.TransactionStatus.IDLE
_ACTIVE = psycopg.pq.TransactionStatus.ACTIVE
_FATAL_ERROR = psycopg.pq.ExecStatus.FATAL_ERROR


# -- SQLAlchemy -----------------------------------------------------------------------------


class SQLAlchemy:
    """``self.db`` is a ``Session`` of ``bind`` (a ``sessionmaker``, or any callable that
    returns a ``Session``) or a ``Connection`` of ``bind`` (an ``Engine``), in a
    transaction; closed after the attempt. Any PostgreSQL driver with ``%(name)s``
    parameters (psycopg 3, psycopg2)."""

    checks = True

    def __init__(self, bind: Any) -> None:
        self.bind = bind

    def begin(self, fence: Broker) -> _SQLAlchemyTransaction:
        is_engine = hasattr(self.bind, "dialect") and hasattr(self.bind, "connect")
        handle = self.bind.connect() if is_engine else self.bind()
        handle.begin()
        return _SQLAlchemyTransaction(handle)


class _SQLAlchemyTransaction:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def commit(self) -> None:
        self.handle.commit()

    def rollback(self) -> None:
        self.handle.rollback()

    def close(self) -> None:
        self.handle.close()  # rolls back what is still open


# -- Django --------------------------------------------------------------------------------


class Django:
    """``self.db`` is Django's connection ``using``, inside ``transaction.atomic(using)``:
    the ORM's writes are the transaction's, ``atomic()`` blocks in the body are savepoints
    and ``transaction.on_commit()`` callbacks run after the commit."""

    checks = True

    def __init__(self, using: str = "default") -> None:
        self.using = using

    def begin(self, fence: Broker) -> _DjangoTransaction:
        from django.db import connections, transaction

        block = transaction.atomic(using=self.using)
        block.__enter__()
        return _DjangoTransaction(connections[self.using], block, self.using)


class _DjangoTransaction:
    def __init__(self, handle: Any, block: Any, using: str) -> None:
        self.handle, self._block, self._using = handle, block, using
        self._open = True

    def commit(self) -> None:
        self._open = False
        self._block.__exit__(None, None, None)  # commits, or rolls back and raises

    def rollback(self) -> None:
        if self._open:
            from django.db import transaction

            self._open = False
            transaction.set_rollback(True, using=self._using)
            self._block.__exit__(None, None, None)

    def close(self) -> None:
        self.rollback()
