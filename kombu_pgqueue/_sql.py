"""The broker's SQL: ``sql/queries.sql`` parsed into named statements.

Each statement is written once, under a ``-- name: <name> :<kind>`` header, with
``{schema}`` where the schema goes. :func:`queries` composes them for one schema
with :class:`psycopg.sql.Identifier`, so a schema name can never be read as SQL.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

_HEADER = re.compile(r"^-- name: (?P<name>\w+) :(?P<kind>one|many|none)\s*$", re.MULTILINE)


@cache
def raw_queries() -> dict[str, str]:
    """Return ``{name: statement text}`` with ``{schema}`` still in place.

    Every ``sql/*.sql`` file holds named statements (``queries.sql`` the runtime ones,
    ``monitoring.sql`` the operators'); a name may appear once in all of them.
    """
    folder = resources.files(__package__).joinpath("sql")
    found: dict[str, str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        text = entry.read_text(encoding="utf-8")
        headers = list(_HEADER.finditer(text))
        for header, following in zip(headers, headers[1:] + [None]):
            end = following.start() if following else len(text)
            if header["name"] in found:
                raise RuntimeError(f"query {header['name']!r} is named twice ({entry.name})")
            found[header["name"]] = text[header.end() : end].strip()
    return found


@cache
def queries(schema: str) -> dict[str, sql.Composed]:
    """Return every named statement composed for ``schema``."""
    ident = sql.Identifier(schema)
    return {name: sql.SQL(text).format(schema=ident) for name, text in raw_queries().items()}


def migration_files() -> list[tuple[int, str, str]]:
    """Return ``(version, slug, text)`` for every migration, oldest first."""
    folder = resources.files(__package__).joinpath("sql", "migrations")
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match:
            found.append((int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    return sorted(found)


def compose(text: str, schema: str) -> sql.Composed:
    """Compose a migration's text for ``schema``."""
    return sql.SQL(text).format(schema=sql.Identifier(schema))
