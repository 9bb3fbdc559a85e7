"""The public door to a pgqueue broker for tools: the Celery CLI, metrics, bulk sends, Spark.

.. code-block:: python

    from kombu_pgqueue import admin

    broker = admin.Broker("postgresql://app@db.internal/app", schema="pgqueue")
    for stats in broker.queue_stats():
        print(stats.queue, stats.ready, stats.leased, stats.dead)
    dead = broker.dead_letters("emails", limit=10)
    broker.requeue_dead([letter.id for letter in dead])
    broker.purge_dead(reason="failed", older_than=timedelta(days=7))

:class:`Broker` works on one schema of one database: queue statistics, dead letters,
purges, migrations, bulk loads and the monitor's bounded-cost queries. It is built from
a DSN or ``pgqueue://`` URL and transport options, or from a Kombu connection (a Celery
app's ``app.connection_for_write()``). It opens nothing until first used, and then
shares the process's connection pool with every Kombu connection to that database.

Periodic task entries (``celery_pgqueue.beat``) are here too: :meth:`Broker.periodic_entries`,
:meth:`Broker.save_periodic` and the methods beside it, with their records in
:mod:`kombu_pgqueue.schedule`.

Also here: the records it returns (:mod:`kombu_pgqueue.records`), transport option
parsing (:func:`parse_options`), what to do about a broker URL Kombu has no transport
for (:func:`missing_transport`), :func:`load_staged` for connections the caller opened
itself (a Spark executor's) and :func:`counters`, this process's event counters.
Everything with a leading underscore elsewhere in the package may change without notice;
what this module exports is the stable surface.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeAlias

import psycopg
from kombu.connection import Connection
from psycopg.conninfo import make_conninfo

from . import _copy, _counters, _store, migrations, schedule
from ._monitor import DEFAULT_CAP, Generation, Monitor, QueueDepth, TableSize
from ._options import (
    DEFAULT_SCHEMA,
    Options,
    check_schema,
    connection_conninfo,
    missing_transport,
    notify_channel,
    parse_options,
)
from .exceptions import ConfigurationError
from .records import STAGING_COLUMNS, DeadLetter, Delivered, Failure, Outgoing, QueueStats

__all__ = [
    "COUNTER_EVENTS",
    "DEFAULT_CAP",
    "DEFAULT_SCHEMA",
    "STAGING_COLUMNS",
    "Broker",
    "DeadLetter",
    "Delivered",
    "Failure",
    "Generation",
    "Monitor",
    "Options",
    "Outgoing",
    "QueueDepth",
    "QueueStats",
    "StagingRow",
    "TableSize",
    "counters",
    "load_staged",
    "missing_transport",
    "parse_options",
]

#: A message as the staging table takes it: the values of :data:`STAGING_COLUMNS`, in
#: that order (``Outgoing.row()`` makes one).
StagingRow: TypeAlias = Sequence[Any]

#: The events :func:`counters` counts, each by queue ("" where the queue is not known).
COUNTER_EVENTS: tuple[str, ...] = _counters.EVENTS

#: every (dead letter) row, for ``limit``
_NO_LIMIT = 2**62

#: Kombu's Connection is unannotated: a typed view of its constructor
_new_connection: Callable[..., Connection] = Connection


def counters() -> dict[tuple[str, str], int]:
    """``{(event, queue): count}`` of this process since it started (see :data:`COUNTER_EVENTS`).

    Process-wide, not per broker: the consumers, ack batchers and lease keepers of every
    connection in the process count into the same integers. Costs no query.
    """
    return _counters.snapshot()


def load_staged(
    conn: psycopg.Connection[Any],
    rows: Iterable[StagingRow],
    *,
    schema: str = DEFAULT_SCHEMA,
    ordered: bool = True,
    binary: bool = False,
) -> int:
    """Load staging rows into ``schema``'s queues in one transaction of ``conn``.

    For a connection the caller opened itself (a Spark executor's); otherwise use
    :meth:`Broker.publish_rows`, which borrows one from the broker's pool. Returns how
    many were inserted: a row whose dedup key is already waiting or running is skipped.
    Consumers get one NOTIFY per queue at commit. ``ordered=False`` lets ids follow any
    order (cheaper for large loads); ``binary`` sends binary COPY, which needs values of
    exactly the staging types (aware datetimes, priorities within int2).
    """
    schema = check_schema(schema)
    channel = notify_channel(schema)
    return _copy.load_staged(conn, schema, channel, rows, ordered=ordered, binary=binary)


def conninfo(dsn: str, /, **transport_options: Any) -> str:
    """The libpq connection string of ``dsn``: a libpq URL or key=value string as it is,
    or a ``pgqueue://`` / ``pgqueue+postgresql://`` broker URL (the first URL of a
    failover list) as the transport connects with it. For the places that take a DSN
    (``configure()``, ``python -m kombu_pgqueue migrate --dsn``), so a broker URL works."""
    options = parse_options(transport_options)
    if dsn.partition("://")[0].split("+")[0] == "pgqueue":
        connection = _new_connection(dsn.split(";")[0], transport_options=transport_options)
        return _connection_conninfo(connection, options)
    return make_conninfo(dsn, **options.libpq)


def _connection_conninfo(connection: Connection, options: Options) -> str:
    """The libpq string the transport builds for ``connection`` (so the two share a pool)."""
    get_transport_cls: Callable[[], type[Any]] = connection.get_transport_cls  # unannotated
    transport_cls = get_transport_cls()
    if getattr(transport_cls, "driver_type", None) != "pgqueue":
        raise ConfigurationError(
            f"the broker {connection.as_uri()!r} is not a pgqueue broker (its transport is "
            f"{transport_cls.__module__}.{transport_cls.__qualname__}); pgqueue's "
            "administration works on pgqueue:// brokers only"
        )
    return connection_conninfo(connection, options.libpq)


class Broker:
    """Administration of one pgqueue schema in one database.

    ``Broker(dsn, **transport_options)``: ``dsn`` is a libpq URL or key=value string, or a
    ``pgqueue://`` broker URL; ``transport_options`` are the transport's (``schema``,
    ``auto_migrate``, ``pool_max_size``, libpq keywords such as ``sslmode`` ...; see
    docs/configuration.md, "Transport options").

    Each method runs one statement on a pooled connection and commits it; nothing holds a
    transaction open between calls, and a Broker may be shared by threads. Publishes
    inside :func:`kombu_pgqueue.transaction` go through the application's transaction.
    The first query of a process installs or upgrades the schema unless
    ``auto_migrate=False``, which makes it raise :class:`~kombu_pgqueue.SchemaError`
    instead. Connection errors are psycopg's own.
    """

    def __init__(self, dsn: str, /, **transport_options: Any) -> None:
        self._init(conninfo(dsn, **transport_options), parse_options(transport_options))

    def _init(self, conninfo: str, options: Options) -> None:
        #: the libpq connection string
        self.conninfo = conninfo
        #: the parsed transport options
        self.options = options
        self._store = _store.Store(conninfo, options)

    @classmethod
    def from_connection(cls, connection: Connection, /, **overrides: Any) -> Broker:
        """The broker of a Kombu connection (``app.connection_for_write()`` in Celery).

        Reads the connection's URL and transport options; ``overrides`` replace options
        (``schema="other"``, ``auto_migrate=False`` ...). Neither opens nor keeps the
        connection: it may be released at once. Raises :class:`ConfigurationError`
        (a ValueError) if the connection's transport is not pgqueue.
        """
        options = parse_options({**(connection.transport_options or {}), **overrides})
        broker = cls.__new__(cls)
        broker._init(_connection_conninfo(connection, options), options)
        return broker

    def __repr__(self) -> str:
        return f"<{type(self).__name__} schema={self.schema!r}>"

    @property
    def schema(self) -> str:
        """The schema holding this broker's tables."""
        return self.options.schema

    # -- schema ------------------------------------------------------------------------

    def migrate(self) -> list[int]:
        """Install or upgrade the schema, whatever ``auto_migrate`` says; return the
        versions applied (empty when it was current). Uses a connection of its own."""
        return migrations.migrate(self.conninfo, self.schema)

    def schema_version(self) -> int:
        """The schema's applied migration version; 0 when it does not exist."""
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            return migrations.current_version(conn, self.schema)

    def ensure_schema(self) -> None:
        """Migrate the schema if ``auto_migrate`` (the default) allows, else check it.

        Raises psycopg's error for a database that cannot be reached,
        :class:`~kombu_pgqueue.SchemaError` for a missing or old schema when
        ``auto_migrate`` is off, :class:`~kombu_pgqueue.PrivilegeError` for a role that
        may not use it. Cheap when it is current; uses a connection of its own.
        """
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            migrations.ensure(conn, self.schema, auto_migrate=self.options.auto_migrate)

    # -- queues ------------------------------------------------------------------------

    def queue_stats(self) -> list[QueueStats]:
        """Per queue, by name: ready, delayed (ETA), leased, dead, oldest ready age.

        Exact counts, so it reads every message; for a scraper that runs every few
        seconds against large queues, use :meth:`monitor`, which stops counting at a cap.
        """
        return self._store.queue_stats()

    def queue_exists(self, queue: str) -> bool:
        """Whether ``queue`` was declared or holds messages."""
        return self._store.queue_exists(queue)

    def delete_queue(self, queue: str, *, if_unused: bool = False) -> int | None:
        """Delete ``queue``: its declaration, its bindings and every message in it, those
        consumers hold too (as RabbitMQ's ``queue.delete``); return how many messages.
        Its dead letters stay. With ``if_unused``, delete nothing and return None while a
        consumer uses it (holds one of its messages, or waits for it).

        Publishers that declared the queue before do not declare it again: what they
        send through an exchange finds no binding and is dropped as unroutable until
        they restart (and a worker that still consumes it re-declares it only when it
        reconnects). Stop the queue's publishers and workers first."""
        return self._store.delete_queue(queue, if_unused=if_unused)

    def purge(self, queue: str) -> int:
        """Delete the waiting messages of ``queue`` (leased ones stay with their
        consumer); return how many."""
        return self._store.purge(queue)

    def monitor(self, *, cap: int = DEFAULT_CAP) -> Monitor:
        """Bounded-cost queries for metrics: ``queue_depths()`` and ``table_sizes()``.

        Counts are exact up to ``cap`` messages per queue and estimated beyond (see
        :class:`QueueDepth`).
        """
        return Monitor(self._store, cap=cap)

    # -- dead letters ------------------------------------------------------------------

    def dead_letters(
        self, queue: str | None = None, limit: int | None = 100, *, reason: str | None = None
    ) -> list[DeadLetter]:
        """Dead letters, oldest first: of ``queue`` (None: every queue) and ``reason``
        (``"failed"``, ``"rejected"``, ...; None: any), at most ``limit`` of them (None:
        all). A failed task's letter carries its traceback."""
        limit = _NO_LIMIT if limit is None else limit
        return self._store.dead_letters_where(queue, reason, limit)

    def dead_letter(self, id: int) -> DeadLetter | None:
        """The dead letter ``id``, or None if there is none."""
        return self._store.dead_letter_full(id)

    def requeue_dead(self, ids: Sequence[int]) -> list[str]:
        """Put dead letters back in their queues with their attempts reset; return the
        queues that got some.

        A letter whose dedup key a live message holds stays dead rather than run twice,
        and an unknown id is ignored: list the dead letters again to see which stayed.
        """
        return self._store.requeue_dead(list(ids)) if ids else []

    def purge_dead(
        self,
        queue: str | None = None,
        *,
        reason: str | None = None,
        older_than: timedelta | None = None,
        now: datetime | None = None,
    ) -> int:
        """Delete dead letters for good; return how many. Those of ``queue`` (None: every
        queue), of ``reason`` (None: any) and, with ``older_than``, only those that died
        longer ago than that, as of ``now`` (None: the database server's clock)."""
        seconds = None if older_than is None else older_than.total_seconds()
        return self._store.purge_dead_where(queue, reason, seconds, now)

    def bury_failed(self, failure: Failure) -> int | None:
        """Keep a task that failed for good as a dead letter with reason ``failed``, its
        error and traceback; return the letter's id (its message's).

        Called from the process that ran the task (``celery_pgqueue``'s keep_failed). A
        message that its delivery still holds (late acks) is kept as stored, and moved
        out of its queue when ``failure.move`` says no ack follows; one already acked
        (early acks) is written from ``failure.message``. Returns None, and keeps
        nothing, when another delivery holds the message now: the delivery's lease
        lapsed, and the message runs again there. A dead letter of the same message
        (rejected meanwhile) takes the reason, error and traceback.
        """
        return self._store.bury_failed(failure)

    # -- bulk loads --------------------------------------------------------------------

    def publish_rows(self, rows: Sequence[StagingRow]) -> int:
        """Store staging rows in one transaction; return how many were inserted.

        The fast path of bulk sends: on the broker's own connections the rows go in by
        COPY; inside :func:`kombu_pgqueue.transaction`, as one INSERT in the
        application's transaction. A row whose dedup key is already waiting or running
        is skipped. Each queue's consumers get one NOTIFY.
        """
        return self._store.publish_rows(rows)

    def publish_many(self, messages: Sequence[Outgoing]) -> int:
        """:meth:`publish_rows` for :class:`Outgoing` records (``kombu_pgqueue.codec``
        builds them from Kombu messages)."""
        return self._store.publish_many(messages)

    # -- periodic tasks (celery_pgqueue.beat; records in kombu_pgqueue.schedule) --------

    @contextmanager
    def _direct(self) -> Iterator[psycopg.Connection[Any]]:
        # a connection of its own, as migrate() uses: rare commands, not a hot path
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            migrations.ensure(conn, self.schema, auto_migrate=self.options.auto_migrate)
            yield conn

    def periodic_entries(self) -> list[schedule.Entry]:
        """Every periodic entry by name, paused ones too, with its last due time, last
        run and counts."""
        with self._direct() as conn:
            return schedule.entries(conn, self.schema)

    def save_periodic(self, spec: schedule.EntrySpec, *, now: datetime | None = None) -> bool:
        """Add a periodic entry, or change the one of its name; return whether anything
        changed. The running beats take it at their next tick. A changed entry keeps
        its last due time, its counts and its pause; a new one is first due after
        ``now`` (None: the database server's clock)."""
        with self._direct() as conn:
            return schedule.save(conn, self.schema, spec, now=now)

    def pause_periodic(self, name: str, *, now: datetime | None = None) -> bool:
        """Pause entry ``name``; False if there is none. No beat sends it from now on,
        not even one that read it before."""
        with self._direct() as conn:
            return schedule.pause(conn, self.schema, name, now)

    def resume_periodic(self, name: str, *, now: datetime | None = None) -> bool:
        """Resume paused entry ``name`` from ``now``: the due times of the pause are not
        sent. False if there is no paused entry of that name."""
        with self._direct() as conn:
            return schedule.resume(conn, self.schema, name, now)

    def remove_periodic(self, name: str) -> bool:
        """Remove entry ``name``; False if there is none. An entry of ``beat_schedule``
        comes back when a beat starts unless it is removed from there too."""
        with self._direct() as conn:
            return schedule.remove(conn, self.schema, name)

    def beat_leader(self) -> schedule.Leader | None:
        """The beat that leads (sends the due tasks), or None while none does."""
        with self._direct() as conn:
            return schedule.leader(conn, self.schema)
