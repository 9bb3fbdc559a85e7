"""Store-level fixtures: a throwaway role."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql


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
