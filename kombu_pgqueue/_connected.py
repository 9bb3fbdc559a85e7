"""How one of the broker's statements reaches the database: the shared pool, the
statement deadline, errors translated, a pool whose server went away discarded, and
publishes routed through an enlisted application transaction, each statement as its
traits say (:class:`~._sql.Traits`). :class:`~._store.Store` adds one typed method per
statement.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg
from psycopg import errors, pq
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from . import _errors, _pool, _sql, transactions
from ._options import Options
from ._rotation import Generations
from .exceptions import ServerUnavailable

#: errors that mean the connection, not the statement, failed: Kombu reconnects
CONNECTION_ERRORS: tuple[type[Exception], ...] = (psycopg.OperationalError, psycopg.InterfaceError)

#: seconds past statement_timeout before the client gives up on the server
DEADLINE_GRACE = 2.0

#: a statement that returned rows (SELECT, or RETURNING)
TUPLES_OK = pq.ExecStatus.TUPLES_OK

#: a publish attempt's deadline (_sql.Traits.attempt) grows by a second for every this
#: many bytes of its message, so that a large message is not cut off while it is sent
#: and stored (511 MiB took 40 s on CI's embedded PostgreSQL)
PUBLISH_BYTES_PER_SECOND = 4 << 20


def _lost(error: Exception) -> bool:
    """Whether ``error`` means the server went away or takes no writes (its pool is of
    no more use), rather than that one statement failed (a timeout, a lock)."""
    if isinstance(error, (ServerUnavailable, PoolTimeout)):
        return True
    sqlstate = getattr(error, "sqlstate", None)
    return sqlstate is None or sqlstate.startswith(("08", "57P"))


class Connected:
    """One pgqueue schema in one database, through this process's shared pool."""

    def __init__(self, conninfo: str, options: Options) -> None:
        self.conninfo = conninfo
        self.options = options
        self.schema = options.schema
        self._q = _sql.queries(options.schema)
        self._traits = _sql.traits()
        user = conninfo_to_dict(conninfo).get("user")  # who is refused, in errors
        self._role = f"role {str(user)!r}" if user else "the database role"
        self._pool: ConnectionPool | None = None
        self._pid = os.getpid()
        self._database: transactions.Database | None = None
        #: the floor and the current generation as this process last read them
        self.generations = Generations(options.generation_dead_rows)

    # -- lifecycle -------------------------------------------------------------

    def open(self, *, probe: bool = False) -> None:
        """Connect (raising psycopg's errors as they are) and check the schema.

        ``probe``, as a reconnect must: connect afresh and check that the server takes
        writes. A pooled connection could be stale (its server gone) and a new one could
        wait out the pool timeout; a plain connection fails at once, naming the host, so
        Kombu moves on to the next URL of a failover list, and a standby or read-only
        server raises :class:`ServerUnavailable` (a connection error: wait, retry).
        """
        self._pool = None
        self._pool = _pool.get_pool(self.conninfo, self.options, probe=probe)
        self._pid = os.getpid()

    def check_pool(self) -> None:
        """Drop pooled connections that died (after a database restart)."""
        if self._pool is not None:
            self._pool.check()

    @property
    def pool(self) -> ConnectionPool:
        # a forked child (Celery prefork) must never use the parent's connections; a
        # pool discarded after its server went away is replaced by a new one
        if self._pool is None or self._pid != os.getpid() or self._pool.closed:
            self.open()
        assert self._pool is not None
        return self._pool

    @contextmanager
    def _connection(self, name: str, size: int = 0) -> Iterator[psycopg.Connection]:
        """A pooled connection for statement ``name`` (that sends ``size`` bytes of
        message), its errors translated, under the statement deadline; a pool whose
        server went away is discarded."""
        pool = self.pool
        try:
            with (
                self.translated(name),
                pool.connection() as conn,
                self._deadline(conn, name, size),
            ):
                yield conn
        except CONNECTION_ERRORS as exc:
            if _lost(exc):
                _pool.discard(pool)
            raise

    @contextmanager
    def _deadline(self, conn: psycopg.Connection, name: str, size: int = 0) -> Iterator[None]:
        """Statement ``name`` on ``conn``, cut off (its connection closed) when the
        server does not answer: after statement_timeout plus DEADLINE_GRACE, or, for a
        publish attempt's statements (:attr:`_sql.Traits.attempt`), publish_timeout (plus
        a second for every PUBLISH_BYTES_PER_SECOND of its ``size``) if that is sooner."""
        timeout = self.options.statement_timeout
        seconds, option = (timeout + DEADLINE_GRACE, "statement_timeout") if timeout else (0, "")
        bound = self.options.publish_timeout if self._traits[name].attempt else 0
        if bound:
            bound += size / PUBLISH_BYTES_PER_SECOND
        if bound and (not seconds or bound < seconds):
            seconds, option, timeout = bound, "publish_timeout", bound
        if not seconds:
            yield
            return
        with _errors.answering(conn, seconds, option, said=timeout):
            yield

    def translated(self, name: str) -> AbstractContextManager[None]:
        """Statement ``name``'s errors as pgqueue's (see :mod:`._errors`)."""
        return _errors.translated(
            name,
            self.schema,
            lambda: _pool.forget_schema(self.conninfo, self.schema),
            self._role,
            publish=self._traits[name].publish,
        )

    def fill(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` of statement ``name`` with what its traits (:class:`_sql.Traits`)
        take from this process: the floor as last read (unless given), the publish's
        gate, synchronous_commit. :meth:`rows` fills every statement it runs; a
        statement sent by libpq's own calls (the loop's claims, pipelined publishes) is
        filled by the code that builds it."""
        traits = self._traits[name]
        if traits.floor and "floor" not in params:
            params["floor"] = self.generations.floor
        if traits.publish:
            # notify only a queue somebody waits for, unless in an application's
            # transaction (see the top of sql/queries.sql)
            params["gate"] = transactions.current() is None
        if traits.relaxed:
            # the statement itself turns synchronous_commit off for its own commit
            params["synchronous_commit"] = "off" if self.options.relax_consumer_commits else None
        return params

    def rows(
        self, name: str, params: dict[str, Any], *, prepare: bool | None = None
    ) -> list[tuple[Any, ...]]:
        """Run statement ``name`` with ``params`` on a pooled connection (or the
        application's enlisted transaction), as its traits (:class:`_sql.Traits`) say;
        return its rows. The door of the typed methods over the shared pool
        (:class:`~._store.Store`'s, :class:`~._monitor.Monitor`'s); other code calls
        those."""
        traits = self._traits[name]
        own_floor = "floor" not in params
        self.fill(name, params)
        if traits.publish and (enlisted := transactions.current()) is not None:
            with self.translated(name):
                identity = self._q["database_identity"]
                return enlisted.rows(
                    self.schema, self._q[name], params, identity=identity, broker=self.database
                )
        size = 0
        if traits.attempt and isinstance(body := params.get("body"), bytes):
            size = len(body)  # its deadline grows with it (see _deadline)
        retried = False
        while True:
            try:
                with self._connection(name, size) as conn:
                    if traits.floor and self.generations.stale():
                        # on this connection and under this statement's deadline: its
                        # failure is the statement's
                        self.generations.note(conn.execute(self._q["generation_floor"]).fetchone())
                        if own_floor:
                            params["floor"] = self.generations.floor
                    cur = conn.execute(self._q[name], params, prepare=prepare)
                    # the result's status, not cur.description (which builds a Column per
                    # column)
                    result = cur.pgresult
                    if result is None or result.status != TUPLES_OK:
                        return []
                    return cur.fetchall()
            except (errors.DuplicatePreparedStatement, errors.InvalidSqlStatementName):
                # a transaction pooler the first connection did not recognise (another
                # client took its server session between the checks): the statement was
                # refused before it ran; from now on nothing is prepared (see _pool)
                if retried:
                    raise
                retried = True
                _pool.found_pooler(self.conninfo, self.pool)
            except errors.SerializationFailure:
                # READ COMMITTED raises it only for a row that the rotation moved to
                # another generation while this statement waited for it: the row is
                # there, with its lease, and a fenced statement finds it when sent again
                if retried or not traits.fenced:
                    raise
                retried = True

    def read_floor(self, *, now: bool = False) -> None:
        """Read :attr:`generations` again if they are stale (or ``now``: the rotation
        moved the floor: :func:`._rotation.rotate`), for statements sent otherwise than
        through :meth:`rows` (pipelined publishes). A failure leaves them as they were:
        the statement that follows meets it too."""
        if not now and not self.generations.stale():
            return
        self.generations.reading()
        try:
            row = self._one("generation_floor", {})
        except Exception:  # noqa: BLE001 - the publish that follows says what is wrong
            return
        self.generations.note(row)

    def _one(self, name: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        rows = self.rows(name, params)
        return rows[0] if rows else None

    def database(self, *, fresh: bool = False) -> transactions.Database:
        """The broker's database and server: read once, again when ``fresh``."""
        if fresh or self._database is None:
            row = self._one("database_identity", {})
            assert row is not None
            self._database = transactions.Database.from_row(row)
        return self._database
