"""Kombu-level helpers: broker URLs with changed fields, and the server's clock."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kombu_pgqueue import embedded


@pytest.fixture
def url_with(dsn: str) -> Callable[..., str]:
    """``url_with(dbname=...)``: the test database's broker URL with fields changed."""

    def url_with(**changes: str) -> str:
        params = conninfo_to_dict(dsn) if dsn else {}
        params.update(changes)
        return embedded.broker_url(make_conninfo(**params))

    return url_with


@pytest.fixture
def later(db: psycopg.Connection) -> Callable[[float], datetime]:
    """``later(s)``: the server's now plus ``s`` seconds, read at each call."""

    def later(seconds: float = 0.0) -> datetime:
        row = db.execute("SELECT now() + make_interval(secs => %s)", (seconds,)).fetchone()
        assert row is not None
        return row[0]

    return later
