"""Store-level tests move time with the server's clock, never by sleeping."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import datetime

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kombu_pgqueue import embedded


@pytest.fixture
def later(db: psycopg.Connection) -> Callable[[float], datetime]:
    """``later(s)``: the server's now plus ``s`` seconds, read at each call."""

    def later(seconds: float = 0.0) -> datetime:
        row = db.execute("SELECT now() + make_interval(secs => %s)", (seconds,)).fetchone()
        assert row is not None
        return row[0]

    return later


@pytest.fixture
def url_with(dsn: str) -> Callable[..., str]:
    """``url_with(user=..., dbname=...)``: the test database's broker URL with fields changed."""

    def url_with(**changes: str) -> str:
        params = conninfo_to_dict(dsn) if dsn else {}
        params.update(changes)
        return embedded.broker_url(make_conninfo(**params))

    return url_with


@pytest.fixture
def role(db: psycopg.Connection) -> Iterator[str]:
    """A LOGIN role with no privileges beyond PUBLIC's; dropped afterwards."""
    name = f"pgq_role_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(name)
    db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
    try:
        yield name
    finally:
        db.execute(sql.SQL("DROP OWNED BY {}").format(ident))
        db.execute(sql.SQL("DROP ROLE {}").format(ident))
