"""Small helpers shared by the test directories: gates that tasks in worker processes
wait on, counts (rows of a table, the transport's event counters), messages put in and
taken out of a queue through Kombu, and a database of its own for a block.

Importable from every test directory and from worker processes, like ``waiting``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from kombu import Connection, Producer, Queue
from psycopg import sql
from psycopg.conninfo import make_conninfo
from waiting import wait_for

from kombu_pgqueue import admin

#: transport options under which every claim counts as slow (it resumes after its last
#: message) and the period of resuming never ends within a test
ALWAYS_RESUMED = {"slow_claim_seconds": 0.0, "resume_seconds": 3600.0}


def open_gate(conn: psycopg.Connection, schema: str, name: str, *, table: str = "gate") -> None:
    """Open gate ``name``: a row in ``schema.table`` (``name text PRIMARY KEY``); again: no-op."""
    conn.execute(
        sql.SQL("INSERT INTO {} (name) VALUES (%s) ON CONFLICT DO NOTHING").format(
            sql.Identifier(schema, table)
        ),
        (name,),
    )


def wait_gate(dsn: str, schema: str, name: str, timeout: float, *, table: str = "gate") -> None:
    """Wait until gate ``name`` is open (:func:`open_gate`); fail after ``timeout`` seconds."""
    query = sql.SQL("SELECT 1 FROM {} WHERE name = %s").format(sql.Identifier(schema, table))
    with psycopg.connect(dsn, autocommit=True) as conn:
        wait_for(lambda: conn.execute(query, (name,)).fetchone(), timeout, f"gate {name!r}")


def row_count(db: psycopg.Connection, schema: str, table: str = "message_store") -> int:
    """How many rows ``schema.table`` has, as ``db`` sees them."""
    row = db.execute(
        sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))
    ).fetchone()
    assert row is not None
    return int(row[0])


def counter(event: str, queue: str = "") -> int:
    """This process's count of ``event`` on ``queue`` (:func:`kombu_pgqueue.admin.counters`)."""
    return admin.counters().get((event, queue), 0)


def connected(url: str, **transport_options: object) -> Connection:
    """A Kombu connection to ``url``, connected (released again if connecting fails)."""
    conn = Connection(url, transport_options=transport_options)
    try:
        conn.connect()
    except BaseException:
        conn.release()
        raise
    return conn


def fill(conn: Connection, queue: str, bodies: Iterable[object], **publish: Any) -> None:
    """Publish each of ``bodies`` to ``queue`` (declared), with ``Producer.publish``'s
    keyword arguments ``publish`` (``priority=9``)."""
    producer = Producer(conn)
    for body in bodies:
        producer.publish(body, routing_key=queue, declare=[Queue(queue)], **publish)


def drain(conn: Connection, queue: str) -> list[Any]:
    """The payloads of every message ``queue`` delivers to ``conn`` now, each acked."""
    bound = Queue(queue, channel=conn.default_channel)
    got = []
    while (message := bound.get(no_ack=False)) is not None:
        got.append(message.payload)
        message.ack()
    return got


@contextmanager
def new_database(dsn: str, prefix: str = "pgq") -> Iterator[str]:
    """A new, empty database ``PREFIX_<random>`` on ``dsn``'s server for the block; its
    DSN. Dropped at the end, with whatever sessions still use it."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin_dsn = make_conninfo(dsn, dbname="postgres")
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(dsn, dbname=name)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def configure_django(dsn: str, elsewhere: str) -> None:
    """Django on ``dsn`` ("default"), on ``elsewhere``, another database of its server
    (where the broker schema is not), and on an in-memory SQLite ("lite"); once per
    process, by whichever test needs it first (Django is configured only once)."""
    import django  # noqa: PLC0415 - only the tests that use Django need it installed
    from django.conf import settings  # noqa: PLC0415

    import celery_pgqueue.django  # noqa: PLC0415

    if settings.configured:
        assert "elsewhere" in settings.DATABASES, "Django was configured by someone else"
        return
    settings.configure(
        DATABASES={
            "default": celery_pgqueue.django.database_settings(dsn),
            "elsewhere": celery_pgqueue.django.database_settings(elsewhere),
            "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
        },
        INSTALLED_APPS=[],
        USE_TZ=True,
    )
    django.setup()
