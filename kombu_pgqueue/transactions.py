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
The broker's schema must live in the same database: the first publish checks for
it and raises :class:`~kombu_pgqueue.ConfigurationError` if it is not there,
since a transaction cannot span two databases.

Asynchronous handles (psycopg's ``AsyncConnection``, SQLAlchemy's ``AsyncSession``)
are refused: Kombu publishes synchronously, and a synchronous call cannot wait for
an async driver on the event loop it is blocking. SQLAlchemy's ``run_sync`` is the
way through (see :mod:`celery_pgqueue.asyncio`).

Integrations that enlist on their own (``celery_pgqueue.django.enlist_atomic``)
register a resolver with :func:`add_resolver`; :func:`current` asks the resolvers
when no ``transaction()`` block is active.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import psycopg
from psycopg import sql

from .exceptions import ConfigurationError

Rows = list[tuple[Any, ...]]


class Enlisted:
    """Runs statements on the application's connection, in its transaction."""

    def __init__(self, run: Callable[[sql.Composed | sql.SQL, dict[str, Any]], Rows]) -> None:
        self._run = run
        self._checked: set[str] = set()

    def rows(
        self,
        schema: str,
        query: sql.Composed | sql.SQL,
        params: dict[str, Any],
        installed: sql.Composed | sql.SQL,
    ) -> Rows:
        """Run the store's ``query``; first, once per schema, its ``installed`` check."""
        if schema not in self._checked:
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
    return Enlisted(_runner(conn))


def _runner(conn: Any) -> Callable[[sql.Composed | sql.SQL, dict[str, Any]], Rows]:
    if isinstance(conn, psycopg.Connection):

        def run_psycopg(query: sql.Composed | sql.SQL, params: dict[str, Any]) -> Rows:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

        return run_psycopg
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

    return run_sqlalchemy


def _django_runner(conn: Any) -> Callable[[sql.Composed | sql.SQL, dict[str, Any]], Rows]:
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

    return run_django


@contextmanager
def transaction(conn: Any) -> Iterator[Enlisted]:
    """Write pgqueue publishes made inside the block through ``conn``'s transaction."""
    enlisted = enlist(conn)
    token = _current.set(enlisted)
    try:
        yield enlisted
    finally:
        _current.reset(token)
