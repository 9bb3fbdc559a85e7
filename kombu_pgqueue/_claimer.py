"""Claims that do not hold up the event loop, for consumers in Celery's event loop.

A claim is a round trip to PostgreSQL. In a prefork worker the main process runs the
event loop: it claims, hands tasks to the pool, reads their results and acks, all in
one thread, and while a claim waits on the network it does none of the rest. Here the
loop's thread sends the claim on a connection of its own and goes on; the connection's
socket is a reader of the loop, and when the answer is complete the loop builds the
payloads and delivers them, so Kombu's and Celery's state is only ever touched there.

This replaced a helper thread that ran each claim and woke the loop through a pipe: on
a prefork -c 2 drain the thread's wakeups and the handing of the GIL back and forth
cost the main process 44-50 us more per task (286-292 against 242), and the pool sat
idle while each claim waited for the GIL (2,442-2,494 against 2,944-2,957 tasks/s,
benchmarks/probes/drain_cpu.py, 2026-11-24).

The claimer knows claims, not consumers: it takes :class:`ClaimRequest` s and hands back
:class:`ClaimResult` s. Nothing claimed is left leased and unseen: a claim in flight
when the claimer closes is awaited, and ``close()`` returns what it brought, for the
consumer to release.

Its session is the consumer's LISTEN session when there is one (issue 43: a worker's
sessions are its LISTEN session and its process's pool, no more): the listener's
statements wait for the claim in flight first (:meth:`Claimer.settle`), and the
listener reads the notifications that the claimer's reads took in
(``_listener.Listener.wait``). Without one (transport option ``listen`` off) the claimer
opens a session of its own.
"""

from __future__ import annotations

import collections
import logging
import select
import time
from typing import Any

import psycopg
from psycopg import pq
from psycopg.adapt import Transformer

from . import _counters, _libpq, _pool
from ._store import Store
from .records import ClaimRequest, ClaimResult

BINARY = _libpq.BINARY

logger = logging.getLogger(__name__)

#: how long close() waits for a claim in flight, to release what it claimed (after
#: that, its leases run out by themselves)
CLOSE_WAIT_SECONDS = 2.0


#: seconds past statement_timeout that settle() waits for a claim's answer
SETTLE_GRACE_SECONDS = 2.0


class Unanswered(psycopg.OperationalError):
    """A claim that did not answer within statement_timeout and a grace: its session,
    which still has it in flight, can take no other statement (a connection error)."""


#: the statements a claimer sends (see Store.claim_request)
CLAIM_STATEMENTS = ("claim", "claim_after", "claim_above")


class Claimer:
    """Claims sent without waiting for them, on a connection of their own.

    The event loop's thread sends the claim and goes on (dispatching tasks, reading
    results, acking); the connection's socket is a reader of the loop, and when the
    answer is complete the loop builds the payloads and delivers them. One claim is in
    flight at a time; others wait in submission order. Parameters go in PostgreSQL's
    text format (the statement gives their types) and rows come back in binary, read
    into the values the pooled path reads (psycopg's loaders, by each column's type), and
    from those into records by :meth:`ClaimResult.from_rows`, as there.
    """

    def __init__(self, store: Store, session: psycopg.Connection | None = None) -> None:
        """Claims on ``session`` (the consumer's LISTEN session, which stays its
        owner's: :meth:`close` leaves it open), or on a session of the claimer's own."""
        self._store = store
        self._owns = session is None
        self._conn = _pool.connect(store.conninfo, store.options) if session is None else session
        # a session of its own through a transaction pooler is any server session: no
        # setting and no prepared statement may stay with it (the LISTEN session is
        # always the server's own)
        direct = session is not None or not _pool.pooled(store.conninfo)
        if direct:
            self._conn.execute(_pool.SESSION_SETTINGS)
        self._pgconn = self._conn.pgconn
        self._fd = self._pgconn.socket
        self._encoding = self._conn.info.encoding
        self._loaders = Transformer(self._conn)
        #: statement name -> parameter keys, of those prepared on this connection
        self._prepared: dict[str, tuple[str, ...]] = {}
        if direct and store.options.prepare_threshold is not None:
            self._prepare(CLAIM_STATEMENTS)
        self._jobs: collections.deque[ClaimRequest] = collections.deque()
        #: the claim in flight
        self._current: ClaimRequest | None = None
        #: the rows of the claim in flight, as they arrived
        self._rows: list[tuple[Any, ...]] = []
        self._error: BaseException | None = None
        self._results: list[ClaimResult] = []
        self.closed = False

    def fileno(self) -> int:
        return self._fd

    @property
    def backend_pid(self) -> int:
        """The server process of the claimer's session."""
        return int(self._pgconn.backend_pid)

    @property
    def prepared(self) -> frozenset[str]:
        """Statements prepared in the claimer's session."""
        return frozenset(self._prepared)

    def submit(self, request: ClaimRequest) -> None:
        """Send the claim now, or after the one in flight; raises if it cannot be sent."""
        self._jobs.append(request)
        if self._current is None:
            self._send_next(raise_errors=True)

    def settle(self) -> None:
        """Wait for the claim in flight and those queued behind it, keeping what they
        bring for :meth:`results`: the session is free for another statement (the
        listener's, on a shared session) when this returns. Claims take milliseconds;
        one that waits longer is cut by the session's lock and statement timeouts, and
        one that outlasts those raises: the session is then of no more use."""
        timeout = self._store.options.statement_timeout
        bound = timeout + SETTLE_GRACE_SECONDS if timeout else None
        while self._current is not None:
            try:
                while not self._collect():
                    if not select.select([self._fd], [], [], bound)[0]:
                        raise Unanswered(
                            f"pgqueue: a claim did not answer within {bound:g} s "
                            "(statement_timeout and a grace): the session is given up"
                        )
                    self._pgconn.consume_input()
                self._finish()
            except Unanswered:
                raise
            except BaseException as exc:  # noqa: BLE001 - reported with the claim
                self._failed(exc)
            self._send_next(raise_errors=False)

    @property
    def answered(self) -> bool:
        """Claims completed and not yet taken by :meth:`results` (see :meth:`settle`)."""
        return bool(self._results)

    def results(self) -> list[ClaimResult]:
        """Every claim that completed (call when the socket is readable).

        Raises the connection's error if it broke while no claim was in flight (the
        server ended the session): otherwise its socket would stay readable and the
        loop would call this again and again.
        """
        if self._current is None:
            self._pgconn.consume_input()  # a notice, or the end of the session
        else:
            try:
                self._pgconn.consume_input()
                if self._collect():
                    self._finish()
            except BaseException as exc:  # noqa: BLE001 - the loop raises it
                self._failed(exc)
            self._send_next(raise_errors=False)
        out, self._results = self._results, []
        return out

    def _failed(self, exc: BaseException) -> None:
        """The claim in flight ends with an error: the connection broke (an error the
        server sent first says why); nothing it did may have been committed."""
        request, error = self._current, self._error or exc
        assert request is not None
        self._current, self._rows, self._error = None, [], None
        self._results.append(ClaimResult(request, [], error=error))

    def _send_next(self, raise_errors: bool) -> None:
        while self._current is None and self._jobs:
            request = self._jobs.popleft()
            try:
                self._send(request.statement, request.params)
            except BaseException as exc:
                if raise_errors:
                    raise
                self._results.append(ClaimResult(request, [], error=exc))
                continue
            self._current = request

    def _send(self, name: str, params: dict[str, Any]) -> None:
        _libpq.send(self._pgconn, self._store, self._prepared, name, params, BINARY)

    def _prepare(self, names: tuple[str, ...]) -> None:
        # here, not at the first claim: preparing waits for the table's lock, and the
        # event loop must not (a claim itself waits in the database, not in the loop)
        self._prepared.update(_libpq.prepare(self._pgconn, self._store, names, self._encoding))

    def _raise(self, name: str, result: pq.abc.PGresult) -> None:
        raise _libpq.result_error(self._store, name, result, self._encoding)

    def _collect(self) -> bool:
        """Take what arrived of the claim in flight; True once it is complete."""
        pgconn = self._pgconn
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                return True
            if result.status == pq.ExecStatus.TUPLES_OK:
                self._loaders.set_pgresult(result, format=BINARY)
                self._rows = self._loaders.load_rows(0, result.ntuples, tuple)
            elif self._error is None:
                try:
                    assert self._current is not None
                    self._raise(self._current.statement, result)
                except BaseException as exc:  # noqa: BLE001 - reported with the claim
                    self._error = exc
        return False

    def _finish(self) -> None:
        request, self._current = self._current, None
        assert request is not None
        rows, self._rows = self._rows, []
        error, self._error = self._error, None
        if error:  # nothing it says was done may have been committed
            self._results.append(ClaimResult(request, [], error=error))
            return
        result = ClaimResult.from_rows(request, rows)
        _counters.claimed(request.queue, result.rows)
        self._results.append(result)

    def close(self) -> list[ClaimResult]:
        """Close the connection; a claim in flight is awaited (CLOSE_WAIT_SECONDS).
        Returns the claims that brought rows the loop did not take, to be released, or
        that moved messages to the dead letters, to be told."""
        if self.closed:
            return []
        self.closed = True
        self._jobs.clear()
        if self._current is not None:
            deadline = time.monotonic() + CLOSE_WAIT_SECONDS
            try:
                while not self._collect():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    select.select([self._fd], [], [], remaining)
                    self._pgconn.consume_input()
                else:
                    self._finish()
            except Exception as exc:  # the database went away: the leases lapse
                logger.debug("pgqueue: claim in flight lost at close: %r", exc)
        left, self._results = self._results, []
        if self._owns:
            try:
                self._conn.close()
            except Exception:  # noqa: S110 - closing a broken connection
                pass
        return [result for result in left if result.rows or result.buried]
