"""Publishing inside the application's own transaction.

.. code-block:: python

    with psycopg.connect(dsn) as conn, conn.transaction():
        conn.execute("INSERT INTO orders ...")
        with kombu_pgqueue.transaction(conn):
            producer.publish({"order": 42}, routing_key="orders")   # or task.delay(42)
    # committed: the order and the message together; rolled back: neither

While the block is active, every pgqueue publish made in this thread (or asyncio
task) is written through ``conn`` instead of the broker's pool: the message becomes
visible to consumers when that transaction commits, its NOTIFY is sent at commit,
and a rollback (or a crash before commit) leaves no message. Savepoints behave as
they do for any other row.

``conn`` may be a psycopg 3 connection, a SQLAlchemy ``Session`` or
``Connection`` (any PostgreSQL driver with ``%(name)s`` parameters: psycopg 3 or
psycopg2), or Django's ``connection`` (``django.db.connections[alias]``: the
statements go through its cursor, so they join the ``atomic()`` block it is in).
``conn`` must reach the broker's own database on the broker's own server: a
transaction cannot span two databases, and another database that also holds the
broker's schema would take the message where no consumer of the broker looks. The
first publish through a connection compares the two (:class:`Database`: the
cluster's system identifier, the database's oid and the server's start time, which
every role may read and which are the same through PgBouncer or any address) and
raises :class:`~kombu_pgqueue.ConfigurationError` naming both when they differ.
The answer is kept per connection, so later blocks on it send no extra statement.

Asynchronous handles (psycopg's ``AsyncConnection``, SQLAlchemy's ``AsyncSession``)
are refused: Kombu publishes synchronously, and a synchronous call cannot wait for
an async driver on the event loop it is blocking. SQLAlchemy's ``run_sync`` is the
way through (see :mod:`celery_pgqueue.asyncio`).

Integrations that enlist on their own (``celery_pgqueue.django.enlist_atomic``)
register a resolver with :func:`add_resolver`; :func:`current` asks the resolvers
when no ``transaction()`` block is active.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import psycopg
from psycopg import sql

from .exceptions import ConfigurationError

Rows = list[tuple[Any, ...]]
Run = Callable[[sql.Composed | sql.SQL, dict[str, Any]], Rows]


@dataclass(frozen=True, slots=True, kw_only=True)
class Database:
    """Which database of which server a connection reaches (statement ``database_identity``).

    ``system`` (the cluster's system identifier) and ``oid`` tell clusters and their
    databases apart, but a server restored from a copy of another (a snapshot, a base
    backup) has the other's of both; ``started``, its postmaster's start time, differs.
    ``address`` and ``port`` name the server in messages only: the same server reached
    through PgBouncer, a Unix socket or another address reports others.
    """

    name: str
    oid: int
    system: int
    started: datetime
    address: str | None
    port: int | None

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Database:
        """From a ``database_identity`` row: name, oid, system, started, address, port."""
        name, oid, system, started, address, port = row
        return cls(
            name=name,
            oid=int(oid),
            system=int(system),
            started=started,
            address=address,
            port=None if port is None else int(port),
        )

    def same(self, other: Database) -> bool:
        """Whether both are the same database of the same running server."""
        return (self.system, self.oid, self.started) == (other.system, other.oid, other.started)

    def __str__(self) -> str:
        where = f"{self.address}:{self.port}" if self.address else "a Unix socket"
        return (
            f"database {self.name!r} (oid {self.oid}) of the server at {where} "
            f"(system identifier {self.system}, started {self.started.isoformat()})"
        )


class BrokerDatabase(Protocol):
    """The broker's :class:`Database`, read once by its store; again when ``fresh``."""

    def __call__(self, *, fresh: bool = False) -> Database: ...


#: each application connection's Database, keyed on the driver's connection object
_databases: weakref.WeakKeyDictionary[Any, Database] = weakref.WeakKeyDictionary()


class Enlisted:
    """Runs statements on the application's connection, in its transaction."""

    def __init__(self, run: Run, driver: Callable[[], Any] | None = None) -> None:
        self._run = run
        #: the driver's connection object under ``run``: its Database is kept per object
        self._driver = driver
        self._checked: set[str] = set()

    def rows(
        self,
        schema: str,
        query: sql.Composed | sql.SQL,
        params: dict[str, Any],
        installed: sql.Composed | sql.SQL | None = None,
        *,
        identity: sql.Composed | sql.SQL | None = None,
        broker: BrokerDatabase | None = None,
    ) -> Rows:
        """Run the store's ``query`` once this connection is known to reach the broker's
        database (``identity``, the ``database_identity`` statement, run here and by the
        store through ``broker``). A store that passes neither gets the older, weaker
        check: once per schema, its ``installed`` statement."""
        if identity is not None and broker is not None:
            self._check_database(schema, identity, broker)
        elif installed is not None and schema not in self._checked:
            found = self._run(installed, {"schema": schema})
            if not (found and found[0][0]):
                raise ConfigurationError(
                    f"the pgqueue schema {schema!r} is not in the database of the connection "
                    "passed to transaction(): the broker is another database, and a "
                    "transaction cannot span two. Publish after commit instead "
                    "(Django: transaction.on_commit)."
                )
            self._checked.add(schema)
        return self._run(query, params)

    def _check_database(
        self,
        schema: str,
        identity: sql.Composed | sql.SQL,
        broker: BrokerDatabase,
        *,
        given: str = "transaction() was given a connection",
        remedy: str = (
            "Pass a connection to the broker's database, or publish after commit instead "
            "(Django: transaction.on_commit)."
        ),
    ) -> None:
        here, there = self._database(identity), broker()
        if here.same(there):
            return
        # either answer may be stale (a restarted server has a new start time): read
        # both again before refusing
        here, there = self._database(identity, fresh=True), broker(fresh=True)
        if not here.same(there):
            raise ConfigurationError(
                f"{given} to {here}, but the broker's pgqueue schema {schema!r} is in "
                f"{there}. A transaction cannot span two databases, and the message would "
                f"be written where no consumer of this broker looks. {remedy}"
            )

    def _database(self, identity: sql.Composed | sql.SQL, *, fresh: bool = False) -> Database:
        driver = self._driver() if self._driver is not None else None
        if not fresh and driver is not None:
            known = _known(driver)
            if known is not None:
                return known
        found = self._run(identity, {})
        if not found:
            raise ConfigurationError(
                "transaction()'s connection did not say which database it is connected to"
            )
        database = Database.from_row(found[0])
        if driver is not None:
            _remember(driver, database)
        return database


def _known(driver: Any) -> Database | None:
    try:
        return _databases.get(driver)
    except TypeError:  # a driver connection that takes no weak reference: not kept
        return None


def _remember(driver: Any, database: Database) -> None:
    try:
        _databases[driver] = database
    except TypeError:
        pass


_current: ContextVar[Enlisted | None] = ContextVar("pgqueue_enlisted", default=None)
_resolvers: list[Callable[[], Enlisted | None]] = []


def current() -> Enlisted | None:
    """The enlisted transaction of this context: a ``transaction()`` block, or a resolver's."""
    found = _current.get()
    if found is None:
        for resolve in tuple(_resolvers):
            found = resolve()
            if found is not None:
                break
    return found


def add_resolver(resolve: Callable[[], Enlisted | None]) -> Callable[[], None]:
    """Ask ``resolve()`` for a transaction when no block is active; return the undo."""
    _resolvers.append(resolve)

    def remove() -> None:
        if resolve in _resolvers:
            _resolvers.remove(resolve)

    return remove


def enlist(conn: Any) -> Enlisted:
    """An :class:`Enlisted` writing through ``conn`` (the kinds ``transaction()`` takes)."""
    return Enlisted(*_runner(conn))


def _runner(conn: Any) -> tuple[Run, Callable[[], Any]]:
    """How to run a statement on ``conn``, and how to reach its driver connection."""
    if isinstance(conn, psycopg.Connection):

        def run_psycopg(query: sql.Composed | sql.SQL, params: dict[str, Any]) -> Rows:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

        return run_psycopg, lambda: conn
    if isinstance(conn, psycopg.AsyncConnection) or hasattr(conn, "run_sync"):
        raise ConfigurationError(
            f"transaction() cannot use an asynchronous {type(conn).__name__}: Kombu "
            "publishes synchronously. With SQLAlchemy, publish inside "
            "`await session.run_sync(...)` (celery_pgqueue.asyncio.enqueue does)"
        )
    if hasattr(conn, "ensure_connection") and hasattr(conn, "in_atomic_block"):
        return _django_runner(conn)
    # SQLAlchemy: a Session hands out its Connection; a Connection runs driver SQL
    sa_connection = conn.connection() if hasattr(conn, "get_bind") else conn
    if not hasattr(sa_connection, "exec_driver_sql"):
        raise ConfigurationError(
            f"transaction() takes a psycopg 3 connection, a SQLAlchemy Session or "
            f"Connection, or a Django connection, not {type(conn).__name__}"
        )

    def run_sqlalchemy(query: sql.Composed | sql.SQL, params: dict[str, Any]) -> Rows:
        result = sa_connection.exec_driver_sql(query.as_string(None), params)
        return [tuple(row) for row in result.fetchall()] if result.returns_rows else []

    def sqlalchemy_driver() -> Any:
        # the pool's connection outlives the Session and the Connection around it
        pooled = sa_connection.connection
        return getattr(pooled, "dbapi_connection", pooled)

    return run_sqlalchemy, sqlalchemy_driver


def _django_runner(conn: Any) -> tuple[Run, Callable[[], Any]]:
    # Django's cursor, not the raw driver connection: it opens the connection when
    # needed, refuses queries in a broken atomic block, and shows up in
    # connection.queries and execute_wrapper() like the application's own SQL
    if conn.vendor != "postgresql":
        raise ConfigurationError(
            f"transaction() needs a PostgreSQL database; Django's {conn.alias!r} "
            f"connection is {conn.vendor!r}"
        )

    def run_django(query: sql.Composed | sql.SQL, params: dict[str, Any]) -> Rows:
        try:
            with conn.cursor() as cur:
                cur.execute(query.as_string(None), params)
                return [tuple(row) for row in cur.fetchall()] if cur.description else []
        except Exception as exc:
            # Django re-raises driver errors as its own; the store translates psycopg's
            if isinstance(exc.__cause__, psycopg.Error):
                raise exc.__cause__ from None
            raise

    def django_driver() -> Any:
        # a new one after Django reconnects (CONN_MAX_AGE, a dropped connection)
        conn.ensure_connection()
        return conn.connection

    return run_django, django_driver


@contextmanager
def transaction(conn: Any) -> Iterator[Enlisted]:
    """Write pgqueue publishes made inside the block through ``conn``'s transaction
    (``conn`` may be what :func:`enlist` made of it)."""
    enlisted = conn if isinstance(conn, Enlisted) else enlist(conn)
    token = _current.set(enlisted)
    try:
        yield enlisted
    finally:
        _current.reset(token)
