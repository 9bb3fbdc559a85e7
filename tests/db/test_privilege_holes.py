"""What a role that does not own the database may do, and what it is told.

* a role that owns an existing schema installs and upgrades it without ``CREATE`` on
  the database (``CREATE SCHEMA IF NOT EXISTS`` asks for that privilege even when the
  schema is there);
* the grant a ``PrivilegeError`` advises lets a worker run, but not rewrite the record
  of applied migrations (after ``DELETE FROM schema_migration`` no worker starts);
* a bulk publish that stages rows needs ``TEMPORARY`` on the database, and says so when
  the role lacks it. PUBLIC has ``TEMPORARY`` by default, so that test revokes it in a
  database of its own rather than in the shared one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from helpers import connected, new_database
from kombu import Connection, Consumer, Producer, Queue
from kombu.message import Message
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from test_least_privilege import documented_grants
from waiting import wait_for

from kombu_pgqueue import PrivilegeError, bulk, current_version, migrate
from kombu_pgqueue.embedded import broker_url
from kombu_pgqueue.migrations import latest_version


def _connect(url: str, schema: str, **options: object) -> Connection:
    return connected(url, **{"schema": schema, "batch_acks": False, **options})


def _may_create_in_database(db: psycopg.Connection, role: str) -> bool:
    row = db.execute(
        "SELECT has_database_privilege(%s, current_database(), 'CREATE')", (role,)
    ).fetchone()
    assert row is not None
    return bool(row[0])


def _advised(error: PrivilegeError) -> list[str]:
    """The statements an error tells the schema's owner to run (its text from GRANT on)."""
    text = str(error)
    assert "GRANT " in text, text
    assert "-- " not in text, text  # on one line, a comment would hide what follows it
    return [part.strip() for part in text[text.index("GRANT ") :].split(";") if part.strip()]


# -- (a) no CREATE on the database --------------------------------------------------------


def test_a_role_owning_the_schema_installs_it_without_create_on_the_database(
    db: psycopg.Connection, schema: str, role: str, url_with: Callable[..., str]
) -> None:
    assert not _may_create_in_database(db, role)
    db.execute(
        sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
            sql.Identifier(schema), sql.Identifier(role)
        )
    )

    conn = _connect(url_with(user=role), schema)  # auto_migrate on, the default
    try:
        Producer(conn).publish({"n": 1}, routing_key="q")
        assert conn.default_channel.store.size("q") == 1
    finally:
        conn.release()
    assert current_version(db, schema) == latest_version()


def test_migrate_on_a_current_schema_needs_no_create_privilege(
    db: psycopg.Connection, dsn: str, schema: str, role: str
) -> None:
    migrate(dsn, schema)
    ident, who = sql.Identifier(schema), sql.Identifier(role)
    db.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(ident, who))
    db.execute(sql.SQL("GRANT SELECT ON {}.schema_migration TO {}").format(ident, who))
    assert not _may_create_in_database(db, role)

    # what `python -m kombu_pgqueue migrate` runs, as a role that may only read the version
    assert migrate(make_conninfo(dsn, user=role), schema) == []


# -- (b) the advised grant -----------------------------------------------------------------


def test_the_advised_grant_lets_a_worker_run_but_not_rewrite_schema_migration(
    db: psycopg.Connection, dsn: str, schema: str, role: str, url_with: Callable[..., str]
) -> None:
    migrate(dsn, schema)  # by its owner
    with pytest.raises(PrivilegeError) as caught:
        _connect(url_with(user=role), schema, auto_migrate=False)
    for statement in _advised(caught.value):
        db.execute(statement)  # as the owner would

    worker = _connect(url_with(user=role), schema, auto_migrate=False, polling_interval=0.5)
    try:
        Producer(worker).publish({"n": 1}, routing_key="q")
        got: list[int] = []

        def on_message(body: dict[str, int], message: Message) -> None:
            got.append(body["n"])
            message.ack()

        def delivered() -> bool:
            try:
                worker.drain_events(timeout=0.5)
            except TimeoutError:
                pass
            return got == [1]

        with Consumer(worker, [Queue("q")], callbacks=[on_message]):
            wait_for(delivered, 15, "the worker's delivery", details=lambda: got)
        assert worker.default_channel.store.size("q") == 0
    finally:
        worker.release()

    table = sql.Identifier(schema, "schema_migration")
    with psycopg.connect(make_conninfo(dsn, user=role), autocommit=True) as conn:
        assert conn.execute(sql.SQL("SELECT max(version) FROM {}").format(table)).fetchone() == (
            latest_version(),
        )
        for statement in (
            "DELETE FROM {}",
            "UPDATE {} SET version = 0",
            "INSERT INTO {} (version, name) VALUES (9999, 'evil')",
            "TRUNCATE {}",
        ):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(sql.SQL(statement).format(table))
    assert current_version(db, schema) == latest_version()


# -- (c) TEMPORARY on the database ---------------------------------------------------------


@pytest.fixture
def no_temporary_dsn(dsn: str, role: str) -> Iterator[str]:
    """A new database where PUBLIC may not create temporary tables (the shared test
    database keeps PUBLIC's default); dropped, before ``role``, after the test."""
    with new_database(dsn, "pgq_notemp") as created:
        ident = sql.Identifier(conninfo_to_dict(created)["dbname"])
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("REVOKE TEMPORARY ON DATABASE {} FROM PUBLIC").format(ident))
        yield created


def bulk_publish_with_an_eta(conn: Connection) -> int:
    """Two messages by ``publish_many``; their ETA takes them through the staging table
    (a COPY straight into the queue table takes only messages without one)."""
    soon = datetime.now(timezone.utc) + timedelta(minutes=5)
    return bulk.publish_many(conn, [{"n": 1}, {"n": 2}], "q", headers={"eta": soon.isoformat()})


def test_the_documented_grants_let_a_bulk_publish_stage_where_public_has_no_temporary(
    no_temporary_dsn: str, schema: str, role: str
) -> None:
    migrate(no_temporary_dsn, schema)
    with psycopg.connect(no_temporary_dsn, autocommit=True) as owner:
        for statement in documented_grants(owner, schema, role):
            owner.execute(statement)
    conn = Connection(
        broker_url(make_conninfo(no_temporary_dsn, user=role)),
        transport_options={"schema": schema, "auto_migrate": False},
    )
    try:
        assert bulk_publish_with_an_eta(conn) == 2
    finally:
        conn.release()


def test_a_bulk_publish_without_temporary_names_the_grant(
    no_temporary_dsn: str, schema: str, role: str
) -> None:
    migrate(no_temporary_dsn, schema)
    database = str(conninfo_to_dict(no_temporary_dsn)["dbname"])
    with psycopg.connect(no_temporary_dsn, autocommit=True) as owner:
        for statement in documented_grants(owner, schema, role):
            if "ON DATABASE" not in statement:  # all but TEMPORARY
                owner.execute(statement)
        who = sql.Identifier(role)
        url = broker_url(make_conninfo(no_temporary_dsn, user=role))
        conn = _connect(url, schema, auto_migrate=False)
        try:
            with pytest.raises(PrivilegeError) as caught:
                bulk_publish_with_an_eta(conn)
            message = str(caught.value)
            assert "TEMPORARY" in message and role in message and database in message
            advised = _advised(caught.value)
            assert advised == [
                sql.SQL("GRANT TEMPORARY ON DATABASE {} TO {}")
                .format(sql.Identifier(database), who)
                .as_string(owner)
            ]
            owner.execute(advised[0])
            assert bulk_publish_with_an_eta(conn) == 2
        finally:
            conn.release()
