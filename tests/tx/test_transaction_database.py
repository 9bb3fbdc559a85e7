"""transaction(conn) writes only through a connection to the broker's own database.

A connection to another database that also holds the broker's schema (a twin: the
same schema name, migrated there too) would take the message silently, and no
consumer of the broker would ever see it. The twin here is a database of its own on
the test server, made for this module and dropped after it; other servers (a copy of
the broker's, the broker's after a restart) are throwaway clusters of their own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from clusters import Cluster
from helpers import new_database, row_count
from kombu import Connection, Producer
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

import celery_pgqueue
import kombu_pgqueue
from kombu_pgqueue import ConfigurationError
from kombu_pgqueue.embedded import broker_url

QUEUE = "tx"


@pytest.fixture(scope="module")
def twin_dsn(dsn: str) -> Iterator[str]:
    """A DSN for a new, empty database on the test server; dropped after the module."""
    with new_database(dsn, "pgq_twin") as twin:
        yield twin


@pytest.fixture
def twin(twin_dsn: str, schema: str) -> Iterator[str]:
    """The twin database with the broker's schema installed in it too."""
    kombu_pgqueue.migrate(twin_dsn, schema)
    yield twin_dsn
    with psycopg.connect(twin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def _messages(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return row_count(conn, schema)


def _dbname(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


def test_a_connection_to_another_database_with_the_schema_is_refused_naming_both(
    connection: Connection, dsn: str, twin: str, schema: str
) -> None:
    with psycopg.connect(twin) as other:
        with other.transaction(), kombu_pgqueue.transaction(other):
            with pytest.raises(ConfigurationError) as caught:
                Producer(connection).publish({"n": 1}, routing_key=QUEUE)

    message = str(caught.value)
    assert repr(_dbname(twin)) in message  # the connection's database ...
    assert repr(_dbname(dsn)) in message  # ... and the broker's
    assert schema in message
    assert _messages(twin, schema) == 0
    assert _messages(dsn, schema) == 0


def test_a_sqlalchemy_session_on_another_database_fails_celery_delay(
    app: Any, connection: Connection, dsn: str, twin: str, schema: str
) -> None:
    @app.task(name="tx.noop", shared=False)
    def noop() -> None:
        pass

    engine = create_engine(celery_pgqueue.result_backend_url(twin).removeprefix("db+"))
    try:
        with Session(engine) as session, session.begin():
            with kombu_pgqueue.transaction(session), pytest.raises(ConfigurationError) as caught:
                noop.delay()
    finally:
        engine.dispose()

    assert repr(_dbname(twin)) in str(caught.value)
    assert _messages(twin, schema) == 0
    assert _messages(dsn, schema) == 0


@pytest.fixture
def publishing_role(db: psycopg.Connection, schema: str, connection: Connection) -> Iterator[str]:
    """A role that may only use the broker's schema: no function, setting or catalogue
    privilege beyond what every role has."""
    name = f"pgq_pub_{uuid.uuid4().hex[:8]}"
    role, ident = sql.Identifier(name), sql.Identifier(schema)
    db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
    try:
        db.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(ident, role))
        db.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA {} TO {}").format(
                ident, role
            )
        )
        # the ids and the generation that message_store's defaults read
        db.execute(sql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA {} TO {}").format(ident, role))
        yield name
    finally:
        db.execute(sql.SQL("DROP OWNED BY {}").format(role))
        db.execute(sql.SQL("DROP ROLE {}").format(role))


def test_an_unprivileged_role_on_the_brokers_database_publishes(
    connection: Connection, dsn: str, schema: str, publishing_role: str
) -> None:
    with psycopg.connect(make_conninfo(dsn, user=publishing_role)) as conn:
        with conn.transaction(), kombu_pgqueue.transaction(conn):
            Producer(connection).publish({"n": 1}, routing_key=QUEUE)

    assert _messages(dsn, schema) == 1


def test_the_database_is_checked_once_per_connection(
    connection: Connection, dsn: str, schema: str
) -> None:
    sent: list[str] = []

    class Recording(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            as_text = query.as_string(self.connection) if hasattr(query, "as_string") else query
            sent.append(str(as_text))
            return super().execute(query, params, **kwargs)

    producer = Producer(connection)
    with psycopg.connect(dsn, cursor_factory=Recording) as conn:
        with conn.transaction(), kombu_pgqueue.transaction(conn):
            producer.publish({"n": 1}, routing_key=QUEUE)
        first = len(sent)
        for n in (2, 3):
            with conn.transaction(), kombu_pgqueue.transaction(conn):
                producer.publish({"n": n}, routing_key=QUEUE)

    assert first == 2  # the check, then the publish
    assert len(sent) == first + 2  # later blocks on this connection: their publish only
    assert _messages(dsn, schema) == 3


# -- other servers: throwaway clusters (tests/clusters.py) ------------------------------------


@pytest.mark.slow
def test_a_server_copied_from_the_brokers_is_another_server(schema: str) -> None:
    with Cluster.primary(name="tx_broker") as primary:
        dsn = primary.create_database("app")
        kombu_pgqueue.migrate(dsn, schema)
        # a base backup, promoted: what a restored snapshot is. It has the broker's
        # system identifier, database oids and schema, and takes writes of its own
        copy = primary.standby(name="tx_copy")
        copy.promote()
        broker = Connection(broker_url(dsn), transport_options={"schema": schema})
        try:
            with psycopg.connect(copy.dsn_for("app")) as conn:
                with conn.transaction(), kombu_pgqueue.transaction(conn):
                    with pytest.raises(ConfigurationError) as caught:
                        Producer(broker).publish({"n": 1}, routing_key=QUEUE)
        finally:
            broker.release()
        assert f":{copy.port} " in str(caught.value)
        assert f":{primary.port} " in str(caught.value)
        assert _messages(copy.dsn_for("app"), schema) == 0


@pytest.mark.slow
def test_a_restart_of_the_brokers_server_is_still_the_brokers_server(schema: str) -> None:
    with Cluster.primary(name="tx_restart") as primary:
        dsn = primary.create_database("app")
        kombu_pgqueue.migrate(dsn, schema)
        broker = Connection(broker_url(dsn), transport_options={"schema": schema})
        try:
            producer = Producer(broker)
            for n in (1, 2):
                if n == 2:
                    # a new start time: what the broker read before the restart is stale
                    primary.stop("fast")
                    primary.start()
                with psycopg.connect(dsn) as conn:
                    with conn.transaction(), kombu_pgqueue.transaction(conn):
                        producer.publish({"n": n}, routing_key=QUEUE, retry=True)
        finally:
            broker.release()
        assert _messages(dsn, schema) == 2
