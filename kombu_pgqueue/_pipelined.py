"""Publishes that do not wait for their statement: transport option ``confirm_publish=False``.

A publish that waits for its commit spends most of its time waiting: with
``synchronous_commit: "off"`` an ``apply_async`` cost 380-440 us of waiting for the
server on top of ~260 us of Celery, Kombu and pgqueue, where RabbitMQ without
confirms writes a frame to its socket (92 us) and returns (benchmarks/HISTORY.md).
Here a publish outside an application's transaction is sent on a connection of the
process's own in libpq's pipeline mode, each statement followed by a sync (so each is
its own autocommit transaction, as on the pool), and the call returns once the
statement is on its way. What the server answers is read later, without waiting: at
the next publish, at a channel's close, and by :meth:`Pipeline.flush`, which waits for
every answer (at most ``statement_timeout`` plus 2 s).

An answer that is an error (the message was not stored) is logged with the queue or
exchange and the number of messages, and counted (``publish_failed``); a connection
that broke is raised by the next publish or flush (a connection error: Kombu's retry
policy and Celery's reconnects see it), the publishes it had in flight logged and
counted (``publish_lost``: they may or may not be stored), and the next publish opens
a new one. Unroutable publishes and skipped duplicates are reported when their answer
is read (``unroutable="raise"`` cannot be: that combination is refused).

One connection per process and database schema: a forked child (Celery's prefork
pool) forgets its parent's without touching it and opens its own.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import threading
import time
from collections import Counter, deque
from typing import Any, NamedTuple

import psycopg
from psycopg import pq

from . import _counters, _errors, _libpq, _pool, transactions
from ._connected import DEADLINE_GRACE
from ._store import Store, publish_statement
from ._unroutable import Unroutable
from .exceptions import ServerUnavailable
from .records import Outgoing

logger = logging.getLogger(__name__)

#: statements sent and not yet answered, at most: a publisher that outruns the server
#: waits for the oldest answers (as RabbitMQ's flow control holds a fast publisher)
MAX_IN_FLIGHT = 1000

#: how long a closing channel waits for answers when statement_timeout is 0 (no limit)
CLOSE_WAIT_SECONDS = 30.0

#: the statements sent here
STATEMENTS = ("publish", "publish_replacing", "publish_routed")

_OK = pq.ExecStatus.TUPLES_OK
_SYNC = pq.ExecStatus.PIPELINE_SYNC
_BAD = pq.ConnStatus.BAD


def _connection_error(result: pq.abc.PGresult) -> bool:
    if result.status != pq.ExecStatus.FATAL_ERROR:
        return False
    sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE) or b""
    return sqlstate.startswith((b"08", b"57P"))


class Sent(NamedTuple):
    """A publish in flight: what to report when its answer comes."""

    statement: str
    queue: str  # "" when routed through an exchange
    exchange: str
    routing_key: str
    dedup_key: str | None
    message: dict[str, Any] | None = None  # routed: for the unroutable report
    unroutable: Unroutable | None = None

    @property
    def target(self) -> str:
        if self.statement == "publish_routed":
            return f"exchange {self.exchange!r} (routing key {self.routing_key!r})"
        return f"queue {self.queue!r}"


def _summary(sent: list[Sent]) -> str:
    counts = Counter(s.target for s in sent)
    return ", ".join(f"{n} to {target}" for target, n in counts.most_common())


class Pipeline:
    """The process's unconfirmed publishes to one schema: one connection in pipeline
    mode, the statements in flight, their answers read without waiting. Thread-safe."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        self._pgconn: pq.abc.PGconn | None = None
        self._encoding = "utf-8"
        self._prepared: dict[str, tuple[str, ...]] = {}
        self._sent: deque[Sent] = deque()
        #: the oldest statement's answer arrived (its sync comes next), and its error
        self._answered = False
        self._result: pq.abc.PGresult | None = None
        #: the server said it ends the session while no statement was in flight
        self._ended: str | None = None

    @property
    def backend_pid(self) -> int | None:
        """The server process of the pipelined session (None: not connected)."""
        return None if self._pgconn is None else int(self._pgconn.backend_pid)

    @property
    def in_flight(self) -> int:
        return len(self._sent)

    def publish(self, message: Outgoing, *, replace: bool = False) -> None:
        """Send what :meth:`Store.publish` runs, without waiting for it."""
        sent = Sent(publish_statement(replace), message.queue, "", "", message.dedup_key)
        self._store.read_floor()
        self._publish(sent, self._store.publish_params(message))

    def publish_routed(
        self,
        exchange: str,
        routing_key: str,
        message: Outgoing,
        original: dict[str, Any],
        unroutable: Unroutable,
    ) -> None:
        """Send what :meth:`Store.publish_routed` runs; ``unroutable`` reports
        ``original`` if no binding matched."""
        sent = Sent(
            "publish_routed", "", exchange, routing_key, message.dedup_key, original, unroutable
        )
        self._publish(sent, self._store.routed_params(exchange, routing_key, message))

    def _publish(self, sent: Sent, params: dict[str, Any]) -> None:
        self._store.fill(sent.statement, params)
        with self._lock:
            pgconn = self._pgconn or self._open()
            try:
                self._read()
                if len(self._sent) >= MAX_IN_FLIGHT:
                    self._wait(lambda: len(self._sent) < MAX_IN_FLIGHT, self._deadline())
                _libpq.send(pgconn, self._store, self._prepared, sent.statement, params)
                pgconn.pipeline_sync()
                self._sent.append(sent)
                if pgconn.flush():  # the socket's buffer is full: the server is behind
                    self._wait(lambda: not pgconn.flush(), self._deadline())
            except psycopg.OperationalError as exc:
                raise self._broke(exc) from exc

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the server answered every publish sent so far, reporting each.

        ``timeout`` defaults to ``statement_timeout`` plus 2 s (none if that is 0); a
        server that does not answer by then raises :class:`ServerUnavailable`, one
        whose connection broke raises psycopg's ``OperationalError``, with what was in
        flight logged as lost.
        """
        with self._lock:
            if not self._sent or self._pgconn is None:
                return
            deadline = self._deadline() if timeout is None else time.monotonic() + timeout
            try:
                self._wait(lambda: not self._sent, deadline)
            except psycopg.OperationalError as exc:
                raise self._broke(exc) from exc

    def settle(self) -> None:
        """Flush, logging an error instead of raising it (a channel closes, the process
        exits); without ``statement_timeout``, waits at most CLOSE_WAIT_SECONDS."""
        timeout = None if self._store.options.statement_timeout else CLOSE_WAIT_SECONDS
        try:
            self.flush(timeout)
        except psycopg.OperationalError as exc:
            logger.warning("pgqueue: unconfirmed publishes unanswered at close: %s", exc)

    def close(self) -> None:
        """Settle, and close the connection."""
        self.settle()
        with self._lock:
            self._drop()

    # -- the connection -------------------------------------------------------------

    def _open(self) -> pq.abc.PGconn:
        store = self._store
        store.pool  # noqa: B018 - the schema is installed or checked first, as for the pool
        conn = _pool.connect(store.conninfo, store.options)
        try:
            direct = not _pool.pooled(store.conninfo)  # see _pool: a pooler's session
            if direct:
                conn.execute(_pool.SESSION_SETTINGS)
                conn.execute(_pool.statement_timeout(store.options))
            pgconn = conn.pgconn
            self._encoding = conn.info.encoding
            self._prepared = {}
            if direct and store.options.prepare_threshold is not None:
                self._prepared = _libpq.prepare(pgconn, store, STATEMENTS, self._encoding)
            # libpq takes an error that comes when nothing is in flight (the session
            # terminated while idle) for a notice: without this, the next publish would
            # be sent on a socket the server has closed, and be lost
            conn.add_notice_handler(self._notice)
            pgconn.enter_pipeline_mode()
            # a blocking write could wait on a server that waits for us to read
            pgconn.nonblocking = 1
        except BaseException:
            conn.close()
            raise
        self._conn, self._pgconn = conn, pgconn
        self._answered, self._result, self._ended = False, None, None
        return pgconn

    def _notice(self, diag: psycopg.errors.Diagnostic) -> None:
        if diag.severity_nonlocalized in ("FATAL", "PANIC"):
            self._ended = diag.message_primary or "the server ended the session"

    def _drop(self) -> None:
        conn, self._conn, self._pgconn = self._conn, None, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: S110 - closing a broken connection
                pass

    def _deadline(self) -> float | None:
        timeout = self._store.options.statement_timeout
        return time.monotonic() + timeout + DEADLINE_GRACE if timeout else None

    def _broke(self, exc: BaseException) -> BaseException:
        """The connection broke (or hangs): what was in flight is lost; the next
        publish connects again. Returns the error to raise."""
        lost, where = list(self._sent), _errors.where(self._pgconn)
        self._sent.clear()
        self._drop()
        for s in lost:
            _counters.add("publish_lost", s.queue)
        if lost:
            logger.error(
                "pgqueue: the connection of unconfirmed publishes (confirm_publish=False) to "
                "%s broke (%s) with %d of them unanswered: %s; each may or may not be "
                "stored (counted as 'publish_lost')",
                where,
                exc,
                len(lost),
                _summary(lost),
            )
        return exc

    # -- the answers ----------------------------------------------------------------

    def _wait(self, done: Any, deadline: float | None) -> None:
        """Read answers (and write what is buffered) until ``done()``; raises
        ServerUnavailable at ``deadline``."""
        pgconn = self._pgconn
        assert pgconn is not None
        fd = pgconn.socket
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                timeout = self._store.options.statement_timeout
                raise ServerUnavailable(
                    f"the database at {_errors.where(pgconn)} did not answer unconfirmed "
                    f"publishes within {timeout:g} s (transport option statement_timeout)"
                )
            select.select([fd], [fd] if pgconn.flush() else [], [], left)
            self._read()

    def _read(self) -> None:
        """Take every answer that arrived, without waiting."""
        pgconn = self._pgconn
        assert pgconn is not None
        pgconn.consume_input()
        pgconn.is_busy()  # parses what arrived (consume_input only reads it)
        if self._ended is not None:
            raise psycopg.OperationalError(self._ended)
        while self._sent and not pgconn.is_busy():
            result = pgconn.get_result()
            if pgconn.status == _BAD:
                raise psycopg.OperationalError(
                    (result.error_message if result else pgconn.error_message).decode(
                        self._encoding, "replace"
                    )
                    or "the server closed the connection"
                )
            if result is not None and _connection_error(result):
                # the server ends the session (terminated, shutting down): it says so
                # before it closes the socket
                raise psycopg.OperationalError(
                    result.error_message.decode(self._encoding, "replace")
                )
            if not self._answered:
                if result is None:  # the end of the oldest statement's answer
                    self._answered = True
                elif self._result is None or self._result.status == _OK:
                    self._result = result
            elif result is not None and result.status == _SYNC:
                self._answered = False
                result, self._result = self._result, None
                self._report(self._sent.popleft(), result)
            else:
                break  # nothing more until the sync arrives
        if pgconn.status == _BAD:
            raise psycopg.OperationalError(pgconn.error_message.decode(self._encoding, "replace"))

    def _report(self, sent: Sent, result: pq.abc.PGresult | None) -> None:
        if result is None or result.status != _OK:
            error = (
                _libpq.result_error(self._store, sent.statement, result, self._encoding)
                if result is not None
                else RuntimeError("no answer")
            )
            _counters.add("publish_failed", sent.queue)
            logger.error(
                "pgqueue: an unconfirmed publish (confirm_publish=False) to %s was not "
                "stored: %s (counted as 'publish_failed')",
                sent.target,
                error,
            )
            if isinstance(error, psycopg.OperationalError):
                raise error  # a read-only server: reconnect, as the store's path would
        elif sent.statement == "publish_routed":
            if result.ntuples == 1 and result.get_value(0, 0) is None:
                assert sent.unroutable is not None and sent.message is not None
                sent.unroutable.report(sent.exchange, sent.routing_key, sent.message)
        elif not result.ntuples:
            logger.info(
                "pgqueue: skipped a message for queue %r: dedup key %r is waiting or running",
                sent.queue,
                sent.dedup_key,
            )


_lock = threading.Lock()
_pipelines: dict[tuple[str, str, int | None, float], Pipeline] = {}


def _key(store: Store) -> tuple[str, str, int | None, float]:
    options = store.options
    return (store.conninfo, store.schema, options.prepare_threshold, options.statement_timeout)


def pipeline(store: Store) -> Pipeline:
    """This process's pipeline to ``store``'s database and schema (made on first use)."""
    key = _key(store)
    found = _pipelines.get(key)
    if found is None:
        with _lock:
            found = _pipelines.setdefault(key, Pipeline(store))
    return found


def unconfirmed(store: Store) -> Pipeline | None:
    """Where a publish to ``store`` goes without waiting; None in an enlisted
    application transaction (the message must commit with it)."""
    return None if transactions.current() is not None else pipeline(store)


def flush(store: Store, timeout: float | None = None) -> None:
    """:meth:`Pipeline.flush` of this process's pipeline to ``store``'s schema, if any."""
    found = _pipelines.get(_key(store))
    if found is not None:
        found.flush(timeout)


def settle(store: Store) -> None:
    """:meth:`Pipeline.settle` of this process's pipeline to ``store``'s schema, if any."""
    found = _pipelines.get(_key(store))
    if found is not None:
        found.settle()


def _forget_after_fork() -> None:
    # the child never touches the parent's sessions (closing one would end it for the
    # parent too: the socket is shared); psycopg's pid check keeps their finalizers off
    global _lock
    _lock = threading.Lock()
    _pipelines.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


@atexit.register
def _close_all() -> None:
    for found in list(_pipelines.values()):
        found.close()
    _pipelines.clear()
