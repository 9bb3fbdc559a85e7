"""Store-level tests move time with the server's clock, never by sleeping."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import psycopg
import pytest


@pytest.fixture
def later(db: psycopg.Connection) -> Callable[[float], datetime]:
    """``later(s)``: the server's now plus ``s`` seconds, read at each call."""

    def later(seconds: float = 0.0) -> datetime:
        row = db.execute("SELECT now() + make_interval(secs => %s)", (seconds,)).fetchone()
        assert row is not None
        return row[0]

    return later

