"""Fixtures of the enqueue-in-a-transaction tests of Django (test_django) and of
SQLAlchemy's async handles (test_async_sqlalchemy): their app and the messages another
session sees. Their task is ``shipping.py``'s."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import psycopg
import pytest
from celery import Celery
from celery_apps import celery_app
from psycopg import sql


@pytest.fixture
def app(dsn: str, schema: str) -> Iterator[Celery]:
    """An app without results on the test schema, migrated."""
    app = celery_app(dsn, schema, main=f"eco_{schema}", results=False)
    with app.connection_for_write() as conn:
        conn.default_channel  # noqa: B018 - connecting migrates the schema
    yield app
    app.close()


@pytest.fixture
def messages(db: psycopg.Connection, schema: str) -> Callable[[], list[str]]:
    """The argsrepr of every message row, as another session sees them."""
    query = sql.SQL("SELECT headers->>'argsrepr' FROM {}.message_store ORDER BY id")

    def messages() -> list[str]:
        return [r for (r,) in db.execute(query.format(sql.Identifier(schema))).fetchall()]

    return messages
