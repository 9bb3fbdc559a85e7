"""A ``schema`` option that names a schema the application already uses: installing
pgqueue there stops with one line that names the schema, the table in the way and
what to do, and leaves the application's table as it was."""

from __future__ import annotations

import psycopg
import pytest
from kombu import Connection, Producer
from psycopg import sql

import kombu_pgqueue


@pytest.fixture
def app_schema(db: psycopg.Connection, schema: str) -> str:
    """``schema`` holding the application's own ``message`` table (one row)."""
    table = sql.Identifier(schema, "message_store")
    db.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    db.execute(sql.SQL("CREATE TABLE {} (id int, body text)").format(table))
    db.execute(sql.SQL("INSERT INTO {} VALUES (1, 'the application''s')").format(table))
    return schema


def _says_what_collides(error: BaseException, schema: str) -> None:
    text = str(error)
    assert "\n" not in text
    assert repr(schema) in text and "message" in text
    assert "schema" in text and "transport option" in text


def test_migrate_into_an_application_schema_names_the_collision(
    dsn: str, db: psycopg.Connection, app_schema: str
) -> None:
    with pytest.raises(kombu_pgqueue.SchemaError) as raised:
        kombu_pgqueue.migrate(dsn, app_schema)

    _says_what_collides(raised.value, app_schema)
    rows = db.execute(sql.SQL("SELECT * FROM {}.message_store").format(sql.Identifier(app_schema)))
    assert rows.fetchall() == [(1, "the application's")]


def test_auto_migrate_into_an_application_schema_names_the_collision(
    broker_base_url: str, app_schema: str
) -> None:
    with Connection(broker_base_url, transport_options={"schema": app_schema}) as conn:
        with pytest.raises(kombu_pgqueue.SchemaError) as raised:
            Producer(conn).publish(
                "x", routing_key="q", retry=True, retry_policy={"max_retries": 2}
            )

    _says_what_collides(raised.value, app_schema)
